"""A GPU's or a host's telemetry history: the retained samples of its node's stream, read and
decoded here (the one place that knows how samples are stored) and downsampled by
`domain.telemetry_history`.

The time axis is each sample's `observed_at`, the observer's clock: a report the agent spooled
through an outage lands where it was measured, not bunched at its delivery. The log is searched
by `received_at` (the central clock, indexed per stream: `events_stream_observation_received_idx`)
from an hour before the window to a day after it, so a sample is found when its agent's clock ran
at most an hour ahead of the server's and its report arrived within a day (docs/telemetry.md).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, LiteralString

import asyncpg
import msgspec

from api.services.errors import InvalidRequest, NotFound
from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
from domain.telemetry_history import Sample, Series, Window, WindowRefused, downsample, window


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


_samples = msgspec.json.Decoder(list[Sample])

# The node's observations received in the padded window, each with its time on the axis; the
# observed_at filter reads only the small metadata, the payload is opened for the rows it keeps.
_OBSERVATIONS: LiteralString = (
    "SELECT e.global_position, e.event_type, e.data, "
    "coalesce((e.metadata->>'observed_at')::timestamptz, e.received_at) AS at "
    "FROM events e "
    "WHERE e.stream_id = $1 AND e.event_class = 'observation' "
    # An observation's segment is the UTC day it was received, or the permanent one ('infinity'):
    # the days before the padded window are not searched at all.
    "AND e.segment >= (($2::timestamptz - interval '1 hour') AT TIME ZONE 'UTC')::date "
    "AND e.received_at >= $2::timestamptz - interval '1 hour' "
    "AND e.received_at < $3::timestamptz + interval '24 hours' "
    "AND coalesce((e.metadata->>'observed_at')::timestamptz, e.received_at) >= $2::timestamptz "
    "AND coalesce((e.metadata->>'observed_at')::timestamptz, e.received_at) < $3::timestamptz "
)
_AS_JSON: LiteralString = (
    "SELECT coalesce(json_agg(json_build_object('observed_at', s.at, 'telemetry', s.telemetry) "
    "ORDER BY s.at, s.global_position), '[]')::text FROM ("
)

# One GPU's entry of each snapshot (the last one where it is listed twice, as the fold takes it);
# an ACCELERATOR_TELEMETRY_OBSERVED is its own entry.
ACCELERATOR_SAMPLES: LiteralString = (
    _AS_JSON
    + "SELECT DISTINCT ON (e.global_position) e.global_position, e.at, x.value->'telemetry' AS telemetry "
    "FROM (" + _OBSERVATIONS + "AND e.event_type IN ('NODE_TELEMETRY_OBSERVED', "
    "'ACCELERATOR_TELEMETRY_OBSERVED')) e "
    "CROSS JOIN LATERAL jsonb_array_elements("
    "CASE WHEN e.event_type = 'ACCELERATOR_TELEMETRY_OBSERVED' THEN jsonb_build_array(e.data) "
    "ELSE e.data->'accelerators' END) WITH ORDINALITY x(value, n) "
    "WHERE x.value->>'uuid' = $4 "
    "ORDER BY e.global_position, x.n DESC) s"
)
HOST_SAMPLES: LiteralString = (
    _AS_JSON + "SELECT e.global_position, e.at, e.data->'telemetry' AS telemetry "
    "FROM (" + _OBSERVATIONS + "AND e.event_type IN ('NODE_TELEMETRY_OBSERVED', "
    "'HOST_TELEMETRY_OBSERVED')) e) s"
)


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
            raw = await conn.fetchval(ACCELERATOR_SAMPLES, node_id, w.since, w.until, uuid)
        samples = _samples.decode(raw)
        return TelemetryHistoryBody(
            subject="accelerator",
            id=accelerator_id,
            node_id=node_id,
            uuid=uuid,
            since=w.since,
            until=w.until,
            step_seconds=w.step_seconds,
            samples=len(samples),
            series=downsample(w, samples, ACCELERATOR_METRICS),
        )

    async def node(self, node_id: str, w: Window) -> TelemetryHistoryBody:
        async with self.pool.acquire() as conn:
            if await conn.fetchval("SELECT 1 FROM hw_nodes WHERE node_id = $1", node_id) is None:
                raise _not_found("node", node_id)
            raw = await conn.fetchval(HOST_SAMPLES, node_id, w.since, w.until)
        samples = _samples.decode(raw)
        return TelemetryHistoryBody(
            subject="node",
            id=node_id,
            node_id=node_id,
            uuid=None,
            since=w.since,
            until=w.until,
            step_seconds=w.step_seconds,
            samples=len(samples),
            series=downsample(w, samples, HOST_METRICS),
        )


def _not_found(what: str, ident: str) -> NotFound:
    return NotFound(f"{what}-not-found", f"Unknown {what}", f"no {what} with id {ident!r}")
