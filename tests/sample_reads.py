"""Each GPU's latest sample as the API reads it (api/services/reads/samples.py), for tests that
check what the telemetry rows point at."""

from __future__ import annotations

import asyncpg

from api.services.reads.samples import Sample, samples_at
from collectors.facts import Known
from ledger.events import RecordedEvent
from ledger.reading import EVENT_COLUMNS, event_from_row

# The GPU's own telemetry row, else its node's latest snapshot (projections/inventory.py).
_ROWS = (
    "SELECT a.uuid, coalesce(t.position, h.position) AS position FROM hw_accelerators a "
    "LEFT JOIN hw_accelerator_telemetry t USING (accelerator_id) "
    "LEFT JOIN hw_host_telemetry h ON h.node_id = a.node_id "
    "WHERE coalesce(t.position, h.position) IS NOT NULL ORDER BY a.uuid, a.accelerator_id"
)


async def latest_samples(conn: asyncpg.Connection) -> list[tuple[str, int, Sample | None]]:
    """(GPU UUID, position of the event its sample is looked for in, the sample or None)."""
    rows = await conn.fetch(_ROWS)
    samples = await samples_at(conn, [r["position"] for r in rows])
    return [(r["uuid"], r["position"], samples.get((r["position"], r["uuid"]))) for r in rows]


async def latest_temperatures(conn: asyncpg.Connection) -> list[tuple[str, str | None]]:
    """(GPU UUID, its latest temperature as text) of every GPU of a node with telemetry."""
    out: list[tuple[str, str | None]] = []
    for uuid, _, sample in await latest_samples(conn):
        fact = sample.metrics.get("temperature_celsius") if sample is not None else None
        out.append((uuid, str(fact.value) if isinstance(fact, Known) else None))
    return out


async def logged(db: asyncpg.Connection | asyncpg.Pool, where: str, *args: object) -> list[RecordedEvent]:
    """The log's events matching `where` (a fixed condition of the test's), decoded whatever their
    form (a compact snapshot's metadata is not readable in SQL), in commit order."""
    rows = await db.fetch(
        f"SELECT {EVENT_COLUMNS} FROM events WHERE {where} ORDER BY events.tx_id, events.global_position",
        *args,
    )
    return [event_from_row(r) for r in rows]
