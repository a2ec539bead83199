"""Webhooks end to end: two real `modelforge-hw serve` processes on one database, subscriptions
made and listed with the `modelforge-hw webhook` commands, events made over HTTP on either
server, each delivered once to each receiver, in commit order; `webhook deliveries` reads the
attempts page after page."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import httpx

from tests.agent_support import OPERATOR_TOKEN, ROOT, ServerProcess, clean_env, create_token
from tests.webhook_support import SECRET, Receiver

WEBHOOK_ENV = {
    "MODELFORGE_WEBHOOK_ALLOW_PRIVATE": "1",
    "MODELFORGE_WEBHOOK_BACKOFF_INITIAL": "0.05",
    "MODELFORGE_WEBHOOK_BACKOFF_MAX": "0.5",
    "MODELFORGE_WEBHOOK_SOURCE": "urn:modelforge:e2e",
}


def cli(server: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env(MODELFORGE_SERVER=server, MODELFORGE_TOKEN=OPERATOR_TOKEN)
    return subprocess.run(
        [sys.executable, "-m", "api.cli", "webhook", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_two_servers_deliver_each_event_once_and_the_cli_shows_it(
    database_dsn: str, tmp_path: Path
) -> None:
    servers = [ServerProcess(database_dsn, tmp_path / f"s{i}", env=WEBHOOK_ENV).start() for i in range(2)]
    receivers = [Receiver().start() for _ in range(2)]
    secret_file = tmp_path / "hook.secret"
    secret_file.write_text(SECRET + "\n")
    try:
        await asyncio.gather(*(s.wait_healthy() for s in servers))
        made = cli(
            servers[0].url,
            "create",
            receivers[0].url,
            "--secret-file",
            str(secret_file),
            "--type",
            "ENROLLMENT_TOKEN_CREATED",
            "-o",
            "json",
        )
        assert made.returncode == 0, made.stderr
        ids = [json.loads(made.stdout)["subscription_id"]]
        async with httpx.AsyncClient() as client:
            r = await client.post(
                servers[1].url + "/api/v1/webhooks",
                json={"url": receivers[1].url, "secret": SECRET, "event_types": ["ENROLLMENT_TOKEN_CREATED"]},
                headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
            )
            assert r.status_code == 201, r.text
            ids.append(r.json()["subscription_id"])
        (tmp_path / "short").write_text("too-short")
        short = cli(servers[1].url, "create", receivers[0].url, "--secret-file", str(tmp_path / "short"))
        assert short.returncode == 2 and "secret" in short.stderr, short.stderr

        async with httpx.AsyncClient() as client:
            made_on = [(await create_token(client, servers[i % 2].url))["token_id"] for i in range(30)]
        for r in receivers:
            await asyncio.to_thread(r.wait_for, 30)
        await asyncio.sleep(1.0)  # time for any second delivery to show
        for r in receivers:
            got = r.positions()
            assert len(got) == 30 and got == sorted(got), "each event once, in commit order"
            assert [d.event["data"]["token_id"] for d in r.deliveries] == made_on
            assert all(d.verified and d.event["source"] == "urn:modelforge:e2e" for d in r.deliveries)

        listed = cli(servers[1].url, "list", "-o", "json")
        assert listed.returncode == 0, listed.stderr
        assert {w["subscription_id"]: w["delivered"] for w in json.loads(listed.stdout)} == {
            i: 30 for i in ids
        }
        table = cli(servers[1].url, "list")
        assert ids[0] in table.stdout and "active" in table.stdout and SECRET not in table.stdout
        attempts = cli(servers[0].url, "deliveries", ids[0], "--limit", "5")
        assert attempts.returncode == 0 and attempts.stdout.count("delivered") == 5, attempts.stdout
        gone = cli(servers[1].url, "delete", ids[1])
        assert gone.returncode == 0 and "deleted" in gone.stdout
        assert cli(servers[1].url, "resume", ids[1]).returncode == 5, "a deleted subscription is not found"
    finally:
        for s in servers:
            s.stop()
        for r in receivers:
            r.stop()
    for s in servers:
        assert SECRET not in s.log_text()


@contextlib.asynccontextmanager
async def one_server(
    database_dsn: str, tmp_path: Path
) -> AsyncIterator[tuple[ServerProcess, Receiver, Path]]:
    """A healthy server, a receiver and a secret file; all stopped after."""
    server = ServerProcess(database_dsn, tmp_path / "s", env=WEBHOOK_ENV).start()
    receiver = Receiver().start()
    secret_file = tmp_path / "hook.secret"
    secret_file.write_text(SECRET + "\n")
    try:
        await server.wait_healthy()
        yield server, receiver, secret_file
    finally:
        server.stop()
        receiver.stop()


async def test_the_deliveries_command_follows_pages_newest_first(database_dsn: str, tmp_path: Path) -> None:
    async with one_server(database_dsn, tmp_path) as (server, receiver, secret_file):
        # A type nothing here makes: the server delivers (and trims) nothing meanwhile.
        made = cli(server.url, "create", receiver.url, "--secret-file", str(secret_file),
                   "--type", "ACCELERATOR_MISSING", "-o", "json")  # fmt: skip
        assert made.returncode == 0, made.stderr
        sid = json.loads(made.stdout)["subscription_id"]
        # More attempts than the route's largest page (500).
        conn = await asyncpg.connect(database_dsn)
        try:
            await conn.execute(
                "INSERT INTO webhook_deliveries (subscription_id, global_position, event_type, attempt, "
                "outcome, status_code, duration_ms) SELECT $1, p, 'ACCELERATOR_MISSING', 1, 'delivered', "
                "200, 2.0 FROM generate_series(1, 520) p",
                sid,
            )
            newest_first = [
                r["global_position"]
                for r in await conn.fetch(
                    "SELECT global_position FROM webhook_deliveries WHERE subscription_id = $1 "
                    "ORDER BY delivery_id DESC",
                    sid,
                )
            ]
        finally:
            await conn.close()
        assert newest_first == list(range(520, 0, -1))
        for limit, expected in ((510, newest_first[:510]), (1000, newest_first), (500, newest_first[:500])):
            shown = cli(server.url, "deliveries", sid, "--limit", str(limit), "-o", "json")
            assert shown.returncode == 0, shown.stderr
            assert [d["global_position"] for d in json.loads(shown.stdout)] == expected, limit
        table = cli(server.url, "deliveries", sid)
        assert table.returncode == 0, table.stderr
        assert table.stdout.count("delivered") == 20 and " 520 " in table.stdout.splitlines()[1]


async def test_a_subscription_to_one_node_names_the_node_as_the_other_commands_do(
    database_dsn: str, tmp_path: Path
) -> None:
    async with one_server(database_dsn, tmp_path) as (server, receiver, secret_file):
        auth = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
        async with httpx.AsyncClient() as client:
            node_id = (await client.post(server.url + "/api/v1/hardware/refresh", headers=auth)).json()[
                "node_id"
            ]
            node = (await client.get(f"{server.url}/api/v1/hardware/nodes/{node_id}", headers=auth)).json()
        made = cli(server.url, "create", receiver.url, "--secret-file", str(secret_file),
                   "--node", node["identity_key"], "-o", "json")  # fmt: skip
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["node_id"] == node_id
        # A name that is no node's is refused, not a subscription that never delivers.
        unknown = cli(
            server.url, "create", receiver.url, "--secret-file", str(secret_file), "--node", "no-such"
        )
        assert unknown.returncode == 5 and "no node" in unknown.stderr, unknown.stderr
        listed = json.loads(cli(server.url, "list", "-o", "json").stdout)
        assert [w["node_id"] for w in listed] == [node_id]
