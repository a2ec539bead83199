"""The GPU health policy over HTTP (operator routes) on a real PostgreSQL: show, apply (audited;
a bad document changes nothing), verdicts that name the policy and their evidence, `rebuild
--verify` exact, and the backtest (paged, nothing written)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx

from api.services.health_policy import HealthPolicies
from api.services.inventory import HardwareInventoryService
from api.services.scopes import OperatorTokens
from collectors.gpu_health import XidOccurrence
from domain.health_policy import DEFAULT_POLICY, load_policy
from ledger.events import (
    HEALTH_POLICY_STREAM,
    AcceleratorHealthChanged,
    AcceleratorXidObserved,
    NodeTelemetryObserved,
    RecordedEvent,
)
from ledger.reading import EVENT_COLUMNS, event_from_row
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild
from tests.builders import gpu, signals, with_health
from tests.console_support import report
from tests.test_api_conventions import AUTH, client  # noqa: F401  # the fixture
from tests.test_health_policy import XID_13_THRICE

POLICY = "/api/v1/hardware/health/policy"
BACKTEST = "/api/v1/hardware/health/backtest"


async def log_size(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn:
        count: int = await conn.fetchval("SELECT count(*) FROM events")
        return count


async def every_event(pool: asyncpg.Pool) -> list[RecordedEvent]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(f"SELECT {EVENT_COLUMNS} FROM events ORDER BY global_position")
    return [event_from_row(r) for r in rows]


def thrice(minutes_ago: float) -> list[XidOccurrence]:
    now = datetime.now(UTC).replace(microsecond=0)
    return [XidOccurrence(code=13, at=now - timedelta(minutes=minutes_ago - k)) for k in range(3)]


async def test_a_bad_policy_is_refused_naming_line_and_key_and_nothing_changes(
    pool: asyncpg.Pool,
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    shown = (await client.get(POLICY, headers=AUTH)).json()
    assert (shown["name"], shown["digest"], shown["default"], shown["since_position"]) == (
        "default",
        DEFAULT_POLICY.digest,
        True,
        None,
    )
    before = await log_size(pool)
    bad = XID_13_THRICE.replace('window = "1h"', 'window = "-1h"')
    r = await client.post(POLICY, json={"policy": bad}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["detail"].startswith("line 19: xid[1].window: '-1h' is not a duration"), problem
    assert problem["where"] == "line 19: xid[1].window"
    unknown = XID_13_THRICE.replace('signal = "row_remap_pending"', 'signal = "vibes"')
    r = await client.post(POLICY, json={"policy": unknown}, headers=AUTH)
    assert r.status_code == 400 and "signal[0].signal: unknown signal 'vibes'" in r.json()["detail"]
    r = await client.post(POLICY, json={"policy": XID_13_THRICE.replace("[79]", "[0]")}, headers=AUTH)
    assert r.status_code == 400 and "XID 0 is out of range" in r.json()["detail"]
    assert await log_size(pool) == before
    assert (await client.get(POLICY, headers=AUTH)).json()["digest"] == DEFAULT_POLICY.digest
    r = await client.post(POLICY, json={"policy": XID_13_THRICE}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    # A viewer token reads the policy in force; applying and backtesting are the operator's.
    viewer = {"Authorization": f"Bearer {(await OperatorTokens(pool).create(ttl_seconds=None)).token}"}
    assert (await client.get(POLICY, headers=viewer)).status_code == 200
    assert (await client.post(POLICY, json={"policy": XID_13_THRICE}, headers=viewer)).status_code == 403
    assert (await client.post(BACKTEST, json={"policy": XID_13_THRICE}, headers=viewer)).status_code == 403
    assert await log_size(pool) == before


async def test_a_verdict_names_the_xids_of_earlier_reports_as_its_evidence(
    pool: asyncpg.Pool,
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    """The third XID of a rule that counts three arrives a report after the first two: the
    verdict's evidence is all three XID events, the two the GPU remembered and the new one."""
    r = await client.post(POLICY, json={"policy": XID_13_THRICE, "actor": "ana"}, headers=AUTH)
    assert r.status_code == 200, r.text
    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    first, second, third = thrice(10)
    await report(service, "policy-b", [with_health(gpu(1), signals(xids=[first, second])), gpu(2)])
    node_events = [e for e in await every_event(pool) if e.stream_id != HEALTH_POLICY_STREAM]
    assert not [e for e in node_events if isinstance(e.payload, AcceleratorHealthChanged)]
    await report(service, "policy-b", [with_health(gpu(1), signals(xids=[third])), gpu(2)])
    node_events = [e for e in await every_event(pool) if e.stream_id != HEALTH_POLICY_STREAM]
    (changed,) = [e for e in node_events if isinstance(e.payload, AcceleratorHealthChanged)]
    assert isinstance(changed.payload, AcceleratorHealthChanged)
    by_version = {e.stream_version: e for e in node_events if e.stream_id == changed.stream_id}
    named = [by_version[v].payload for v in changed.payload.evidence[:-1]]
    assert [(type(x), x.at) for x in named] == [  # type: ignore[union-attr]
        (AcceleratorXidObserved, first.at),
        (AcceleratorXidObserved, second.at),
        (AcceleratorXidObserved, third.at),
    ]
    assert isinstance(by_version[changed.payload.evidence[-1]].payload, NodeTelemetryObserved)


