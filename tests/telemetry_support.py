"""A seeded telemetry history for the history tests: an hour of one snapshot a minute with a gap
of ten minutes, a fan the GPU does not report, a report delivered late, a sample of another GPU
and the per-kind events of older logs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec
import numpy as np

from api.services.reads.telemetry import state_of
from api.wiring import event_store
from collectors.facts import UNSUPPORTED, Fact, Known
from domain.telemetry_buckets import SampleColumns
from ledger.events import (
    AcceleratorSample,
    AcceleratorTelemetryObserved,
    EventMetadata,
    EventPayload,
    HostTelemetryObserved,
    NewEvent,
    NodeTelemetryObserved,
)
from runtime.micros import moment

BASE = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
GAP = range(20, 30)  # minutes without a sample
OTHER_UUID = "GPU-ffffffff-0000-4000-8000-000000000000"


def _host(minute: int) -> dict[str, Fact]:
    return {"memory_available_bytes": Known(1000 + minute), "memory_total_bytes": Known(4096)}


def _gpu(minute: int) -> dict[str, Fact]:
    return {
        "temperature_celsius": Known(40 + minute),
        "fan_speed_percent": UNSUPPORTED,
        "power_watts": Known(100.5),
    }


def observed_event(payload: EventPayload, observed: datetime, received: datetime | None = None) -> NewEvent:
    meta = EventMetadata(received_at=received or observed, source="local", observed_at=observed)
    return NewEvent(payload=payload, metadata=meta)


async def seed(pool: asyncpg.Pool, node_id: str, accelerator_id: str, uuid: str) -> None:
    """One snapshot a minute over [BASE, BASE + 1 h) but for GAP; the last minute as the per-kind
    events of older releases; a report observed at minute 5.5 and delivered 3 h late; one observed
    before the window and delivered inside it."""

    def snapshot(minute: float, with_other: bool = False) -> NodeTelemetryObserved:
        gpus = [AcceleratorSample(accelerator_id=accelerator_id, uuid=uuid, telemetry=_gpu(int(minute)))]
        if with_other:
            gpus.append(AcceleratorSample(accelerator_id="other", uuid=OTHER_UUID, telemetry=_gpu(99)))
        return NodeTelemetryObserved(telemetry=_host(int(minute)), storage=[], accelerators=gpus)

    events = []
    for minute in range(59):
        if minute not in GAP:
            events.append(
                observed_event(snapshot(minute, with_other=minute == 0), BASE + timedelta(minutes=minute))
            )
    last = BASE + timedelta(minutes=59)
    events.append(observed_event(HostTelemetryObserved(telemetry=_host(59), storage=[]), last))
    events.append(
        observed_event(
            AcceleratorTelemetryObserved(accelerator_id=accelerator_id, uuid=uuid, telemetry=_gpu(59)), last
        )
    )
    late = BASE + timedelta(minutes=5, seconds=30)
    events.append(observed_event(snapshot(5), late, received=late + timedelta(hours=3)))
    events.append(
        observed_event(snapshot(0), BASE - timedelta(minutes=10), received=BASE + timedelta(minutes=1))
    )
    await event_store(pool).append(node_id, None, events)


WINDOW = {"since": BASE.isoformat(), "until": (BASE + timedelta(hours=1)).isoformat()}


def as_reading(value: object) -> tuple[str, float | None] | None:
    """A value of a history read (a fact as stored compact, or `fact_value`'s of a jsonb event) as
    the plain loop counts it: (state, the known number), None where the group lacks the fact."""
    if type(value) is int or type(value) is float:
        return "known", float(value)
    if type(value) is str or type(value) is bool:
        return "known", None
    if value is None:
        return "unknown", None
    state = state_of(value)
    return None if state is None else (state, None)


def sample_rows(samples: SampleColumns) -> list[tuple[datetime, Sequence[object]]]:
    """The samples as each one's time and values, in the order they are counted."""
    columns = [c.tolist() if not isinstance(c, list | tuple) else c for c in samples.columns]
    times = [moment(t) for t in samples.times.tolist()]
    rows = list(zip(*columns, strict=True)) if columns else [() for _ in times]
    return list(zip(times, rows, strict=True))


def exactly(samples: SampleColumns) -> bytes:
    """The samples as bytes that tell every value apart: an int from a float, 0.0 from -0.0, a
    column of numbers (float64) from one of values as they are."""
    columns = [
        ["numbers", c.tobytes()] if isinstance(c, np.ndarray) else ["values", list(c)]
        for c in samples.columns
    ]
    return msgspec.msgpack.encode([samples.times.tobytes(), columns])
