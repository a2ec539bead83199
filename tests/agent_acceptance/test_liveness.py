"""Liveness by the server's clock: an agent whose clock is 3 h off either way is online while it
reports, then stale, then offline."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import httpx

from tests.agent_acceptance.plane import (
    OFFLINE_AFTER,
    STALE_AFTER,
    parse_moment,
    tag,
    wait_reports,
)
from tests.agent_support import (
    OPERATOR,
    AgentProcess,
    ServerProcess,
    create_token,
)


async def test_clock_skew_of_3h_either_way_is_online_while_reporting_then_stale_and_offline_by_central_clock(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    t = tag()
    token = (await create_token(http, server.url, uses=2))["token"]
    ahead = AgentProcess(tmp_path, f"ahead-{t}", clock_offset=3 * 3600)
    behind = AgentProcess(tmp_path, f"behind-{t}", clock_offset=-3 * 3600)
    agents = [ahead, behind]
    assert [(await a.enroll(server.url, token)).returncode for a in agents] == [0, 0]
    for a in agents:
        a.start(server.url)
    try:
        await wait_reports(db, agents, 3)
        for a, sign in ((ahead, 1), (behind, -1)):
            node = (
                await http.get(f"{server.url}/api/v1/hardware/nodes/{a.expected_node_id}", headers=OPERATOR)
            ).json()
            assert node["liveness"] == "online", node
            assert abs(node["clock_skew_seconds"] - sign * 3 * 3600) < 120, node["clock_skew_seconds"]
    finally:
        assert [a.stop() for a in agents] == [0, 0]

    seen: dict[str, list[tuple[str, float]]] = {a.node_id: [] for a in agents}
    deadline = time.monotonic() + OFFLINE_AFTER + 8
    while time.monotonic() < deadline:
        for a in agents:
            node = (
                await http.get(f"{server.url}/api/v1/hardware/nodes/{a.expected_node_id}", headers=OPERATOR)
            ).json()
            age = time.time() - parse_moment(node["last_received_at"])
            if not seen[a.node_id] or seen[a.node_id][-1][0] != node["liveness"]:
                seen[a.node_id].append((node["liveness"], age))
        if all(s[-1][0] == "offline" for s in seen.values()):
            break
        await asyncio.sleep(0.15)
    for name, states in seen.items():
        order = [s for s, _ in states]
        assert order in (["online", "stale", "offline"], ["stale", "offline"]), (name, states)
        stale_age = next(age for s, age in states if s == "stale")
        offline_age = next(age for s, age in states if s == "offline")
        # Judged by the server's clock against its own receive time (same host clock as this test).
        assert STALE_AFTER - 0.5 <= stale_age <= OFFLINE_AFTER + 0.5, states
        assert offline_age >= OFFLINE_AFTER - 0.5, states
