"""A GPU's history by UUID and the lemon GPUs over the HTTP API on a real PostgreSQL: a GPU with
XID 79 on node A moved to node B keeps its history (both nodes, its events on each, in commit
order, page after page) and ranks first among the lemons; a viewer token reads both; an unknown
UUID is a 404 and a bad `since` a 400, as problem+json; the reads use their indexes."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from api.http.console.routes import COOKIE
from api.services.reads.lemons import FAILURES
from api.services.scopes import OperatorTokens
from ledger.reading import Checkpoint, LogFilter, _log_query
from ledger.store import EventStore
from tests.lemons_support import (
    MOVED,
    MOVED_SERVICE_DAYS,
    NEIGHBOUR,
    NODE_A,
    NODE_B,
    NODE_C,
    NOW,
    STEADY,
    seed_moved_gpu,
)

HISTORY = f"/api/v1/hardware/gpus/{MOVED}/history"
LEMONS = "/api/v1/hardware/health/lemons"


@pytest.fixture
async def api(make_api: Any, store: EventStore) -> Any:
    harness = make_api()
    await seed_moved_gpu(store)
    await harness.settle()
    return harness


async def test_a_moved_gpu_keeps_its_history_on_both_nodes(api: Any) -> None:
    r = await api.get(HISTORY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["uuid"], body["model"], body["has_more"]) == (MOVED, "NVIDIA H200", False)
    nodes = [(n["node_id"], n["hostname"], n["status"], n["health"]) for n in body["nodes"]]
    assert nodes == [(NODE_A, "lemon-a", "missing", "failed"), (NODE_B, "lemon-b", "active", "healthy")]
    assert round(body["nodes"][0]["days"], 3) == 1.0
    assert round(body["nodes"][1]["days"], 3) == round(3 - 1 / 24, 3)
    events = [(e["node_id"], e["event_type"]) for e in body["items"]]
    assert events == [
        (NODE_A, "ACCELERATOR_DISCOVERED"),
        (NODE_A, "ACCELERATOR_XID_OBSERVED"),
        (NODE_A, "ACCELERATOR_HEALTH_CHANGED"),
        (NODE_A, "ACCELERATOR_MISSING"),
        (NODE_B, "ACCELERATOR_DISCOVERED"),
    ]
    assert all(e["class"] == "lifecycle" and e["data"]["uuid"] == MOVED for e in body["items"])
    xid = body["items"][1]["data"]
    assert xid["code"] == 79
    failed = body["items"][2]["data"]
    assert (failed["before"], failed["after"], [x["code"] for x in failed["reasons"]]) == (
        "healthy",
        "failed",
        ["xid_79"],
    )
    positions = [e["global_position"] for e in body["items"]]
    assert positions == sorted(positions)
    # Another GPU's events are not in it; its own history is its own.
    other = (await api.get(f"/api/v1/hardware/gpus/{NEIGHBOUR}/history")).json()
    assert [n["node_id"] for n in other["nodes"]] == [NODE_A]
    assert {e["data"]["uuid"] for e in other["items"]} == {NEIGHBOUR}
    assert "ACCELERATOR_HEALTH_CHANGED" in {e["event_type"] for e in other["items"]}


async def test_the_history_pages_across_boundaries_in_commit_order(api: Any) -> None:
    whole = (await api.get(HISTORY)).json()["items"]
    for limit in (1, 2, 3, 4):
        seen: list[dict[str, Any]] = []
        cursor = None
        pages = 0
        while True:
            params: dict[str, Any] = {"limit": limit, **({"cursor": cursor} if cursor else {})}
            r = await api.get(HISTORY, params=params)
            assert r.status_code == 200, r.text
            page = r.json()
            assert len(page["items"]) <= limit
            # every page carries the GPU's nodes
            assert [n["node_id"] for n in page["nodes"]] == [NODE_A, NODE_B]
            seen += page["items"]
            pages += 1
            cursor = page["next_cursor"]
            if not page["has_more"]:
                break
        assert seen == whole, limit
        assert pages >= len(whole) // limit
    # Read again from the last cursor: nothing new, the same cursor back (as /events).
    again = (await api.get(HISTORY, params={"cursor": cursor})).json()
    assert (again["items"], again["next_cursor"], again["has_more"]) == ([], cursor, False)


async def test_the_moved_gpu_ranks_first_among_the_lemons(api: Any) -> None:
    r = await api.get(LEMONS)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["failure"] == "ACCELERATOR_HEALTH_CHANGED into failed"
    assert body["total"] == 2
    first, second = body["items"]
    assert (first["rank"], first["uuid"], first["failures"]) == (1, MOVED, 1)
    assert abs(first["service_days"] - MOVED_SERVICE_DAYS) < 0.01
    assert abs(first["failures_per_day"] - 1 / MOVED_SERVICE_DAYS) < 0.01
    # where it is now, and every node it was in
    assert (first["node_id"], first["status"], first["health"]) == (NODE_B, "active", "healthy")
    assert [n["node_id"] for n in first["nodes"]] == [NODE_A, NODE_B]
    (evidence,) = first["evidence"]
    assert (evidence["event_type"], evidence["node_id"], evidence["hostname"], evidence["reasons"]) == (
        "ACCELERATOR_HEALTH_CHANGED",
        NODE_A,
        "lemon-a",
        ["xid_79"],
    )
    history = (await api.get(HISTORY)).json()["items"]
    assert evidence["global_position"] == history[2]["global_position"]
    # One failure in 79 days of service ranks below.
    assert (second["rank"], second["uuid"], second["node_id"]) == (2, STEADY, NODE_C)
    assert abs(second["service_days"] - 79) < 0.01
    assert second["evidence"][0]["reasons"] == ["ecc_uncorrected"]
    # The degraded neighbour never failed: not a lemon.
    assert NEIGHBOUR not in {g["uuid"] for g in body["items"]}

    # A window after the moved GPU's failure leaves only the other one; `limit` cuts the list.
    six_days = (datetime.now(UTC) - timedelta(days=6)).isoformat()
    recent = (await api.get(LEMONS, params={"since": six_days})).json()
    assert [g["uuid"] for g in recent["items"]] == [STEADY]
    top = (await api.get(LEMONS, params={"limit": 1})).json()
    assert (top["total"], [g["uuid"] for g in top["items"]]) == (2, [MOVED])


async def test_a_viewer_token_reads_history_and_lemons(api: Any) -> None:
    viewer = {"Authorization": f"Bearer {(await OperatorTokens(api.pool).create(ttl_seconds=3600)).token}"}
    r = await api.client.get(HISTORY, headers=viewer)
    assert r.status_code == 200 and len(r.json()["items"]) == 5, r.text
    r = await api.client.get(LEMONS, headers=viewer)
    assert r.status_code == 200 and r.json()["items"][0]["uuid"] == MOVED, r.text
    assert (await api.client.get(LEMONS)).status_code == 401


async def _problem(api: Any, path: str, status: int, **params: Any) -> dict[str, Any]:
    r = await api.get(path, params=params)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = r.json()
    return body


async def test_unknown_uuid_and_bad_since_are_problems(api: Any) -> None:
    unknown = await _problem(api, "/api/v1/hardware/gpus/GPU-nope/history", 404)
    assert unknown["type"].endswith("/gpu-not-found") and "GPU-nope" in unknown["detail"]
    # Not a time at all: refused with every other `since` of the API, naming it.
    for since in ("yesterday", "90d", "-3d", ""):
        bad = await _problem(api, LEMONS, 400, since=since)
        assert "since" in bad["detail"], (since, bad)
    # A time, but no window: in the future, now, or more than ten years back.
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    for since in (future, "2999-01-01T00:00:00Z", "1990-01-01T00:00:00Z"):
        bad = await _problem(api, LEMONS, 400, since=since)
        assert (bad["type"].endswith("/invalid-parameter"), bad["parameter"]) == (True, "since"), since
    assert "limit" in str(await _problem(api, LEMONS, 400, limit=0))
    cursor = await _problem(api, HISTORY, 400, cursor="not-a-cursor")
    assert cursor["type"].endswith("/invalid-cursor")


async def test_the_reads_use_their_indexes(api: Any) -> None:
    async with api.pool.acquire() as conn:
        await conn.execute("SET enable_seqscan = off")
        statement = _log_query(Checkpoint(), LogFilter(gpu_uuid=MOVED), 101)
        plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + statement.text, *statement.args))
        assert "events_permanent_gpu_uuid_idx" in plan, plan
        # the day segments (telemetry only) are not searched at all
        assert "events_d" not in plan, plan
        plan = "\n".join(
            r[0]
            for r in await conn.fetch(
                "EXPLAIN " + FAILURES.sql, *FAILURES.args({"since": NOW - timedelta(days=90), "until": NOW})
            )
        )
        assert "events_permanent_gpu_failed_idx" in plan and "events_d" not in plan, plan
        # there are day segments to leave out
        assert await conn.fetchval("SELECT count(*) FROM event_segments") > 0


async def test_the_console_lists_the_lemons(api: Any) -> None:
    viewer = (await OperatorTokens(api.pool).create(ttl_seconds=3600)).token
    r = await api.client.post("/console/login", data={"token": viewer, "next": "/console/lemons"})
    assert r.status_code == 303, r.text
    api.client.cookies.set(COOKIE, viewer)
    page = await api.client.get("/console/lemons")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text
    html = page.text
    assert '<a href="/console/lemons">Lemons</a>' in html  # in the nav of every page
    assert "2 GPUs failed between" in html
    ranks = re.findall(r'<tr data-gpu="([^"]+)" data-rank="(\d+)">', html)
    assert ranks == [(MOVED, "1"), (STEADY, "2")]
    first = html[html.index(f'data-gpu="{MOVED}"') : html.index(f'data-gpu="{STEADY}"')]
    assert f'data-node="{NODE_A}"' in first and f'data-node="{NODE_B}"' in first
    assert "lemon-a</a> (missing" in first and "xid_79" in first
    history = (await api.get(HISTORY)).json()["items"]
    assert f'data-position="{history[2]["global_position"]}"' in first
    recent = await api.client.get("/console/lemons", params={"since": "6d"})
    assert re.findall(r'data-rank="(\d+)"', recent.text) == ["1"] and STEADY in recent.text
    refused = await api.client.get("/console/lemons", params={"since": "lately"})
    assert refused.status_code == 400 and "lately" in refused.text
    api.client.cookies.clear()
    signed_out = await api.client.get("/console/lemons")
    assert signed_out.status_code == 303
