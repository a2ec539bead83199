"""Agents enrolling and reporting as a fleet: three agents make three nodes and a restart makes no
new one; two servers on one database store no report twice and enforce sequences across both."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import asyncpg
import httpx

from domain.node import node_id_for
from tests.agent_acceptance.plane import (
    OFFLINE_AFTER,
    STALE_AFTER,
    accelerator_counts,
    assert_strictly_increasing,
    discovered_counts,
    more_reports,
    nodes_tagged,
    report_sequences,
    reports_of,
    tag,
    wait_reports,
)
from tests.agent_support import (
    OPERATOR_TOKEN,
    ROOT,
    AgentProcess,
    ServerProcess,
    assert_no_secrets,
    assert_problem,
    clean_env,
    create_token,
    enroll_direct,
    post_report,
    report_body,
    wait_for,
)


async def test_three_agents_enroll_and_report_three_nodes_and_a_restart_makes_no_new_node(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    prefix = f"fleet-{tag()}-"
    # The operator's command line on the server host: one token for three agents.
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "api.cli", "token", "create", "--ttl", "1h", "--uses", "3", "--json"],
        env=clean_env(MODELFORGE_DATABASE_URL=server.dsn, MODELFORGE_STATE_DIR=str(tmp_path / "cli")),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    token = json.loads(out.stdout)["token"]
    gpus = {"a": 2, "b": 3, "c": 1}
    agents = [AgentProcess(tmp_path, prefix + name, gpus=n) for name, n in gpus.items()]
    enrolled = await asyncio.gather(*(a.enroll(server.url, token) for a in agents))
    assert [e.returncode for e in enrolled] == [0, 0, 0], [e.stderr for e in enrolled]
    for a in agents:
        path = a.state_dir / "agent-credential.json"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        assert a.credential()["node_id"] == a.expected_node_id
    try:
        for a in agents:
            a.start(server.url)
        await wait_reports(db, agents, 2)
        nodes = await nodes_tagged(http, server.url, prefix)
        assert sorted(n["id"] for n in nodes) == sorted(a.expected_node_id for a in agents)
        assert all(n["liveness"] == "online" and n["source"] == "agent" for n in nodes)
        ids = [a.expected_node_id for a in agents]
        assert await accelerator_counts(db, ids) == {a.expected_node_id: a.gpus for a in agents}

        # Restart one agent: same node, same accelerators, its sequences continue.
        first = agents[0]
        assert first.stop() == 0
        before = await reports_of(db, first.expected_node_id)
        first.start(server.url)
        await wait_for(
            lambda: more_reports(db, first.expected_node_id, before + 2), 20, "reports after the restart"
        )
        nodes_after = await nodes_tagged(http, server.url, prefix)
        assert sorted(n["id"] for n in nodes_after) == sorted(ids)
        assert await discovered_counts(db, ids) == dict.fromkeys(ids, 1)
        assert await accelerator_counts(db, ids) == {a.expected_node_id: a.gpus for a in agents}
        for node_id in ids:
            assert_strictly_increasing(await report_sequences(db, node_id))
    finally:
        codes = [a.stop() for a in agents if a.proc is not None]
    assert codes == [0, 0, 0]
    for a in agents:
        assert "agent.report_quarantined" not in a.log_text(), a.log_text()[-3000:]
    # The token's three uses are spent.
    r = await enroll_direct(http, server.url, token, prefix + "d")
    assert_problem(r, 401, "enrollment-token-used-up")
    assert_no_secrets(
        {"server": server.log_text(), **{a.node_id: a.log_text() for a in agents}},
        [token, OPERATOR_TOKEN, *(a.credential()["credential"] for a in agents)],
    )


async def test_two_servers_on_one_database_no_duplicates_and_sequences_enforced_across_both(
    server: ServerProcess, plane_dsn: str, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    second = ServerProcess(
        plane_dsn, tmp_path / "second", stale_after=STALE_AFTER, offline_after=OFFLINE_AFTER
    )
    second.start()
    await second.wait_healthy()
    prefix = f"scale-{tag()}-"
    x = AgentProcess(tmp_path, prefix + "x", gpus=2)
    y = AgentProcess(tmp_path, prefix + "y", gpus=3)
    z = AgentProcess(tmp_path, prefix + "z", gpus=2)
    agents = [x, y, z]
    try:
        token = (await create_token(http, server.url, uses=4))["token"]
        assert (await x.enroll(server.url, token)).returncode == 0
        assert (await y.enroll(second.url, token)).returncode == 0
        assert (await z.enroll(server.url, token)).returncode == 0
        x.start(server.url)
        y.start(second.url)
        z.start(server.url)
        await wait_reports(db, agents, 3)
        # z is switched from the first server to the second mid-run.
        assert z.stop() == 0
        switched_at = await reports_of(db, z.expected_node_id)
        z.start(second.url)
        await wait_for(
            lambda: more_reports(db, z.expected_node_id, switched_at + 3), 20, "z via the second server"
        )

        # The same report to both servers at once: one appends, the other answers duplicate.
        key = prefix + "direct"
        credential = (await enroll_direct(http, second.url, token, key)).json()["credential"]
        body = report_body(key, 1)
        both = await asyncio.gather(
            post_report(http, server.url, credential, body), post_report(http, second.url, credential, body)
        )
        assert [r.status_code for r in both] == [200, 200], [r.text for r in both]
        assert sorted(r.json()["status"] for r in both) == ["accepted", "duplicate"]
        # The same next sequence with different content to both at once: exactly one wins.
        racing = await asyncio.gather(
            post_report(http, server.url, credential, report_body(key, 2, mem_avail=1)),
            post_report(http, second.url, credential, report_body(key, 2, mem_avail=2)),
        )
        assert sorted(r.status_code for r in racing) == [200, 409]
        # Older than what the other server accepted: refused here too.
        assert_problem(
            await post_report(http, second.url, credential, report_body(key, 1, mem_avail=3)),
            409,
            "sequence-conflict",
        )
        assert_problem(
            await post_report(http, server.url, credential, report_body(key, 2, mem_avail=4)),
            409,
            "sequence-conflict",
        )
    finally:
        codes = [a.stop() for a in agents if a.proc is not None]
        assert second.stop() == 0, second.log_text()[-3000:]
    assert codes == [0, 0, 0]

    ids = [a.expected_node_id for a in agents] + [node_id_for(key)]
    nodes = await nodes_tagged(http, server.url, prefix)
    assert sorted(n["id"] for n in nodes) == sorted(ids)
    assert await discovered_counts(db, ids) == dict.fromkeys(ids, 1)
    assert await accelerator_counts(db, ids) == {
        x.expected_node_id: 2,
        y.expected_node_id: 3,
        z.expected_node_id: 2,
        ids[-1]: 2,
    }
    for node_id in ids:
        assert_strictly_increasing(await report_sequences(db, node_id))
    assert (await report_sequences(db, ids[-1])) == {"telemetry": [1, 2]}
    for a in agents:
        assert "agent.report_quarantined" not in a.log_text(), a.log_text()[-3000:]
