"""A GPU's or a host's telemetry history: the retained samples of its node's stream, read and
decoded here (the one place that knows how samples are stored) and downsampled by
`domain.telemetry_history`.

The time axis is each sample's `observed_at`, the observer's clock: a report the agent spooled
through an outage lands where it was measured, not bunched at its delivery. A snapshot stored
compact (ledger/compact.py) is opened only as far as the one GPU or the host; a closed hour the
server has stored as columns (ledger/telemetry_hours.py) is read from there. The log is searched
by `received_at` (the central clock, indexed per stream: `events_stream_observation_received_idx`)
from an hour before the window to a day after it, so a sample is found when its agent's clock ran
at most an hour ahead of the server's and its report arrived within a day (docs/telemetry.md).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, LiteralString, Protocol

import asyncpg
import msgspec
import numpy as np

from api.services.errors import InvalidRequest, NotFound
from collectors.facts import Fact
from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
from domain.telemetry_buckets import SampleColumns, as_column, join, series_of_columns, take
from domain.telemetry_history import (
    NOT_CARRIED,
    Series,
    Window,
    WindowRefused,
    fact_state,
    fact_value,
    window,
)
from ledger.compact_views import Values, gpu_values, host_values, value_state
from ledger.events import (
    AcceleratorTelemetryObserved,
    EventPayload,
    HostTelemetryObserved,
    NodeTelemetryObserved,
    decode_metadata,
    decode_payload,
)
from ledger.gpu_sets import stored_sets
from ledger.telemetry_hours import RECEIVED_IN, HourSamples, covered
from runtime.micros import micros, micros_of

if TYPE_CHECKING:
    import numpy.typing as npt

    from domain.telemetry_buckets import Column, Micros


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


# The node's observations received in [$2, $3) (the padded window, or a part of it). A snapshot
# stored compact is decoded here only as far as its times and the one GPU's (or the host's)
# telemetry; a jsonb one (an older release's) whole. The time axis is filtered here too:
# observed_at is inside the event. No ORDER BY: the read orders the samples by time itself, and
# PostgreSQL sorting a day of snapshots (7 MB) spilled to disk.
_OBSERVATIONS: LiteralString = (
    "SELECT e.global_position, e.body, e.data::text AS data_json, e.metadata::text AS metadata_json, "
    # The GPU set a snapshot of format 3 or 4 (a body's second byte) names (ledger/gpu_sets.py).
    "CASE WHEN get_byte(e.body, 1) IN (3, 4) THEN e.sampled END AS gpu_set_id "
    "FROM events e WHERE " + RECEIVED_IN
)
# How far the search by received_at reaches beyond the window: a sample observed up to an hour
# before it was received (an agent's clock ahead of the server's) and received up to a day after.
EARLIER = timedelta(hours=1)
LATER = timedelta(hours=24)
# A window at least this long is read in two parts on two connections where the pool has one
# idle: PostgreSQL sends the later part while this process decodes the earlier one.
SPLIT_FROM = timedelta(hours=2)
# The rows are decoded this many at a time and the series bucketed one at a time, the event loop
# let run in between: a day of one GPU is tens of milliseconds of CPU, and the agents' reports
# and every other request of this process wait on that loop (docs/telemetry.md).
SLICE = 256
ACCELERATOR_SAMPLES: LiteralString = (
    _OBSERVATIONS + "AND e.event_type IN ('NODE_TELEMETRY_OBSERVED', 'ACCELERATOR_TELEMETRY_OBSERVED')"
)
HOST_SAMPLES: LiteralString = (
    _OBSERVATIONS + "AND e.event_type IN ('NODE_TELEMETRY_OBSERVED', 'HOST_TELEMETRY_OBSERVED')"
)


class ObservationRow(Protocol):
    """A row of ACCELERATOR_SAMPLES or HOST_SAMPLES (an asyncpg record)."""

    def __getitem__(self, key: str, /) -> Any: ...


def _jsonb_event(row: ObservationRow) -> tuple[datetime, EventPayload]:
    meta = decode_metadata(row["metadata_json"])
    return meta.observed_at or meta.received_at, decode_payload(row["data_json"])


def _facts(telemetry: dict[str, Fact], metrics: Sequence[str]) -> list[object]:
    return [fact_value(telemetry.get(m)) for m in metrics]


def state_of(value: object) -> str | None:
    """The state of a value that is neither a scalar nor None: a fact as a compact snapshot stores
    it, or one of a jsonb event (`fact_value`)."""
    if value is NOT_CARRIED or isinstance(value, msgspec.Struct):
        return fact_state(value)
    return value_state(value)


def _split(
    rows: Iterable[ObservationRow], sets: Mapping[uuid.UUID, str]
) -> tuple[list[int], list[bytes], list[str | None], list[ObservationRow]]:
    """The compact rows' positions, bodies and GPU sets (of format 3), and the jsonb rows."""
    positions: list[int] = []
    bodies: list[bytes] = []
    set_ids: list[uuid.UUID | None] = []
    jsonb: list[ObservationRow] = []
    for r in rows:
        body = r["body"]
        if body is None:
            jsonb.append(r)
        else:
            positions.append(r["global_position"])
            bodies.append(body)
            set_ids.append(r["gpu_set_id"])
    distinct = set(set_ids)
    if len(distinct) == 1:  # a day of one set, or of older formats: the one name for every row
        (only,) = distinct
        named: list[str | None] = [None if only is None else sets.get(only)] * len(set_ids)
    else:
        named = [None if i is None else sets.get(i) for i in set_ids]
    return positions, bodies, named, jsonb


