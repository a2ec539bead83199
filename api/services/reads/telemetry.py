"""A GPU's or a host's telemetry history: the retained samples of its node's stream, read and
decoded here (the one place that knows how samples are stored) and downsampled by
`domain.telemetry_history`.

The time axis is each sample's `observed_at`, the observer's clock: a report the agent spooled
through an outage lands where it was measured, not bunched at its delivery. A snapshot stored
compact (ledger/compact.py) is opened only as far as the one GPU or the host. The log is searched
by `received_at` (the central clock, indexed per stream: `events_stream_observation_received_idx`)
from an hour before the window to a day after it, so a sample is found when its agent's clock ran
at most an hour ahead of the server's and its report arrived within a day (docs/telemetry.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Literal, LiteralString

import asyncpg
import msgspec

from api.services.errors import InvalidRequest, NotFound
from collectors.facts import Fact
from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
from domain.telemetry_history import (
    Reading,
    Series,
    Window,
    WindowRefused,
    downsample_readings,
    reading,
    window,
)
from ledger.compact import gpu_key, gpu_readings, host_readings
from ledger.events import (
    AcceleratorTelemetryObserved,
    EventPayload,
    HostTelemetryObserved,
    NodeTelemetryObserved,
    decode_metadata,
    decode_payload,
)


class TelemetryHistoryBody(msgspec.Struct, frozen=True):
    """One GPU's (`accelerator`) or one host's (`node`) telemetry over [since, until), one series
    per metric, one bucket per `step_seconds` from `since`."""

    subject: Literal["accelerator", "node"]
    id: str
    node_id: str
    uuid: str | None
    since: datetime
    until: datetime
    step_seconds: int
    # The samples observed in the window (each counted once, whatever metrics it carries).
    samples: int
    series: list[Series]


# The node's observations received in the padded window, in log order. A snapshot stored compact
# is decoded here, only its times and the one GPU's (or the host's) telemetry; a jsonb one (an
# older release's) whole. The time axis is filtered here too: observed_at is inside the event.
_OBSERVATIONS: LiteralString = (
    "SELECT e.global_position, e.event_type, e.data::text AS data_json, "
    "e.metadata::text AS metadata_json, e.body, e.received_at "
    "FROM events e "
    "WHERE e.stream_id = $1 AND e.event_class = 'observation' "
    # An observation's segment is the UTC day it was received, or the permanent one ('infinity'):
    # the days before the padded window are not searched at all.
    "AND e.segment >= (($2::timestamptz - interval '1 hour') AT TIME ZONE 'UTC')::date "
    "AND e.received_at >= $2::timestamptz - interval '1 hour' "
    "AND e.received_at < $3::timestamptz + interval '24 hours' "
)
ACCELERATOR_SAMPLES: LiteralString = (
    _OBSERVATIONS + "AND e.event_type IN ('NODE_TELEMETRY_OBSERVED', 'ACCELERATOR_TELEMETRY_OBSERVED') "
    "ORDER BY e.global_position"
)
HOST_SAMPLES: LiteralString = (
    _OBSERVATIONS + "AND e.event_type IN ('NODE_TELEMETRY_OBSERVED', 'HOST_TELEMETRY_OBSERVED') "
    "ORDER BY e.global_position"
)


def _jsonb_event(row: asyncpg.Record) -> tuple[datetime, EventPayload]:
    meta = decode_metadata(row["metadata_json"])
    return meta.observed_at or meta.received_at, decode_payload(row["data_json"])


def _facts(telemetry: dict[str, Fact], metrics: Sequence[str]) -> list[Reading | None]:
    return [None if (f := telemetry.get(m)) is None else reading(f) for m in metrics]


_Timed = tuple[datetime, int, list[Reading | None]]


def _in_order(samples: list[_Timed]) -> list[tuple[datetime, list[Reading | None]]]:
    samples.sort(key=lambda x: (x[0], x[1]))
    return [(at, values) for at, _, values in samples]


def accelerator_readings(
    rows: Iterable[asyncpg.Record], gpu_uuid: str, w: Window, metrics: Sequence[str]
) -> list[tuple[datetime, list[Reading | None]]]:
    """One GPU's samples in the window, in time order, as readings of `metrics`: its entry of each
    snapshot (the last one where it is listed twice, as the fold takes it); an
    ACCELERATOR_TELEMETRY_OBSERVED is its own."""
    key = gpu_key(gpu_uuid)
    out: list[_Timed] = []
    for r in rows:
        values: list[Reading | None] | None = None
        if r["body"] is not None:
            observed, received, values = gpu_readings(r["body"], key, metrics)
            at = observed or received
        else:
            at, p = _jsonb_event(r)
            if isinstance(p, NodeTelemetryObserved):
                for a in p.accelerators:
                    if a.uuid == gpu_uuid:
                        values = _facts(a.telemetry, metrics)
            elif isinstance(p, AcceleratorTelemetryObserved) and p.uuid == gpu_uuid:
                values = _facts(p.telemetry, metrics)
        if values is not None and w.since <= at < w.until:
            out.append((at, r["global_position"], values))
    return _in_order(out)


def host_readings_of(
    rows: Iterable[asyncpg.Record], w: Window, metrics: Sequence[str]
) -> list[tuple[datetime, list[Reading | None]]]:
    """The host's samples in the window, in time order, as readings of `metrics`."""
    out: list[_Timed] = []
    for r in rows:
        if r["body"] is not None:
            observed, received, values = host_readings(r["body"], metrics)
            at = observed or received
        else:
            at, p = _jsonb_event(r)
            if not isinstance(p, NodeTelemetryObserved | HostTelemetryObserved):
                continue
            values = _facts(p.telemetry, metrics)
        if w.since <= at < w.until:
            out.append((at, r["global_position"], values))
    return _in_order(out)