async def test_applied_policy_decides_names_its_digest_and_evidence_and_rebuilds_exactly(
    pool: asyncpg.Pool,
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    r = await client.post(POLICY, json={"policy": XID_13_THRICE, "actor": "ana"}, headers=AUTH)
    assert r.status_code == 200, r.text
    applied = r.json()
    strict = load_policy(XID_13_THRICE)
    assert (applied["name"], applied["digest"], applied["default"], applied["actor"]) == (
        "strict",
        strict.digest,
        False,
        "operator:ana",
    )
    store = EventStore(pool, ALL_PROJECTIONS)
    (event,) = await store.read_stream(HEALTH_POLICY_STREAM)
    assert event.global_position == applied["since_position"] and event.event_class == "lifecycle"
    assert event.payload.policy == XID_13_THRICE  # type: ignore[union-attr]

    service = HardwareInventoryService(store)
    await report(service, "policy-a", [with_health(gpu(1), signals(xids=thrice(10))), gpu(2)])
    node_events = [e for e in await every_event(pool) if e.stream_id != HEALTH_POLICY_STREAM]
    (changed,) = [e for e in node_events if isinstance(e.payload, AcceleratorHealthChanged)]
    p = changed.payload
    assert isinstance(p, AcceleratorHealthChanged)
    assert (p.after, p.action, [r.code for r in p.reasons]) == ("degraded", "reset_gpu", ["xid_13"])
    assert p.policy_digest == strict.digest
    by_version = {e.stream_version: e for e in node_events if e.stream_id == changed.stream_id}
    xids = [by_version[v].payload for v in p.evidence[:-1]]
    assert [type(x) for x in xids] == [AcceleratorXidObserved] * 3
    assert isinstance(by_version[p.evidence[-1]].payload, NodeTelemetryObserved)

    verified = await rebuild(pool, ALL_PROJECTIONS, verify=True)
    assert verified.differences == []

    # Backtest: the shipped rules would never have drained it.
    r = await client.post(BACKTEST, json={"policy": DEFAULT_POLICY.text}, headers=AUTH)
    assert r.status_code == 200, r.text
    result = r.json()
    assert result["in_force"] == strict.digest and result["candidate"] == DEFAULT_POLICY.digest
    assert (result["summary"]["differing"], result["summary"]["drained_later"]) == (1, 1)
    (diff,) = result["items"]
    assert diff["uuid"] == gpu(1).uuid and diff["drained_candidate_at"] is None
    assert diff["drained_in_force_at"] is not None


async def test_backtest_pages_cross_boundaries_and_write_nothing(
    pool: asyncpg.Pool,
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    store = EventStore(pool, ALL_PROJECTIONS)
    service = HardwareInventoryService(store)
    for n in range(3):
        await report(service, f"bt-{n}", [with_health(gpu(10 + n), signals(xids=thrice(30)))])
    before = await log_size(pool)
    seen: list[dict[str, Any]] = []
    cursor = None
    pages = 0
    while True:
        body: dict[str, Any] = {"policy": XID_13_THRICE, "limit": 1, "since_seconds": 86400}
        if cursor:
            body["cursor"] = cursor
        r = await client.post(BACKTEST, json=body, headers=AUTH)
        assert r.status_code == 200, r.text
        page = r.json()
        pages += 1
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3 and page["summary"]["drained_earlier"] == 3
    assert sorted(d["uuid"] for d in seen) == sorted(gpu(10 + n).uuid for n in range(3))
    assert len({d["accelerator_id"] for d in seen}) == 3
    assert await log_size(pool) == before
    # The log read pages too: two events a page gives the same history as one read.
    policies = HealthPolicies(store)
    assert [e.global_position for e in await policies._history(time.perf_counter(), page=2)] == [
        e.global_position for e in await policies._history(time.perf_counter())
    ]
    r = await client.post(BACKTEST, json={"policy": XID_13_THRICE, "limit": 0}, headers=AUTH)
    assert r.status_code == 400 and r.json()["field"] == "limit"