class Part(msgspec.Struct):
    """Samples of one part of a history (rows of the log, or a stored hour), in any order: each
    one's position in the log and time (whole microseconds since the epoch), and one column of
    values per metric (`domain.telemetry_buckets`; none at all where the part has no sample)."""

    positions: npt.NDArray[np.int64]
    times: Micros
    columns: list[Column]


def stored_part(hour: HourSamples) -> Part:
    """A stored hour's samples as a part: its verbatim columns of numbers counted as numbers too."""
    columns = [c if isinstance(c, np.ndarray) else as_column(c) for c in hour.columns]
    return Part(hour.positions, hour.times, columns)


def _logged_part(
    positions: list[int], compact: Values, jsonb: list[tuple[datetime, int, Sequence[object]]], width: int
) -> Part:
    """The part of the log's rows: the compact snapshots' values (indices into `positions`), and
    the jsonb events' samples as (time, position, values)."""
    at = [positions[i] for i in compact.indices]
    times = list(compact.times)
    rows: list[Sequence[object]] = list(compact.values)
    for when, position, values in jsonb:
        at.append(position)
        times.append(when)
        rows.append(values)
    empty: list[Column] = [np.empty(0)] * width
    columns = [as_column(c) for c in zip(*rows, strict=True)] if rows else empty
    return Part(np.array(at, dtype=np.int64), micros_of(times), columns)


def samples_in_window(w: Window, parts: Sequence[Part]) -> SampleColumns:
    """The samples of the parts observed in the window, in time order (log order among equal
    times). A day read in the order it was appended is in time order already; others are sorted."""
    held = [p for p in parts if len(p.times)]
    if not held:
        return SampleColumns(times=np.empty(0, np.int64), columns=[])
    positions = np.concatenate([p.positions for p in held])
    times = np.concatenate([p.times for p in held])
    columns = [join(c) for c in zip(*(p.columns for p in held), strict=True)]
    if len(times) > 1 and not bool((times[1:] > times[:-1]).all()):
        order = np.lexsort((positions, times))
        times = times[order]
        columns = [take(c, order) for c in columns]
    first, end = np.searchsorted(times, [micros(w.since), micros(w.until)]).tolist()
    if first or end < len(times):
        times = times[first:end]
        columns = [c[first:end] for c in columns]
    return SampleColumns(times=times, columns=columns)


def accelerator_part(
    rows: Iterable[ObservationRow], gpu_uuid: str, metrics: Sequence[str], sets: Mapping[uuid.UUID, str]
) -> Part:
    """One GPU's samples among the rows, as values of `metrics` (`downsample_values`): its entry of
    each snapshot (the last one where it is listed twice, as the fold takes it); an
    ACCELERATOR_TELEMETRY_OBSERVED is its own. `sets`: the stored GPU sets the rows name."""
    positions, bodies, named, jsonb_rows = _split(rows, sets)
    jsonb: list[tuple[datetime, int, Sequence[object]]] = []
    for r in jsonb_rows:
        values: list[object] | None = None
        at, p = _jsonb_event(r)
        if isinstance(p, NodeTelemetryObserved):
            for a in p.accelerators:
                if a.uuid == gpu_uuid:
                    values = _facts(a.telemetry, metrics)
        elif isinstance(p, AcceleratorTelemetryObserved) and p.uuid == gpu_uuid:
            values = _facts(p.telemetry, metrics)
        if values is not None:
            jsonb.append((at, r["global_position"], values))
    return _logged_part(positions, gpu_values(bodies, gpu_uuid, metrics, named), jsonb, len(metrics))


def host_part(rows: Iterable[ObservationRow], metrics: Sequence[str]) -> Part:
    """The host's samples among the rows, as values of `metrics`."""
    positions, bodies, _, jsonb_rows = _split(rows, {})
    jsonb: list[tuple[datetime, int, Sequence[object]]] = []
    for r in jsonb_rows:
        at, p = _jsonb_event(r)
        if isinstance(p, NodeTelemetryObserved | HostTelemetryObserved):
            jsonb.append((at, r["global_position"], _facts(p.telemetry, metrics)))
    return _logged_part(positions, host_values(bodies, metrics), jsonb, len(metrics))


