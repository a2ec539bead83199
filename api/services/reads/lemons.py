"""Lemon GPUs: the fleet's GPUs ranked by failures per day of service over a window, each with the
evidence, the events that are its failures (docs/lemons.md). Two statements whatever the fleet's
size: the failures in the window (the permanent segment's `events_permanent_gpu_failed_idx` holds
only health changes into `failed`), then the nodes of the GPUs that failed; the ranking is
`domain.lemons.rank`."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import asyncpg
import msgspec

from api.services.reads.gpu_history import GpuTenureBody, gpu_places
from api.services.reads.statement import Query
from api.services.reads.telemetry import invalid_parameter
from domain.lemons import DEFAULT_SINCE, Failure, SinceRefused, checked_since, rank, since_of
from ledger.events import HealthStatus


class FailureBody(msgspec.Struct, frozen=True):
    """One failure: the event (its position in the log and its type), when it was received, the
    node and accelerator it happened on, and the reason codes of the `failed` verdict."""

    global_position: int
    event_type: str
    at: datetime
    node_id: str
    hostname: str | None
    accelerator_id: str
    reasons: list[str]


class LemonBody(msgspec.Struct, frozen=True):
    rank: int
    uuid: str
    model: str | None
    failures: int
    service_days: float  # in the window, on every node together
    failures_per_day: float  # failures / max(service_days, 1)
    # Where it is now: the node it was seen on last, that node's accelerator row and verdict.
    node_id: str | None
    accelerator_id: str | None
    status: str | None
    health: HealthStatus | None
    nodes: list[GpuTenureBody]  # every node it was ever in, first seen first
    evidence: list[FailureBody]  # its failures in the window, in the order of the log


class LemonsBody(msgspec.Struct, frozen=True):
    since: datetime
    until: datetime
    # What a failure is, said in the answer: a health transition into `failed`.
    failure: str
    # The GPUs with a failure in the window; `items` the first `limit` of them.
    total: int
    items: list[LemonBody]


FAILURE = "ACCELERATOR_HEALTH_CHANGED into failed"

# The index's predicate stands in the query as it is, so the planner proves the partial index
# usable; the window is on the central receive time, the clock of every first / last seen.
FAILURES = (
    Query(
        "SELECT e.global_position, e.event_type, (e.metadata->>'received_at')::timestamptz AS at, "
        "e.stream_id AS node_id, e.data->>'accelerator_id' AS accelerator_id, "
        "e.data->>'uuid' AS gpu_uuid, "
        "ARRAY(SELECT x->>'code' FROM jsonb_array_elements(e.data->'reasons') x) AS reason_codes "
        "FROM events e"
    )
    .where("e.segment = 'infinity'")
    .where("e.event_type = 'ACCELERATOR_HEALTH_CHANGED'")
    .where("e.data->>'after' = 'failed'")
    .where("(e.metadata->>'received_at')::timestamptz >= {since}")
    .where("(e.metadata->>'received_at')::timestamptz < {until}")
    .add(" ORDER BY e.global_position")
    .build()
)


def window_start(since: datetime | None, now: datetime) -> datetime:
    """`since` as the window's start (default: 90 days back), or a 400 naming the parameter."""
    try:
        return since_of(DEFAULT_SINCE, now) if since is None else checked_since(since, now)
    except SinceRefused as refused:
        raise invalid_parameter("since", str(refused)) from refused


class LemonReads:
    def __init__(self, pool: asyncpg.Pool, clock: Callable[[], datetime]) -> None:
        self.pool = pool
        self.clock = clock

    async def ranked(self, *, since: datetime | None, limit: int) -> LemonsBody:
        until = self.clock()
        start = window_start(since, until)
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(FAILURES.sql, *FAILURES.args({"since": start, "until": until}))
            failures = [
                Failure(
                    global_position=r["global_position"],
                    event_type=r["event_type"],
                    at=r["at"],
                    node_id=r["node_id"],
                    accelerator_id=r["accelerator_id"],
                    uuid=r["gpu_uuid"],
                    reasons=list(r["reason_codes"]),
                )
                for r in rows
            ]
            places = await gpu_places(conn, sorted({f.uuid for f in failures}))
        tenures = {u: [n.tenure() for n in nodes] for u, nodes in places.nodes.items()}
        ranked = rank(failures, tenures, start, until)
        items = []
        for k, lemon in enumerate(ranked[:limit], 1):
            nodes = places.nodes.get(lemon.uuid, [])
            hostnames = {n.node_id: n.hostname for n in nodes}
            latest = max(nodes, key=lambda n: n.last_seen_at) if nodes else None
            items.append(
                LemonBody(
                    rank=k,
                    uuid=lemon.uuid,
                    model=places.models.get(lemon.uuid),
                    failures=lemon.failures,
                    service_days=round(lemon.service_days, 3),
                    failures_per_day=round(lemon.failures_per_day, 4),
                    node_id=latest.node_id if latest else None,
                    accelerator_id=latest.accelerator_id if latest else None,
                    status=latest.status if latest else None,
                    health=latest.health if latest else None,
                    nodes=nodes,
                    evidence=[
                        FailureBody(
                            global_position=f.global_position,
                            event_type=f.event_type,
                            at=f.at,
                            node_id=f.node_id,
                            hostname=hostnames.get(f.node_id),
                            accelerator_id=f.accelerator_id,
                            reasons=f.reasons,
                        )
                        for f in lemon.evidence
                    ],
                )
            )
        return LemonsBody(since=start, until=until, failure=FAILURE, total=len(ranked), items=items)
