"""Each GPU's latest sample, read from the event its telemetry row points at.

A GPU's telemetry row (hw_accelerator_telemetry) keeps the position of the event that holds its
sample, not a copy: a node's snapshot (NODE_TELEMETRY_OBSERVED, stored compact or as jsonb) or,
in logs of earlier releases, an ACCELERATOR_TELEMETRY_OBSERVED of its own. The events are read
once each, by position, and decoded here (PostgreSQL cannot read a compact body), so a page of
GPUs of a dozen nodes reads a dozen events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import LiteralString

import asyncpg
import msgspec

from api.services.reads.bodies import HealthSignalsBody
from collectors.facts import Fact
from collectors.gpu_health import AcceleratorHealthSignals
from ledger.events import AcceleratorTelemetryObserved, NodeTelemetryObserved
from ledger.reading import DECODE_SLICE, EVENT_COLUMNS, event_from_row


class Sample(msgspec.Struct, frozen=True):
    """One GPU's part of an event: its metrics and, where the agent sent them, health signals."""

    metrics: dict[str, Fact]
    health: AcceleratorHealthSignals | None


# When a GPU's newest sample was received, over `a` (hw_accelerators), `t` (the GPU's own
# hw_accelerator_telemetry row) and `h` (its node's hw_host_telemetry), both LEFT JOINed: a GPU
# without a row of its own has its newest sample in its node's latest snapshot while it is active
# (projections/inventory.py); a missing or decommissioned one keeps a row or has no sample.
SAMPLE_RECEIVED_AT: LiteralString = (
    "coalesce(t.received_at, CASE WHEN a.status = 'active' THEN h.received_at END)"
)

# By position: the primary key of every segment of the log, one index probe each.
_BY_POSITION: LiteralString = (
    "SELECT " + EVENT_COLUMNS + " FROM events WHERE global_position = ANY($1::bigint[])"
)


async def samples_at(
    conn: asyncpg.Connection, positions: Iterable[int | None]
) -> dict[tuple[int, str], Sample]:
    """The GPU samples held by the events at `positions`, by (position, GPU UUID). Of a GPU
    listed twice in a snapshot the last entry counts, as the fold takes it. The events are
    decoded a slice at a time with the event loop let run between (a `/metrics` scrape reads
    every node's latest snapshot: a thousand are tens of milliseconds of decoding)."""
    wanted = sorted({p for p in positions if p is not None})
    if not wanted:
        return {}
    out: dict[tuple[int, str], Sample] = {}
    rows = await conn.fetch(_BY_POSITION, wanted)
    for k, row in enumerate(rows):
        if k and not k % DECODE_SLICE:
            await asyncio.sleep(0)
        event = event_from_row(row)
        p = event.payload
        if isinstance(p, NodeTelemetryObserved):
            for a in p.accelerators:
                out[(event.global_position, a.uuid)] = Sample(a.telemetry, a.health)
        elif isinstance(p, AcceleratorTelemetryObserved):
            out[(event.global_position, p.uuid)] = Sample(p.telemetry, p.health)
    return out


def signals_body(signals: AcceleratorHealthSignals | None) -> HealthSignalsBody | None:
    """The API's form of a sample's health signals (its XIDs are lifecycle events: not here)."""
    if signals is None:
        return None
    return HealthSignalsBody(
        clock_event_reasons=signals.clock_event_reasons,
        ecc_mode=signals.ecc_mode,
        ecc_errors=signals.ecc_errors,
        remapped_rows=signals.remapped_rows,
        retired_pages=signals.retired_pages,
        pcie_replay_count=signals.pcie_replay_count,
        xid_events=signals.xid_events,
    )