def _shifted(at: datetime, by: timedelta) -> datetime:
    """`at + by`, or the last or first moment Python holds where that is beyond it."""
    try:
        return at + by
    except OverflowError:
        return (datetime.max if by > timedelta(0) else datetime.min).replace(tzinfo=UTC)


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

    async def _parts(
        self,
        conn: asyncpg.Connection,
        query: LiteralString,
        node_id: str,
        w: Window,
        part: Callable[[Sequence[asyncpg.Record], Mapping[uuid.UUID, str]], Part],
        subject: str,
    ) -> tuple[list[Part], list[asyncpg.Record], Mapping[uuid.UUID, str]]:
        """The node's observations in the padded window: the parts decoded so far, and the rows
        left to decode (after the connections are back in the pool) with the GPU sets they name.
        `subject`: the GPU's UUID, '' the host."""
        low, high = _shifted(w.since, -EARLIER), _shifted(w.until, LATER)
        cover = await covered(conn, node_id, low, high, subject)
        if cover.hours:
            # Closed hours stored as columns (ledger/telemetry_hours.py); the rest from the log.
            stored = [stored_part(h) for h in cover.hours.values()]
            rows: list[asyncpg.Record] = []
            for start, end in cover.from_log:
                rows.extend(await conn.fetch(query, node_id, start, end))
            return stored, rows, await _sets(conn, rows)
        if w.until - w.since < SPLIT_FROM or not self.pool.get_idle_size():
            rows = await conn.fetch(query, node_id, low, high)
            return [], rows, await _sets(conn, rows)
        middle = w.since + (w.until - w.since) / 2
        async with self.pool.acquire() as other:
            later = asyncio.ensure_future(other.fetch(query, node_id, middle, high))
            try:
                rows = await conn.fetch(query, node_id, low, middle)
                earlier = await in_slices(rows, await _sets(conn, rows), part)
                rows = await later
                return earlier, rows, await _sets(conn, rows)
            finally:
                if not later.done():  # the earlier part failed: the later one is not wanted
                    later.cancel()
                    await asyncio.gather(later, return_exceptions=True)

    async def accelerator(self, accelerator_id: str, w: Window) -> TelemetryHistoryBody:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT node_id, uuid FROM hw_accelerators WHERE accelerator_id = $1", accelerator_id
            )
            if row is None:
                raise _not_found("accelerator", accelerator_id)
            node_id: str = row["node_id"]
            gpu_uuid: str = row["uuid"]

            def part(rows: Sequence[asyncpg.Record], sets: Mapping[uuid.UUID, str]) -> Part:
                return accelerator_part(rows, gpu_uuid, ACCELERATOR_METRICS, sets)

            parts, rows, sets = await self._parts(conn, ACCELERATOR_SAMPLES, node_id, w, part, gpu_uuid)
        samples = samples_in_window(w, [*parts, *await in_slices(rows, sets, part)])
        return TelemetryHistoryBody(
            subject="accelerator",
            id=accelerator_id,
            node_id=node_id,
            uuid=gpu_uuid,
            since=w.since,
            until=w.until,
            step_seconds=w.step_seconds,
            samples=len(samples.times),
            series=await series_in_turns(w, samples, ACCELERATOR_METRICS),
        )

    async def node(self, node_id: str, w: Window) -> TelemetryHistoryBody:
        def part(rows: Sequence[asyncpg.Record], _sets: Mapping[uuid.UUID, str]) -> Part:
            return host_part(rows, HOST_METRICS)

        async with self.pool.acquire() as conn:
            if await conn.fetchval("SELECT 1 FROM hw_nodes WHERE node_id = $1", node_id) is None:
                raise _not_found("node", node_id)
            parts, rows, _ = await self._parts(conn, HOST_SAMPLES, node_id, w, part, "")
        samples = samples_in_window(w, [*parts, *await in_slices(rows, {}, part)])
        return TelemetryHistoryBody(
            subject="node",
            id=node_id,
            node_id=node_id,
            uuid=None,
            since=w.since,
            until=w.until,
            step_seconds=w.step_seconds,
            samples=len(samples.times),
            series=await series_in_turns(w, samples, HOST_METRICS),
        )


async def in_slices(
    rows: Sequence[asyncpg.Record],
    sets: Mapping[uuid.UUID, str],
    part: Callable[[Sequence[asyncpg.Record], Mapping[uuid.UUID, str]], Part],
) -> list[Part]:
    """The rows decoded SLICE at a time (`part`), the event loop let run between two slices."""
    parts: list[Part] = []
    for start in range(0, len(rows), SLICE):
        if parts:
            await asyncio.sleep(0)
        parts.append(part(rows[start : start + SLICE], sets))
    return parts


async def series_in_turns(w: Window, samples: SampleColumns, metrics: Sequence[str]) -> list[Series]:
    """The samples downsampled a series at a time, the event loop let run between two."""
    series: list[Series] = []
    for one in series_of_columns(w, samples, metrics, state_of):
        series.append(one)
        if len(series) < len(metrics):  # the next one is bucketed when this generator resumes
            await asyncio.sleep(0)
    return series


async def _sets(conn: asyncpg.Connection, rows: Sequence[asyncpg.Record]) -> Mapping[uuid.UUID, str]:
    """The GPU sets the rows of format 3 or 4 name (none for a day of older formats)."""
    return await stored_sets(conn, {r["gpu_set_id"] for r in rows})


def _not_found(what: str, ident: str) -> NotFound:
    return NotFound(f"{what}-not-found", f"Unknown {what}", f"no {what} with id {ident!r}")
