"""What one scrape reads: the fleet's nodes and GPUs from the read models, in one repeatable-read
snapshot, each node judged by the one liveness rule (`api.services.reads.liveness`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec

from api.services.metrics.samples import known_text
from api.services.reads.liveness import LIVENESS, LivenessPolicy
from api.services.reads.samples import Sample, samples_at
from api.services.reads.statement import Query
from collectors.facts import Fact
from collectors.gpu_health import AcceleratorHealthSignals
from ledger.sealing import sealing_due
from runtime.process import older_collections_deferred


class NodeRow(msgspec.Struct, frozen=True):
    node_id: str
    hostname: str
    liveness: str
    inventory_status: str
    last_received_at: datetime | None
    telemetry: dict[str, Any]
    storage: list[tuple[str, Any, Any]]


class GpuRow(msgspec.Struct, frozen=True):
    node_id: str
    hostname: str
    uuid: str
    status: str
    index: str
    model: str
    pci_bus_id: str
    driver_version: str
    # the GPU's sample as decoded from its event; empty without a current one
    telemetry: dict[str, Fact]
    health_status: str = "healthy"
    health_action: str = "none"
    # (code, status, action) of each reason of the verdict
    health_reasons: list[tuple[str, str, str]] = []
    # the latest health signals as decoded from the sample's event; None without any
    health_signals: AcceleratorHealthSignals | None = None
    last_xid: int | None = None


class WebhookRow(msgspec.Struct, frozen=True):
    subscription_id: str
    state: str
    delivered: int
    rejected: int
    retried: int
    attempts: int
    last_delivered_at: datetime | None


class Snapshot(msgspec.Struct, frozen=True):
    nodes: list[NodeRow]
    gpus: list[GpuRow]
    accelerator_counts: dict[str, int]
    head: int
    folded: int
    counters: dict[str, int]
    webhooks: list[WebhookRow] = []
    # Day segments whose day is over and that are not sealed yet (ledger/sealing.py).
    unsealed_days: int = 0
    # Seconds the read standby is behind (None: no read standby, or it is not answering).
    replay_lag: float | None = None


# The exported nodes (decommissioned ones are not), each with its liveness by the one rule.
_NODES = Query(
    "SELECT n.node_id, n.hostname, n.inventory_status, t.received_at, t.metrics, "
    + LIVENESS
    + " AS liveness, "
    "coalesce((SELECT jsonb_agg(jsonb_build_array(s.mount, s.used_bytes, s.total_bytes) "
    "ORDER BY s.mount) FROM hw_node_storage s WHERE s.node_id = n.node_id), '[]'::jsonb) AS storage "
    "FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id "
    "WHERE n.status = 'active' ORDER BY n.node_id"
).build()


def _slices(rows: list[asyncpg.Record], size: int = 250) -> Iterator[list[asyncpg.Record]]:
    """A fleet's rows in slices: turned into rows one slice at a time, with the event loop free
    between them (80,000 GPUs at once hold agent reports up for over a second)."""
    for k in range(0, len(rows), size):
        yield rows[k : k + size]


def _node_row(r: asyncpg.Record) -> NodeRow:
    return NodeRow(
        node_id=r["node_id"],
        hostname=r["hostname"] or "",
        liveness=r["liveness"],
        inventory_status=r["inventory_status"],
        last_received_at=r["received_at"],
        telemetry=dict(r["metrics"] or {}),
        storage=[(m, used, total) for m, used, total in r["storage"]],
    )


def _gpu_row(r: asyncpg.Record, sample: Sample | None) -> GpuRow:
    # a missing GPU's last telemetry is history, not a current reading
    current = sample if r["status"] == "active" else None
    return GpuRow(
        node_id=r["node_id"],
        hostname=r["hostname"] or "",
        uuid=r["uuid"],
        status=r["status"],
        index=known_text(r["device_index"]),
        model=known_text(r["name"]),
        pci_bus_id=known_text(r["pci_bus_id"]),
        driver_version=known_text(r["driver_version"]),
        telemetry=current.metrics if current is not None else {},
        # The verdict and the XIDs are the ledger's record, not a reading: kept when missing.
        health_status=r["health_status"],
        health_action=r["health_action"],
        health_reasons=[(x["code"], x["status"], x["action"]) for x in r["health_reasons"] or []],
        health_signals=current.health if current is not None else None,
        last_xid=r["last_xid"] if isinstance(r["last_xid"], int) else None,
    )


async def read_snapshot(
    pool: asyncpg.Pool, liveness: LivenessPolicy, counters: dict[str, int], now: datetime | None = None
) -> Snapshot:
    """The fleet's rows as one repeatable-read snapshot, with the older collections deferred
    while its rows are read and built (`older_collections_deferred`)."""
    with older_collections_deferred():
        return await _read_snapshot(pool, liveness, counters, now or datetime.now(UTC))


async def released(snapshot: Snapshot) -> None:
    """The snapshot's rows dropped a slice at a time, the event loop let run between: a fleet's
    rows freed at once are a stretch of a hundred milliseconds and more."""
    for rows in (snapshot.gpus, snapshot.nodes):
        while rows:
            del rows[-_RELEASE_SLICE:]
            await asyncio.sleep(0)


_RELEASE_SLICE = 4096


async def _read_snapshot(
    pool: asyncpg.Pool, liveness: LivenessPolicy, counters: dict[str, int], now: datetime
) -> Snapshot:
    async with pool.acquire() as conn, conn.transaction(readonly=True, isolation="repeatable_read"):
        node_rows = await conn.fetch(_NODES.sql, *_NODES.args(liveness.values(now)))
        gpu_rows = await conn.fetch(
            "SELECT a.node_id, n.hostname, a.uuid, a.status, a.device_index, a.name, a.pci_bus_id, "
            "a.driver_version, coalesce(t.position, h.position) AS position, a.health_status, "
            "a.health_action, a.health_reasons, a.health_xids->-1->'code' AS last_xid "
            "FROM hw_accelerators a JOIN hw_nodes n ON n.node_id = a.node_id "
            # the GPU's own telemetry row, else its node's latest snapshot (projections/inventory.py)
            "LEFT JOIN hw_accelerator_telemetry t ON t.accelerator_id = a.accelerator_id "
            "LEFT JOIN hw_host_telemetry h ON h.node_id = a.node_id "
            "WHERE a.status IN ('active', 'missing') AND n.status = 'active' ORDER BY a.node_id, a.uuid"
        )
        # Each GPU's sample from the event its telemetry row points at, every event read once.
        samples = await samples_at(conn, (r["position"] for r in gpu_rows if r["status"] == "active"))
        counts = await conn.fetch("SELECT status, count(*) AS n FROM hw_accelerators GROUP BY status")
        head = await conn.fetchval("SELECT coalesce(max(global_position), 0) FROM events")
        folded = await conn.fetchval("SELECT coalesce(max(position), 0) FROM projection_state")
        unsealed = await conn.fetchval(
            "SELECT count(*) FROM event_segments WHERE sealed_at IS NULL AND day < $1::date", sealing_due(now)
        )
        webhooks = await conn.fetch(
            "SELECT subscription_id, state, delivered, rejected, retried, attempts, last_delivered_at "
            "FROM webhook_subscriptions WHERE state <> 'deleted' ORDER BY subscription_id"
        )
    nodes: list[NodeRow] = []
    for rows in _slices(node_rows):
        nodes.extend(_node_row(r) for r in rows)
        await asyncio.sleep(0)
    gpus: list[GpuRow] = []
    for rows in _slices(gpu_rows):
        gpus.extend(_gpu_row(r, samples.get((r["position"], r["uuid"]))) for r in rows)
        await asyncio.sleep(0)
    for records in (gpu_rows, node_rows):  # freed at once, a fleet's records are a stretch too
        while records:
            del records[-_RELEASE_SLICE:]
            await asyncio.sleep(0)
    return Snapshot(
        nodes=nodes,
        gpus=gpus,
        accelerator_counts={r["status"]: int(r["n"]) for r in counts},
        head=int(head),
        folded=int(folded),
        counters=counters,
        unsealed_days=int(unsealed),
        webhooks=[WebhookRow(**dict(r)) for r in webhooks],
    )
