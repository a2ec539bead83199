"""One GPU's record by its UUID, across every node it was ever in (a GPU moved to another host
keeps its record): the nodes with its time on each, and its lifecycle and health events in commit
order, a page at a time (docs/lemons.md).

The events are found by the permanent segment's index on the UUID their data carries
(`events_permanent_gpu_uuid_idx`) through the log's one gap-safe read; the nodes are the GPU's
read-model rows, one per node (`hw_accelerators_uuid_idx`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

import asyncpg
import msgspec

from api.services.errors import NotFound
from api.services.reads.bodies import EventBody
from api.services.reads.cursors import decode_gpu_history_cursor, encode_gpu_history_cursor
from api.services.reads.events import event_body
from api.services.reads.samples import SAMPLE_RECEIVED_AT
from api.services.reads.statement import Query
from domain.lemons import DAY, Tenure
from ledger.events import HealthStatus
from ledger.reading import Checkpoint, LogFilter, read_log


class GpuTenureBody(msgspec.Struct, frozen=True):
    """The GPU on one node: that node's accelerator row, first and last seen there (last seen:
    its newest sample while present, when it went missing after) and the days between."""

    node_id: str
    hostname: str | None
    accelerator_id: str
    status: Literal["active", "missing", "decommissioned"]
    health: HealthStatus
    first_seen_at: datetime
    last_seen_at: datetime
    missing_since: datetime | None
    days: float

    def tenure(self) -> Tenure:
        return Tenure(node_id=self.node_id, first_seen_at=self.first_seen_at, last_seen_at=self.last_seen_at)


class GpuHistoryBody(msgspec.Struct, frozen=True):
    """A page of one GPU's history: its nodes (every page has them all, the node it came to first
    first) and its lifecycle events in commit order."""

    uuid: str
    model: str | None
    nodes: list[GpuTenureBody]
    items: list[EventBody]
    # As on /events: where to resume (after this page's last event, or the cursor given when the
    # page is empty); `has_more`: the page was cut by its limit.
    next_cursor: str
    has_more: bool = False


class _TenureRow(msgspec.Struct, frozen=True):
    uuid: str
    node_id: str
    hostname: str | None
    accelerator_id: str
    status: Literal["active", "missing", "decommissioned"]
    health_status: HealthStatus
    first_seen_at: datetime
    last_seen_at: datetime
    missing_since: datetime | None
    gpu_model: str | None


_tenure_rows = msgspec.json.Decoder(list[_TenureRow])

# Last seen as the accelerator reads show it: the later of the lifecycle's time and the newest
# sample's receive time (a report does not rewrite the accelerator row). `gpu_model`, not `name`:
# the column `name` is a jsonb fact.
TENURES = (
    Query(
        "SELECT coalesce(json_agg(r ORDER BY r.first_seen_at, r.node_id), '[]')::text FROM ("
        "SELECT a.uuid, a.node_id, n.hostname, a.accelerator_id, a.status, a.health_status, "
        "a.first_seen_at, greatest(a.last_seen_at, "
        + SAMPLE_RECEIVED_AT
        + ") AS last_seen_at, a.missing_since, "
        "CASE WHEN a.name->>'state' = 'known' THEN a.name->>'value' END AS gpu_model "
        "FROM hw_accelerators a "
        "LEFT JOIN hw_nodes n ON n.node_id = a.node_id "
        "LEFT JOIN hw_accelerator_telemetry t ON t.accelerator_id = a.accelerator_id "
        "LEFT JOIN hw_host_telemetry h ON h.node_id = a.node_id"
    )
    .where("a.uuid = ANY({uuids}::text[])")
    .add(") r")
    .build()
)


def tenure_body(r: _TenureRow) -> GpuTenureBody:
    return GpuTenureBody(
        node_id=r.node_id,
        hostname=r.hostname,
        accelerator_id=r.accelerator_id,
        status=r.status,
        health=r.health_status,
        first_seen_at=r.first_seen_at,
        last_seen_at=r.last_seen_at,
        missing_since=r.missing_since,
        days=max(0.0, (r.last_seen_at - r.first_seen_at) / DAY),
    )


class GpuPlaces(msgspec.Struct, frozen=True):
    """Where each of some GPUs has been: per UUID its nodes (first seen first) and its model."""

    nodes: dict[str, list[GpuTenureBody]]
    models: dict[str, str | None]


async def gpu_places(conn: asyncpg.Connection, uuids: Sequence[str]) -> GpuPlaces:
    rows = _tenure_rows.decode(await conn.fetchval(TENURES.sql, *TENURES.args({"uuids": list(uuids)})))
    nodes: dict[str, list[GpuTenureBody]] = {}
    models: dict[str, str | None] = {}
    for r in rows:
        nodes.setdefault(r.uuid, []).append(tenure_body(r))
        # the model as the newest node saw it
        models[r.uuid] = r.gpu_model or models.get(r.uuid)
    return GpuPlaces(nodes=nodes, models=models)


def gpu_not_found(gpu_uuid: str) -> NotFound:
    return NotFound("gpu-not-found", "Unknown GPU", f"no GPU with UUID {gpu_uuid!r} was ever seen")


class GpuHistoryReads:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def page(self, gpu_uuid: str, *, cursor: str | None, limit: int) -> GpuHistoryBody:
        """A page of the GPU's lifecycle events after `cursor`, with its nodes; NotFound for a
        UUID no node ever reported."""
        after = decode_gpu_history_cursor(cursor) if cursor else Checkpoint()
        async with self.pool.acquire() as conn:
            places = await gpu_places(conn, [gpu_uuid])
            if gpu_uuid not in places.nodes:
                raise gpu_not_found(gpu_uuid)
            page = await read_log(conn, after, limit=limit, where=LogFilter(gpu_uuid=gpu_uuid))
        return GpuHistoryBody(
            uuid=gpu_uuid,
            model=places.models[gpu_uuid],
            nodes=places.nodes[gpu_uuid],
            items=[event_body(e) for e in page.entries],
            next_cursor=encode_gpu_history_cursor(page.resume),
            has_more=page.more,
        )
