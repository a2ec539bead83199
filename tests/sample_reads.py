"""Each GPU's latest sample as the API reads it (api/services/reads/samples.py), for tests that
check what the telemetry rows point at."""

from __future__ import annotations

import asyncpg

from api.services.reads.samples import Sample, samples_at
from collectors.facts import Known

_ROWS = (
    "SELECT a.uuid, t.position FROM hw_accelerator_telemetry t JOIN hw_accelerators a "
    "USING (accelerator_id) ORDER BY a.uuid, a.accelerator_id"
)


async def latest_samples(conn: asyncpg.Connection) -> list[tuple[str, int, Sample | None]]:
    """(GPU UUID, position of its sample's event, the sample) of every GPU with a telemetry row."""
    rows = await conn.fetch(_ROWS)
    samples = await samples_at(conn, [r["position"] for r in rows])
    return [(r["uuid"], r["position"], samples.get((r["position"], r["uuid"]))) for r in rows]


async def latest_temperatures(conn: asyncpg.Connection) -> list[tuple[str, str | None]]:
    """(GPU UUID, its latest temperature as text) of every GPU with a telemetry row."""
    out: list[tuple[str, str | None]] = []
    for uuid, _, sample in await latest_samples(conn):
        fact = sample.metrics.get("temperature_celsius") if sample is not None else None
        out.append((uuid, str(fact.value) if isinstance(fact, Known) else None))
    return out
