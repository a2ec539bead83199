"""Accelerators as the API shows them: a page by id (with the list's filters) and one by id."""

from __future__ import annotations

import functools
from datetime import datetime
from typing import Any, Literal, LiteralString

import asyncpg
import msgspec

from api.services.reads.bodies import AcceleratorBody, AcceleratorHealthBody, HealthSignalsBody
from api.services.reads.cursors import decode_id_cursor, id_page
from api.services.reads.facts import plain
from api.services.reads.samples import samples_at, signals_body
from api.services.reads.statement import Query, Statement
from collectors.facts import Fact
from collectors.gpu_health import XidOccurrence
from ledger.events import HealthAction, HealthReason, HealthStatus


class AcceleratorRow(msgspec.Struct):
    """One row of `ACCELERATOR_SELECT`, typed. A page comes back from PostgreSQL as one JSON array
    of these (`_PAGE_HEAD`) and is decoded in one pass, facts straight into their classes:
    converting each jsonb column's builtins fact by fact is most of a page's server time. An
    as-of read builds the same rows from a fold (`projections.pointintime.accelerator_records`)."""

    accelerator_id: str
    node_id: str
    uuid: str
    status: Literal["active", "missing", "decommissioned"]
    device_index: Fact
    pci_bus_id: Fact
    name: Fact
    memory_total_bytes: Fact
    compute_capability: Fact
    mig_mode: Fact
    driver_version: Fact
    cuda_driver_version: Fact
    first_seen_at: datetime
    last_seen_at: datetime
    missing_since: datetime | None
    metrics: dict[str, Fact] | None
    telemetry_observed_at: datetime | None
    health_status: HealthStatus
    health_action: HealthAction
    health_reasons: list[HealthReason] | None
    health_xids: list[XidOccurrence] | None
    # The stored signals carry an empty `xids` (XIDs are lifecycle events): not decoded, not shown.
    health_signals: HealthSignalsBody | None
    # The event holding the GPU's latest sample (its metrics and signals are read from there:
    # api/services/reads/samples.py); an as-of row has them from its fold instead.
    sample_position: int | None = None
    # The node's latest snapshot's times, where the GPU's sample is looked for there: they are
    # the sample's once the snapshot is found to sample the GPU.
    snapshot_observed_at: datetime | None = None
    snapshot_received_at: datetime | None = None


_rows = msgspec.json.Decoder(list[AcceleratorRow])


def accelerator_row(record: dict[str, Any]) -> AcceleratorRow:
    """An as-of record (builtins and datetimes, the database's shapes) as a typed row."""
    return msgspec.convert(record, AcceleratorRow)


# Where each GPU's latest sample is: the GPU's own telemetry row where it has one (its latest
# sample is older than its node's latest snapshot), else the node's latest snapshot, whose times
# and position are the host's row (projections/inventory.py). Joined per accelerator (LATERAL ...
# OFFSET 0 keeps the planner from a merge join that reads the telemetry index from its start up
# to the page's cursor on every page); the sample is read from the event afterwards
# (`with_samples`), and a snapshot that turns out not to sample the GPU gives it nothing.
ACCELERATOR_SELECT: LiteralString = (
    "SELECT a.accelerator_id, a.node_id, a.uuid, a.status, a.device_index, a.pci_bus_id, a.name, "
    "a.memory_total_bytes, a.compute_capability, a.mig_mode, a.driver_version, a.cuda_driver_version, "
    "a.first_seen_at, greatest(a.last_seen_at, CASE WHEN t.own THEN t.received_at END) AS last_seen_at, "
    "a.missing_since, NULL::jsonb AS metrics, "
    "CASE WHEN t.own THEN t.observed_at END AS telemetry_observed_at, t.position AS sample_position, "
    "a.health_status, a.health_action, a.health_reasons, a.health_xids, NULL::jsonb AS health_signals, "
    "CASE WHEN NOT t.own THEN t.observed_at END AS snapshot_observed_at, "
    "CASE WHEN NOT t.own THEN t.received_at END AS snapshot_received_at "
    "FROM hw_accelerators a "
    "LEFT JOIN LATERAL ("
    "SELECT true AS own, x.observed_at, x.received_at, x.position FROM hw_accelerator_telemetry x "
    "WHERE x.accelerator_id = a.accelerator_id "
    "UNION ALL SELECT false, h.observed_at, h.received_at, h.position FROM hw_host_telemetry h "
    "WHERE h.node_id = a.node_id AND NOT EXISTS ("
    "SELECT 1 FROM hw_accelerator_telemetry y WHERE y.accelerator_id = a.accelerator_id) "
    "OFFSET 0"
    ") t ON true"
)
# A page of `ACCELERATOR_SELECT` rows as one JSON array: the rows' statement goes in between.
_PAGE_HEAD: LiteralString = "SELECT coalesce(json_agg(p ORDER BY p.accelerator_id), '[]')::text FROM ("
_PAGE_TAIL: LiteralString = ") p"

