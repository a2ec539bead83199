"""Liveness is judged by one rule (api/services/reads/liveness.py) wherever a node is read: a node
exactly on the stale and offline boundaries, one a microsecond past each, a decommissioned node
(which would otherwise be stale) and a server-refreshed (`local`) one get the same verdict from
the node list, its liveness filter, one node, the console's fleet page and counts, /metrics and
the as-of read; and until when a verdict holds comes from the same thresholds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.http.app import create_app
from api.http.context import AppContext
from api.services.audit import AuditRepository
from api.services.metrics.snapshot import read_snapshot
from api.services.reads.fleet import FleetQuery
from api.services.reads.liveness import LIVENESS_STATES, LivenessInput, LivenessPolicy, judge
from api.services.reads.repository import HardwareRepository
from api.wiring import Services, build_services
from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation
from domain.node import node_id_for
from ledger.events import EventMetadata
from runtime.secrets import digest
from tests.builders import host, scan
from tests.conftest import OPERATOR_TOKEN

POLICY = LivenessPolicy(stale_after=60.0, offline_after=300.0)
US = timedelta(microseconds=1)
STALE = timedelta(seconds=POLICY.stale_after)
OFFLINE = timedelta(seconds=POLICY.offline_after)


@dataclass(frozen=True)
class Case:
    hostname: str
    received_at: datetime
    expected: str
    until: datetime | None
    source: str = "agent"
    decommissioned: bool = False


def cases(now: datetime) -> list[Case]:
    """The nodes, judged at `now`."""
    return [
        Case("at-stale-edge", now - STALE, "online", now),
        Case("past-stale-edge", now - STALE - US, "stale", now - STALE - US + OFFLINE),
        Case("at-offline-edge", now - OFFLINE, "stale", now),
        Case("past-offline-edge", now - OFFLINE - US, "offline", None),
        # Stale by its report, offline because it left the fleet.
        Case("decommissioned", now - STALE - timedelta(seconds=40), "offline", None, decommissioned=True),
        # Refreshed by the server itself: local, whatever its age.
        Case("refreshed-here", now - OFFLINE * 3, "local", None, source="local"),
    ]


AUTH = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


def node_of(case: Case) -> str:
    return node_id_for(f"liveness-test/{case.hostname}")


async def seed(services: Services, now: datetime) -> None:
    for case in cases(now):
        at = case.received_at
        outcome = await services.inventory.reconcile_observation(
            NodeIdentity(key=f"liveness-test/{case.hostname}", source="configured"),
            HardwareObservation(observed_at=at, host=host(case.hostname), nvml=scan([])),
            EventMetadata(received_at=at, source=case.source, observed_at=at),  # type: ignore[arg-type]
        )
        assert outcome.outcome == "succeeded", outcome
        if case.decommissioned:
            preview = await services.decommission.preview(node_of(case))
            await services.decommission.execute(node_of(case), preview.generation, preview.digest, "retired")


class Fleet:
    def __init__(
        self, pool: asyncpg.Pool, repository: HardwareRepository, client: httpx.AsyncClient, now: datetime
    ) -> None:
        self.pool = pool
        self.repository = repository
        self.client = client
        self.now = now
        self.cases = cases(now)

    async def get(self, path: str, **params: str) -> Any:
        r = await self.client.get(path, params=params, headers=AUTH)
        assert r.status_code == 200, r.text
        return r.json() if r.headers["content-type"].startswith("application/json") else r.text


@pytest.fixture
async def fleet(pool: asyncpg.Pool) -> AsyncIterator[Fleet]:
    # The moment every read judges at: ahead of the wall clock, so an as-of read at it folds every
    # event the test writes, and every report is in the past of the wall clock too.
    now = datetime.now(UTC).replace(microsecond=123456) + timedelta(seconds=60)
    repository = HardwareRepository(pool, POLICY, clock=lambda: now)
    services = build_services(pool, repository=repository)
    await seed(services, now)
    context = AppContext(
        pool=pool,
        service=services.inventory,
        repository=repository,
        admin_token_hash=digest(OPERATOR_TOKEN),
        local_refresh_enabled=False,
        services=services,
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(context)), base_url="http://t"
    ) as c:
        yield Fleet(pool, repository, c, now)


def expected(fleet: Fleet) -> dict[str, str]:
    return {node_of(c): c.expected for c in fleet.cases}


async def test_every_read_judges_a_node_as_the_rule_does(fleet: Fleet) -> None:
    want = expected(fleet)
    listed = (await fleet.get("/api/v1/hardware/nodes", limit="1000"))["items"]
    assert {n["id"]: n["liveness"] for n in listed} == want

    for state in LIVENESS_STATES:
        found = (await fleet.get("/api/v1/hardware/nodes", liveness=state, limit="1000"))["items"]
        assert {n["id"] for n in found} == {k for k, v in want.items() if v == state}, state
        assert {n["liveness"] for n in found} <= {state}

    for node_id, verdict in want.items():
        assert (await fleet.get(f"/api/v1/hardware/nodes/{node_id}"))["liveness"] == verdict
        body = await fleet.repository.nodes.get(node_id)
        assert body is not None and body.liveness == verdict

    # The fleet shows every node with its verdict; its counts and its liveness filter are of the
    # nodes in service, the decommissioned ones counted apart.
    rows, counts, _ = await fleet.repository.fleet.page(FleetQuery(), cursor=None, limit=1000)
    assert {r.node.id: r.node.liveness for r in rows} == want
    retired = {node_of(c) for c in fleet.cases if c.decommissioned}
    serving = [v for k, v in want.items() if k not in retired]
    assert counts.liveness == {s: n for s in LIVENESS_STATES if (n := serving.count(s))}
    assert counts.decommissioned == len(retired) > 0
    for state in LIVENESS_STATES:
        rows, _, _ = await fleet.repository.fleet.page(FleetQuery(liveness=state), cursor=None, limit=1000)
        assert {r.node.id for r in rows} == {k for k, v in want.items() if v == state and k not in retired}, (
            state
        )

    # /metrics exports the nodes in service, each with its state set to the same verdict.
    text = await fleet.get("/metrics")
    shown = {
        s.labels["node_id"]: s.labels["liveness"]
        for f in text_string_to_metric_families(text)
        if f.name == "modelforge_node_liveness"
        for s in f.samples
        if s.value == 1
    }
    in_service = {node_of(c) for c in fleet.cases if not c.decommissioned}
    assert shown == {k: v for k, v in want.items() if k in in_service}
    snapshot = await read_snapshot(fleet.pool, POLICY, {}, fleet.now)
    assert {n.node_id: n.liveness for n in snapshot.nodes} == shown

    # As of the same moment, folded from the log: the same verdicts, and its filter agrees.
    audit = AuditRepository(fleet.pool, POLICY)
    past = await audit.nodes_as_of(fleet.now)
    assert {n.id: n.liveness for n in past.items} == want
    for state in LIVENESS_STATES:
        narrowed = await audit.nodes_as_of(fleet.now, liveness=state)
        assert {n.id for n in narrowed.items} == {k for k, v in want.items() if v == state}, state
    for node_id, verdict in want.items():
        one = await audit.node_as_of(fleet.now, node_id)
        assert one is not None and one.liveness == verdict
    as_of = await fleet.get("/api/v1/hardware/nodes", as_of=fleet.now.isoformat())
    assert {n["id"]: n["liveness"] for n in as_of["items"]} == want


async def test_a_verdict_holds_until_the_next_threshold_and_no_longer(fleet: Fleet) -> None:
    for case in fleet.cases:
        loaded = await fleet.repository.nodes.render(node_of(case))
        assert loaded is not None
        _, until = loaded
        assert until == case.until, case.hostname


async def test_the_rule_over_rows_outside_the_tables_meets_its_definition(pool: asyncpg.Pool) -> None:
    """`judge` (the as-of reads' way to the rule) against the rule's definition, at and around
    both thresholds, for every source and status."""
    now = datetime.now(UTC)
    ages = [timedelta(0), STALE - US, STALE, STALE + US, OFFLINE - US, OFFLINE, OFFLINE + US, OFFLINE * 10]
    inputs: list[LivenessInput] = []
    for status in ("active", "decommissioned"):
        for source in ("agent", "local", None):
            inputs.append(LivenessInput(status, source, None))
            inputs += [LivenessInput(status, source, now - age) for age in ages]

    def definition(n: LivenessInput) -> str:
        if n.status == "decommissioned":
            return "offline"
        if n.source == "local":
            return "local"
        if n.received_at is None:
            return "offline"
        age = now - n.received_at
        return "online" if age <= STALE else "stale" if age <= OFFLINE else "offline"

    async with pool.acquire() as conn:
        got = await judge(conn, POLICY, inputs, now)
        assert await judge(conn, POLICY, [], now) == []
    assert got == [definition(n) for n in inputs]
