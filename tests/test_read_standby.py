"""Reads off a hot standby (`MODELFORGE_READ_DATABASE_URL`), with real PostgreSQL 15 processes:
the audit log paged through `GET /events` from the standby is exactly the log the primary holds,
once each in commit order; the change feed's long poll wakes on the standby (it cannot LISTEN
there: it re-reads); `/health` and `/metrics` report the replay lag; with the standby stopped,
reads answer 503 problem+json while agent reports are still taken and the health is degraded."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench import replication
from ledger.reading import Checkpoint
from tests.agent_support import (
    OPERATOR,
    ServerProcess,
    assert_problem,
    create_token,
    enroll_direct,
    post_report,
    report_body,
)
from tests.failover_support import postgres_programs, read_from

__all__ = ["postgres_programs"]  # the fixture, used by name


@pytest.fixture
def pair() -> Iterator[replication.ReplicatedPair]:
    root = Path(tempfile.mkdtemp(prefix="mf-standby-"))
    root.chmod(0o755)
    # Asynchronous replication: the standby may be stopped without holding the primary's commits.
    made = replication.ReplicatedPair.create(root / "pg", synchronous="local", fsync=False)
    try:
        yield made
    finally:
        made.close()
        shutil.rmtree(root, ignore_errors=True)


async def events_from_api(http: httpx.AsyncClient, url: str) -> list[int]:
    ids: list[int] = []
    cursor = None
    while True:
        params: dict[str, str | int] = {"limit": 7}
        if cursor:
            params["cursor"] = cursor
        r = await http.get(url + "/api/v1/hardware/events", params=params, headers=OPERATOR)
        assert r.status_code == 200, r.text
        page = r.json()
        ids.extend(e["global_position"] for e in page["items"])
        cursor = page["next_cursor"]
        if not page["has_more"]:
            return ids


async def test_reads_served_by_the_standby_exactly_once_and_lag_reported(
    postgres_programs: None, pair: replication.ReplicatedPair, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="mf-standby-server-"))
    server = ServerProcess(pair.dsn(), workdir, env={"MODELFORGE_READ_DATABASE_URL": pair.standby.dsn()})
    http = httpx.AsyncClient(timeout=30)
    try:
        server.start()
        await server.wait_healthy(within=60)
        token = (await create_token(http, server.url, uses=1))["token"]
        enrolled = await enroll_direct(http, server.url, token, "standby-reads-1")
        assert enrolled.status_code in (200, 201), enrolled.text
        credential = enrolled.json()["credential"]
        for seq in range(1, 16):
            r = await post_report(
                http, server.url, credential, report_body("standby-reads-1", seq, mem_avail=seq)
            )
            assert r.status_code in (200, 202), r.text
        await asyncio.to_thread(pair.caught_up)

        # The log through the API (pages of 7 from the standby) is the primary's, once each.
        on_primary, _ = await read_from(pair.primary.dsn(), Checkpoint())
        assert await events_from_api(http, server.url) == on_primary

        # The change feed on the standby: a long poll past the end wakes for the next report.
        r = await http.get(server.url + "/api/v1/hardware/events?limit=100", headers=OPERATOR)
        end = r.json()["next_cursor"]
        while r.json()["has_more"]:
            r = await http.get(
                server.url + f"/api/v1/hardware/events?limit=100&cursor={end}", headers=OPERATOR
            )
            end = r.json()["next_cursor"]
        waiting = asyncio.create_task(
            http.get(server.url + f"/api/v1/hardware/events?cursor={end}&wait=20", headers=OPERATOR)
        )
        await asyncio.sleep(0.5)
        r = await post_report(http, server.url, credential, report_body("standby-reads-1", 16, mem_avail=99))
        assert r.status_code in (200, 202), r.text
        woken = await asyncio.wait_for(waiting, 15)
        assert woken.status_code == 200 and woken.json()["items"], woken.text

        health = (await http.get(server.url + "/api/v1/health")).json()
        assert health["replica"]["status"] == "ok" and health["replica"]["replay_lag_seconds"] >= 0, health
        metrics = await http.get(server.url + "/metrics", headers=OPERATOR)
        assert "\nmodelforge_database_replay_lag_seconds " in metrics.text

        # The standby stopped: reads 503 (never 500), reports still taken, health degraded.
        await asyncio.to_thread(pair.standby.stop)
        nodes = await http.get(server.url + "/api/v1/hardware/nodes", headers=OPERATOR)
        assert_problem(nodes, 503)
        assert "retry-after" in nodes.headers
        r = await post_report(http, server.url, credential, report_body("standby-reads-1", 17, mem_avail=98))
        assert r.status_code in (200, 202), r.text
        health_r = await http.get(server.url + "/api/v1/health")
        assert health_r.status_code == 200, health_r.text
        assert (
            health_r.json()["status"] == "degraded" and health_r.json()["replica"]["status"] == "unavailable"
        )
    finally:
        await http.aclose()
        if server.proc is not None:
            assert server.stop() == 0, server.log_text()[-3000:]
        log = server.log_text()
        shutil.rmtree(workdir, ignore_errors=True)
    assert "http.unexpected_error" not in log and "Traceback" not in log, log[-5000:]
    assert "feed.polling_standby" in log