_ONE = (
    Query(_PAGE_HEAD)
    .add(ACCELERATOR_SELECT)
    .where("a.accelerator_id = {accelerator_id}")
    .add(_PAGE_TAIL)
    .build()
)


@functools.cache
def _page(node_id: bool, status: bool, model: bool, health: bool) -> Statement:
    """The page's statement for the filters given (the keyset goes first)."""
    query = Query(_PAGE_HEAD).add(ACCELERATOR_SELECT).where("a.accelerator_id > {after}")
    if node_id:
        query.where("a.node_id = {node_id}")
    if status:
        query.where("a.status = {status}")
    if model:
        # The model is the accelerator's name fact (e.g. "NVIDIA H200"), matched when known.
        query.where("a.name->>'state' = 'known' AND a.name->>'value' = {model}")
    if health:
        query.where("a.health_status = {health}")
    return query.add(" ORDER BY a.accelerator_id LIMIT {limit}").add(_PAGE_TAIL).build()


def accelerator_body(r: AcceleratorRow) -> AcceleratorBody:
    facts: dict[str, Fact] = {
        "index": r.device_index,
        "pci_bus_id": r.pci_bus_id,
        "name": r.name,
        "memory_total_bytes": r.memory_total_bytes,
        "compute_capability": r.compute_capability,
        "mig_mode": r.mig_mode,
        "driver_version": r.driver_version,
        "cuda_driver_version": r.cuda_driver_version,
    }
    return AcceleratorBody(
        id=r.accelerator_id,
        node_id=r.node_id,
        uuid=r.uuid,
        status=r.status,
        index=plain(r.device_index),
        pci_bus_id=plain(r.pci_bus_id),
        name=plain(r.name),
        memory_total_bytes=plain(r.memory_total_bytes),
        compute_capability=plain(r.compute_capability),
        mig_mode=r.mig_mode,
        driver_version=plain(r.driver_version),
        cuda_driver_version=plain(r.cuda_driver_version),
        telemetry=r.metrics or {},
        telemetry_observed_at=r.telemetry_observed_at,
        facts=facts,
        first_seen_at=r.first_seen_at,
        last_seen_at=r.last_seen_at,
        missing_since=r.missing_since,
        health=AcceleratorHealthBody(
            status=r.health_status,
            action=r.health_action,
            reasons=r.health_reasons or [],
            recent_xids=r.health_xids or [],
            signals=r.health_signals,
        ),
    )


class AcceleratorReads:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def page(
        self,
        *,
        node_id: str | None,
        status: str | None,
        cursor: str | None,
        limit: int,
        model: str | None = None,
        health: str | None = None,
    ) -> tuple[list[AcceleratorBody], str | None]:
        """A page of accelerators by id; the filters narrow the keyset, so a cursor pages the
        filtered set."""
        statement = _page(node_id is not None, status is not None, model is not None, health is not None)
        values = {
            "after": decode_id_cursor(cursor) if cursor else "",
            "node_id": node_id,
            "status": status,
            "model": model,
            "health": health,
            "limit": limit + 1,
        }
        async with self.pool.acquire() as conn:
            rows = _rows.decode(await conn.fetchval(statement.sql, *statement.args(values)))
            rows = await with_samples(conn, rows[:limit]) + rows[limit:]
        return id_page(rows, limit, accelerator_body)

    async def get(self, accelerator_id: str) -> AcceleratorBody | None:
        async with self.pool.acquire() as conn:
            rows = await with_samples(conn, _rows.decode(await conn.fetchval(_ONE.sql, accelerator_id)))
        return accelerator_body(rows[0]) if rows else None


async def with_samples(conn: asyncpg.Connection, rows: list[AcceleratorRow]) -> list[AcceleratorRow]:
    """The rows with each GPU's metrics and health signals from the event holding its sample."""
    samples = await samples_at(conn, (r.sample_position for r in rows))
    out = []
    for r in rows:
        sample = samples.get((r.sample_position, r.uuid)) if r.sample_position is not None else None
        if sample is not None:
            r = msgspec.structs.replace(r, metrics=sample.metrics, health_signals=signals_body(sample.health))
            if r.snapshot_received_at is not None:
                r = msgspec.structs.replace(
                    r,
                    telemetry_observed_at=r.snapshot_observed_at,
                    last_seen_at=max(r.last_seen_at, r.snapshot_received_at),
                )
        out.append(r)
    return out
