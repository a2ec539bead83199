"""What the failover tests share: the ledger read through a multi-host URL, a watch on the HTTP
answers during the switch, the server with three reporting agents, and the checks that every
report is stored exactly once and the log still verifies."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from bench import replication
from ledger.reading import Checkpoint, read_log
from tests import debian
from tests.agent_support import OPERATOR, ROOT, AgentProcess, ServerProcess, clean_env, create_token
from tests.test_faults import account


class Ledger:
    """Reads through the multi-host URL (or one node's), one short connection at a time: a pool
    would break with the primary it is about to lose."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn, timeout=5)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()


@pytest.fixture(scope="module")
def postgres_programs() -> None:
    why = replication.missing()
    if why and not (replication.PG_BIN / "initdb").exists():
        problem = debian.install(replication.PG_PACKAGE)
        assert not problem, problem
        why = replication.missing()
    assert not why, why


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mf-failover-"))
    path.chmod(0o755)  # the postgres user reaches its data directories below it
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Watch:
    """Polls a read route and the health route throughout; every answer's status is kept, and
    every 503 must be problem+json with Retry-After."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: dict[tuple[str, int], int] = {}
        self.bad: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                for name, path, headers in (
                    ("nodes", "/api/v1/hardware/nodes", OPERATOR),
                    ("accelerators", "/api/v1/hardware/accelerators", OPERATOR),  # a rendered read
                    ("events", "/api/v1/hardware/events?limit=5", OPERATOR),
                    ("health", "/api/v1/health", {}),
                ):
                    r = await http.get(self.url + path, headers=headers)
                    key = (name, r.status_code)
                    self.statuses[key] = self.statuses.get(key, 0) + 1
                    if (
                        r.status_code == 503
                        and name != "health"
                        and (
                            not r.headers.get("content-type", "").startswith("application/problem+json")
                            or "retry-after" not in r.headers
                        )
                    ):
                        self.bad.append(f"{path}: 503 without problem+json and Retry-After: {r.headers}")
                    if r.status_code >= 500 and r.status_code != 503:
                        self.bad.append(f"{path}: {r.status_code} {r.text[:300]}")
                await asyncio.sleep(0.05)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()  # an httpx error here is a failure of the server
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    def assert_no_500_and_the_outage_seen(self) -> None:
        assert not self.bad, self.bad[:5]
        assert not [k for k in self.statuses if k[1] >= 500 and k[1] != 503], self.statuses
        assert ("health", 503) in self.statuses, "the outage was never seen"


async def serve_with_agents(
    http: httpx.AsyncClient, server: ServerProcess, agents: list[AgentProcess], *, interval: float = 0.2
) -> None:
    """The server started and healthy, every agent enrolled and reporting through it."""
    server.start()
    await server.wait_healthy(within=60)
    token = (await create_token(http, server.url, uses=len(agents)))["token"]
    enrolled = await asyncio.gather(*(a.enroll(server.url, token) for a in agents))
    assert all(e.returncode == 0 for e in enrolled), [a.log_text() for a in agents]
    for a in agents:
        a.start(server.url, interval=interval)


def stop_agents(agents: list[AgentProcess]) -> None:
    for a in agents:
        if a.proc is not None and a.proc.poll() is None:
            assert a.stop() == 0, a.log_text()[-3000:]


async def stored(db: Ledger, agents: list[AgentProcess]) -> set[tuple[str, str, int]]:
    rows = await db.fetch(
        "SELECT stream_id, metadata->>'agent_stream' AS stream, (metadata->>'agent_sequence')::bigint AS seq "
        "FROM events WHERE stream_id = ANY($1::text[]) AND event_type = 'NODE_TELEMETRY_OBSERVED'",
        [a.expected_node_id for a in agents],
    )
    return {(r["stream_id"], r["stream"], r["seq"]) for r in rows}


async def exactly_once(
    db: Ledger, agents: list[AgentProcess], before_kill: set[tuple[str, str, int]], server_log: str
) -> dict[str, int]:
    """Every report accepted before the kill is still there; every report an agent made is stored
    once or still in its spool; no sequence gap; the server logged no unexpected error. Returns
    the figures of `tests.test_faults.account`."""
    figures = await account(db, agents)  # type: ignore[arg-type]
    assert before_kill <= await stored(db, agents), "a report accepted before the kill is missing"
    assert figures["lost"] == 0 and figures["duplicated"] == 0 and figures["gaps"] == 0, figures
    assert "http.unexpected_error" not in server_log and "Traceback" not in server_log, server_log[-5000:]
    # What the rendered reads kept from the old primary's probes is not trusted on the new one.
    assert "rendered.server_changed" in server_log
    return figures


async def read_from(dsn: str, after: Checkpoint) -> tuple[list[int], Checkpoint]:
    """Every event after `after` through the one gap-safe read, page by page, in commit order
    (global positions), and the cursor to resume from."""
    conn = await asyncpg.connect(dsn, timeout=10)
    ids: list[int] = []
    try:
        while True:
            page = await read_log(conn, after, limit=500)
            ids.extend(e.global_position for e in page.entries)
            after = page.resume
            if not page.more:
                return ids, after
    finally:
        await conn.close()


async def assert_cursor_resumes(dsn: str, read_before: list[int], cursor: Checkpoint) -> None:
    """A cursor taken on the old primary, resumed on the new one: the two reads together are the
    whole log, each event once."""
    read_after, _ = await read_from(dsn, cursor)
    everything, _ = await read_from(dsn, Checkpoint())
    assert not set(read_before) & set(read_after)
    assert read_before + read_after == everything


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args],
        env=clean_env(MODELFORGE_DATABASE_URL=dsn),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def assert_verify_clean(dsn: str) -> None:
    """`verify` (hash chains, read models against the log) and `rebuild --verify` exit 0."""
    checks = await asyncio.gather(
        *(asyncio.to_thread(cli, dsn, *args) for args in (("verify",), ("rebuild", "--verify")))
    )
    for done in checks:
        assert done.returncode == 0, (done.args, done.stdout + done.stderr)


async def assert_same_replay(primary_dsn: str, standby_dsn: str) -> None:
    """The gap-safe read of the whole log, and `replay`, are the same on both nodes."""
    on_primary, _ = await read_from(primary_dsn, Checkpoint())
    on_standby, _ = await read_from(standby_dsn, Checkpoint())
    assert on_standby == on_primary and len(set(on_primary)) == len(on_primary)
    replays = await asyncio.gather(
        *(asyncio.to_thread(cli, dsn, "replay", "--format", "jsonl") for dsn in (primary_dsn, standby_dsn))
    )
    for done in replays:
        assert done.returncode == 0, done.stdout + done.stderr
    assert replays[0].stdout == replays[1].stdout and replays[0].stdout.count("\n") >= len(on_primary)