def checked_window(since: datetime, until: datetime, step_seconds: int | None) -> Window:
    """The window, or a 400 naming the parameter that makes it impossible."""
    try:
        return window(since, until, step_seconds)
    except WindowRefused as refused:
        raise invalid_parameter(refused.parameter, refused.detail) from refused


def invalid_parameter(parameter: str, detail: str) -> InvalidRequest:
    """A 400 whose `parameter` member names the query parameter at fault."""
    return InvalidRequest("invalid-parameter", "Invalid parameter", detail, parameter=parameter)


class TelemetryReads:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def accelerator(self, accelerator_id: str, w: Window) -> TelemetryHistoryBody:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT node_id, uuid FROM hw_accelerators WHERE accelerator_id = $1", accelerator_id
            )
            if row is None:
                raise _not_found("accelerator", accelerator_id)
            node_id: str = row["node_id"]
            uuid: str = row["uuid"]
            rows = await conn.fetch(ACCELERATOR_SAMPLES, node_id, w.since, w.until)
        samples = accelerator_readings(rows, uuid, w, ACCELERATOR_METRICS)
        return TelemetryHistoryBody(
            subject="accelerator",
            id=accelerator_id,
            node_id=node_id,
            uuid=uuid,
            since=w.since,
            until=w.until,
            step_seconds=w.step_seconds,
            samples=len(samples),
            series=downsample_readings(w, samples, ACCELERATOR_METRICS),
        )

    async def node(self, node_id: str, w: Window) -> TelemetryHistoryBody:
        async with self.pool.acquire() as conn:
            if await conn.fetchval("SELECT 1 FROM hw_nodes WHERE node_id = $1", node_id) is None:
                raise _not_found("node", node_id)
            rows = await conn.fetch(HOST_SAMPLES, node_id, w.since, w.until)
        samples = host_readings_of(rows, w, HOST_METRICS)
        return TelemetryHistoryBody(
            subject="node",
            id=node_id,
            node_id=node_id,
            uuid=None,
            since=w.since,
            until=w.until,
            step_seconds=w.step_seconds,
            samples=len(samples),
            series=downsample_readings(w, samples, HOST_METRICS),
        )


def _not_found(what: str, ident: str) -> NotFound:
    return NotFound(f"{what}-not-found", f"Unknown {what}", f"no {what} with id {ident!r}")
