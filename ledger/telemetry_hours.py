"""A node's telemetry hours: the samples of each closed hour of its log stored again as columns,
so that a history read of a day decodes 24 small rows instead of 8,640 snapshots
(docs/telemetry.md, "Telemetry hours").

An hour here is an hour of the central clock's `received_at`, the column the history's search uses:
once it is over (and GRACE after, for a report received just before its end to commit), nothing
more is appended to it. Per node and hour, table `telemetry_hours` holds:

- subject '': how many observation rows the hour held when it was stored (`observations`), and,
  in `body`, the positions, times and receive times of its snapshots and the host's values;
- subject a GPU UUID: that GPU's values in the hour (which of the hour's snapshots sample it).

Times are whole microseconds since the epoch (runtime/micros.py). Positions, times, receive
times and indices are stored packed (`pack_ints`): the first, then the differences in the
narrowest of 1, 2, 4 or 8 little-endian bytes that holds them all, so a read turns them into
int64 arrays without an object per value. The receive times let a read take an hour that
straddles the start of its search, cut as the log's search would cut it.

A column of a metric's values is stored as its ints packed, or as its floats that are whole
thousandths (watts of whole milliwatts) as the thousandths packed, or as one value and how many
times it repeats (a fan unsupported all hour), or else verbatim; the read gets a float64 array of
the numbers (domain/telemetry_buckets.py counts them as such), or the values. Nothing is rounded:
the numbers are exactly those the read would have decoded from the log.

The log stays the truth. A read uses an hour only where the log still holds exactly as many
observation rows in it as the hour counted: the log is append-only and an hour closed, so the same
count is the same rows; retention dropping a day, or a report committed after the hour was
stored, makes the count differ and the read takes that hour from the log. An hour holding a
snapshot of a format before 3 (or an older release's per-kind event) is stored without a body:
read from the log. A change of this encoding is a new FORMAT: rows of another are not read, and
are stored again.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from itertools import repeat
from operator import mul, sub, truediv
from typing import TYPE_CHECKING, Any, Final, LiteralString, TypeAlias

import asyncpg
import msgspec
import numpy as np
import structlog

from ledger.compact import SET_FORMATS, UndecodableBody
from ledger.compact_decode import gpu_names
from ledger.compact_views import gpu_values, host_values, snapshot_times
from ledger.gpu_sets import stored_sets
from ledger.reading import of_stream
from runtime.micros import micros

if TYPE_CHECKING:
    import numpy.typing as npt

    Ints: TypeAlias = npt.NDArray[np.int64]
    # A decoded column: the numbers as floats, or the values verbatim.
    Column: TypeAlias = npt.NDArray[np.float64] | list[Any]

log = structlog.get_logger(__name__)

FORMAT: Final = 3
HOUR = timedelta(hours=1)
# How long after its hour's end an hour is stored: a report received just before the end has
# committed by then (one that has not makes the hour's count differ: read from the log).
GRACE = timedelta(minutes=2)
# The snapshot type a telemetry hour carries (the per-kind ones of older releases make the hour
# read from the log).
SNAPSHOT = "NODE_TELEMETRY_OBSERVED"
TELEMETRY_TYPES = frozenset({SNAPSHOT, "ACCELERATOR_TELEMETRY_OBSERVED", "HOST_TELEMETRY_OBSERVED"})

# Column encodings.
VERBATIM, INTS, THOUSANDTHS, REPEATED = 0, 1, 2, 3
# Ints stored as differences stay inside 64 bits whatever their order.
_INT_BOUND = 2**62
# Thousandths below this in size are exact in a float64: their quotient by 1000 is Python's.
_THOUSANDTHS_BOUND = 2**53


class HourCommon(msgspec.Struct, array_like=True, frozen=True):
    """Subject '': the hour's snapshots (that sample a GPU or the host), in log order: their
    positions, times and receive times, packed; the host's values (indices into them, packed;
    None: every one)."""

    positions: bytes
    times: bytes
    received: bytes
    host_indices: bytes | None
    host_columns: list[list[Any]]


class HourSubject(msgspec.Struct, array_like=True, frozen=True):
    """One GPU's values in the hour: the snapshots that sample it (packed indices; None: every
    one) and its columns, one per metric of the history (ACCELERATOR_METRICS), each encoded."""

    indices: bytes | None
    columns: list[list[Any]]


class StoredHour(msgspec.Struct, frozen=True):
    """What one node-hour stores: its count of observation rows, and the bodies (None: the hour
    is read from the log)."""

    observations: int
    common: bytes | None
    gpus: dict[str, bytes]


_ENCODER = msgspec.msgpack.Encoder()


class HourSnapshots(msgspec.Struct, array_like=True, frozen=True):
    """HourCommon's leading fields, all a GPU's read needs: the host's values are skipped, not
    decoded."""

    positions: bytes
    times: bytes
    received: bytes


_common = msgspec.msgpack.Decoder(HourCommon).decode
_snapshots = msgspec.msgpack.Decoder(HourSnapshots).decode
_subject = msgspec.msgpack.Decoder(HourSubject).decode


def floor_hour(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def ceil_hour(at: datetime) -> datetime:
    floor = floor_hour(at)
    return floor if floor == at else floor + HOUR


# -- columns ----------------------------------------------------------------------------------


_WIDTHS: Final[dict[int, np.dtype[np.signedinteger[Any]]]] = {
    1: np.dtype("<i1"),
    2: np.dtype("<i2"),
    4: np.dtype("<i4"),
    8: np.dtype("<i8"),
}
_FIRST = np.dtype("<i8")


def pack_ints(values: Sequence[int]) -> bytes:
    """The ints (each within 2**62 in size) packed: one byte giving the width of the differences,
    the first in 8 bytes, then the differences, little-endian."""
    if not values:
        return bytes([1])
    differences = list(map(sub, values[1:], values[:-1]))
    largest = max(map(abs, differences), default=0)
    width = next(w for w in _WIDTHS if largest < 2 ** (8 * w - 1))
    first = np.array([values[0]], dtype=_FIRST).tobytes()
    return bytes([width]) + first + np.array(differences, dtype=_WIDTHS[width]).tobytes()


def unpack_ints(packed: bytes) -> Ints:
    dtype = _WIDTHS.get(packed[0]) if packed else None
    if dtype is None:
        raise UndecodableBody("telemetry hour: packed ints of no width")
    if len(packed) == 1:
        return np.empty(0, np.int64)
    if len(packed) < 1 + _FIRST.itemsize or (len(packed) - 1 - _FIRST.itemsize) % dtype.itemsize:
        raise UndecodableBody("telemetry hour: packed ints cut short")
    first = np.frombuffer(packed, dtype=_FIRST, count=1, offset=1)
    differences = np.frombuffer(packed, dtype=dtype, offset=1 + _FIRST.itemsize).astype(np.int64)
    ints: Ints = np.concatenate((first, differences)).cumsum()
    return ints


def encode_column(column: Sequence[Any]) -> list[Any]:
    kinds = set(map(type, column))
    if kinds == {int} and all(-_INT_BOUND < v < _INT_BOUND for v in column):
        return [INTS, pack_ints(column)]
    if kinds == {float}:
        try:
            milli = list(map(round, map(mul, column, repeat(1000.0))))
        except (OverflowError, ValueError):  # an infinity or a NaN
            milli = []
        if (
            milli
            and all(-_THOUSANDTHS_BOUND < m < _THOUSANDTHS_BOUND for m in milli)
            and list(map(truediv, milli, repeat(1000))) == list(column)
            and not any(v == 0 and math.copysign(1.0, v) < 0 for v in column)
        ):
            return [THOUSANDTHS, pack_ints(milli)]
    if len(column) > 1 and _ENCODER.encode(column) == _ENCODER.encode([column[0]] * len(column)):
        return [REPEATED, [column[0], len(column)]]  # e.g. a fan unsupported all hour
    return [VERBATIM, list(column)]


def decode_column(encoded: Sequence[Any]) -> Column:
    """A column as stored: its numbers as float64 (ints packed, thousandths packed), or verbatim."""
    kind, values = encoded
    if kind == INTS:
        return unpack_ints(values).astype(np.float64)
    if kind == THOUSANDTHS:
        return unpack_ints(values) / 1000.0
    if kind == VERBATIM:
        return list(values)
    if kind == REPEATED:
        value, count = values
        if type(count) is not int or count < 0:
            raise UndecodableBody(f"telemetry hour: a value repeated {count!r} times")
        return [value] * count
    raise UndecodableBody(f"telemetry hour: no column encoding {kind!r}")


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    if not rows:
        return [[VERBATIM, []] for _ in range(width)]
    return [encode_column(c) for c in zip(*rows, strict=True)]


# -- an hour stored --------------------------------------------------------------------------


class HourRow(msgspec.Struct, frozen=True):
    """One observation row of the hour (what the builder's query reads)."""

    position: int
    event_type: str
    body: bytes | None
    gpu_set_id: uuid.UUID | None
    received_at: datetime


def stored_hour(
    rows: Sequence[HourRow],
    sets: Mapping[uuid.UUID, str],
    gpu_metrics: Sequence[str],
    host_metrics: Sequence[str],
) -> StoredHour:
    """The hour's bodies from its observation rows in log order. `sets`: the stored GPU sets the
    rows name (`gpu_sets`)."""
    snapshots = [r for r in rows if r.event_type in TELEMETRY_TYPES]
    plain = all(
        r.event_type == SNAPSHOT and r.body is not None and len(r.body) > 1 and r.body[1] in SET_FORMATS
        for r in snapshots
    )
    if not plain or any(r.gpu_set_id not in sets for r in snapshots):
        return StoredHour(observations=len(rows), common=None, gpus={})
    bodies: list[bytes] = [r.body for r in snapshots]  # type: ignore[misc]
    named = [sets[r.gpu_set_id] for r in snapshots]  # type: ignore[index]
    times = snapshot_times(bodies)
    host = host_values(bodies, host_metrics)
    gpus: dict[str, bytes] = {}
    for gpu in sorted({g for joined in set(named) for g in gpu_names(joined)}):
        values = gpu_values(bodies, gpu, gpu_metrics, named)
        if not values.indices:
            continue
        if values.times != [times[i] for i in values.indices]:
            raise UndecodableBody("telemetry hour: a GPU's times differ from its snapshots'")
        every = values.indices == list(range(len(bodies)))
        subject = HourSubject(
            indices=None if every else pack_ints(values.indices),
            columns=_columns(values.values, len(gpu_metrics)),
        )
        gpus[gpu] = _ENCODER.encode(subject)
    common = HourCommon(
        positions=pack_ints([r.position for r in snapshots]),
        times=pack_ints(list(map(micros, times))),
        received=pack_ints([micros(r.received_at) for r in snapshots]),
        host_indices=None if len(host.indices) == len(bodies) else pack_ints(host.indices),
        host_columns=_columns(host.values, len(host_metrics)),
    )
    return StoredHour(observations=len(rows), common=_ENCODER.encode(common), gpus=gpus)


class HourSamples(msgspec.Struct, frozen=True):
    """One subject's samples of a stored hour in log order, as a history part holds them: each
    one's position in the log, time and receive time (whole microseconds since the epoch), and
    one column of values per metric (none where the subject sampled none)."""

    positions: Ints
    times: Ints
    received: Ints
    columns: list[Column]

    def received_in(self, low: datetime, high: datetime) -> HourSamples:
        """The samples received in [low, high), as the log's search finds them."""
        keep = (self.received >= micros(low)) & (self.received < micros(high))
        if bool(keep.all()):
            return self
        index = np.flatnonzero(keep)
        columns = [
            c[index] if isinstance(c, np.ndarray) else [c[i] for i in index.tolist()] for c in self.columns
        ]
        return HourSamples(self.positions[index], self.times[index], self.received[index], columns)


_UNREADABLE = (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, IndexError)


def _samples(
    common: HourCommon | HourSnapshots, indices: bytes | None, encoded: list[list[Any]]
) -> HourSamples:
    positions, times = unpack_ints(common.positions), unpack_ints(common.times)
    received = unpack_ints(common.received)
    columns = [decode_column(c) for c in encoded]
    if not len(positions) == len(times) == len(received):
        raise UndecodableBody("telemetry hour: positions and times of other lengths")
    if indices is not None:
        index = unpack_ints(indices)
        if len(index) and (int(index.min()) < 0 or int(index.max()) >= len(times)):
            raise UndecodableBody("telemetry hour: an index beyond the hour's snapshots")
        positions, times, received = positions[index], times[index], received[index]
    if any(len(c) != len(times) for c in columns):
        raise UndecodableBody("telemetry hour: a column of another length than its samples")
    return HourSamples(positions, times, received, columns)


def host_samples(common_body: bytes) -> HourSamples:
    try:
        common = _common(common_body)
        return _samples(common, common.host_indices, common.host_columns)
    except _UNREADABLE as exc:
        raise UndecodableBody(f"telemetry hour: {exc}") from exc


def gpu_samples(common_body: bytes, gpu_body: bytes | None) -> HourSamples:
    """The GPU's samples of the hour (none where it has no row: it sampled none)."""
    try:
        common = _snapshots(common_body)
        if gpu_body is None:
            none = np.empty(0, np.int64)
            return HourSamples(none, none, none, [])
        subject = _subject(gpu_body)
        return _samples(common, subject.indices, subject.columns)
    except _UNREADABLE as exc:
        raise UndecodableBody(f"telemetry hour: {exc}") from exc


# -- reading ----------------------------------------------------------------------------------

# A node's ($1) observations received in [$2, $3): the predicate of the history's read of the
# log and of what an hour is stored from, so the two agree on which rows an hour holds. An
# observation's segment is the UTC day it was received, or the permanent one ('infinity'): the
# days before the range are not searched at all. The index of observations by receive time leads
# with the stream's key, which another stream may share (schema.sql, "A stream's key"): KEYED_IN
# is every row of the key, RECEIVED_IN checks the stream id as well (`of_stream`).
_IN_WINDOW: LiteralString = (
    "AND e.event_class = 'observation' "
    "AND e.segment >= ($2::timestamptz AT TIME ZONE 'UTC')::date "
    "AND e.received_at >= $2::timestamptz AND e.received_at < $3::timestamptz "
)
KEYED_IN: LiteralString = "mf_stream_key(e.stream_id) = mf_stream_key($1) " + _IN_WINDOW
RECEIVED_IN = of_stream("e.stream_id", "$1") + " " + _IN_WINDOW
# The stored hours of a node in [$2, $3) for the subjects $4, of this FORMAT.
STORED: LiteralString = (
    "SELECT hour, subject, observations, body FROM telemetry_hours "
    "WHERE node_id = $1 AND hour >= $2 AND hour < $3 AND subject = ANY($4::text[]) AND format = $5"
)
# How many observation rows the log holds per hour of [$2, $3) under the node's key: an
# index-only count on the history's index, which never reads a row for its stream id. Where
# another stream shares the key it counts that stream's rows too, so none of the node's stored
# hours agrees with it and they are read from the log: slower, never another node's samples.
COUNTED: LiteralString = (
    "SELECT date_trunc('hour', e.received_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS hour_start, "
    "count(*) AS rows_held FROM events e WHERE " + KEYED_IN + "GROUP BY 1"
)


class Covered(msgspec.Struct, frozen=True):
    """The hours of a window a read takes from `telemetry_hours`, each one's samples of the
    subject, and the ranges of received time left to read from the log, in order."""

    hours: dict[datetime, HourSamples]
    from_log: list[tuple[datetime, datetime]]


async def covered(
    conn: asyncpg.Connection, node_id: str, low: datetime, high: datetime, subject: str
) -> Covered:
    """The stored hours meeting [low, high) whose count the log still agrees with, for `subject`
    ('' the host, else a GPU UUID), each with its samples received in [low, high) only, and the
    rest of [low, high) as ranges to read from the log. An hour that straddles `low` (a window's
    padded start is rarely on the hour) is taken from its stored columns too, its receive times
    cutting it as the log's search would. A stored hour that does not decode is read from the
    log too (and stored again)."""
    first, last = floor_hour(low), ceil_hour(high)
    hours: dict[datetime, HourSamples] = {}
    if last - first >= HOUR:
        stored = await conn.fetch(STORED, node_id, first, last, list({"", subject}), FORMAT)
        commons = {r["hour"]: r for r in stored if r["subject"] == "" and r["body"] is not None}
        if commons:
            held = {
                r["hour_start"]: r["rows_held"]
                for r in await conn.fetch(COUNTED, node_id, min(commons), max(commons) + HOUR)
            }
            own = {r["hour"]: r["body"] for r in stored if r["subject"] == subject and subject}
            for hour, r in commons.items():
                if held.get(hour, 0) != r["observations"]:
                    STALE.add((node_id, hour))
                    continue
                try:
                    samples = gpu_samples(r["body"], own.get(hour)) if subject else host_samples(r["body"])
                    hours[hour] = (
                        samples if low <= hour and hour + HOUR <= high else samples.received_in(low, high)
                    )
                except UndecodableBody as exc:
                    log.warning(
                        "telemetry_hours.undecodable", node_id=node_id, hour=hour.isoformat(), error=str(exc)
                    )
                    STALE.add((node_id, hour))
    return Covered(hours=dict(sorted(hours.items())), from_log=_gaps(low, high, sorted(hours)))


def _gaps(low: datetime, high: datetime, hours: Sequence[datetime]) -> list[tuple[datetime, datetime]]:
    out: list[tuple[datetime, datetime]] = []
    at = low
    for hour in hours:
        if hour > at:
            out.append((at, hour))
        at = hour + HOUR
    if at < high:
        out.append((at, high))
    return out


# Hours a read found stale (a report committed after the hour was stored): the next pass stores
# them again. Bounded: a forgotten one stays read from the log.
STALE: set[tuple[str, datetime]] = set()
_STALE_MOST = 10_000


# -- storing ----------------------------------------------------------------------------------

_HOUR_ROWS: LiteralString = (
    "SELECT e.global_position, e.event_type, e.body, e.received_at, "
    "CASE WHEN get_byte(e.body, 1) IN (3, 4) THEN e.sampled END AS gpu_set_id "
    "FROM events e WHERE " + RECEIVED_IN + "ORDER BY e.global_position"
)
# The nodes with observations received in the hour $1 and no hour stored of this FORMAT.
_DUE: LiteralString = (
    "SELECT n.node_id FROM hw_nodes n "
    "WHERE NOT EXISTS (SELECT 1 FROM telemetry_hours t WHERE t.node_id = n.node_id AND t.hour = $1 "
    "AND t.subject = '' AND t.format = $2) "
    "AND EXISTS (SELECT 1 FROM events e WHERE " + of_stream("e.stream_id", "n.node_id") + " "
    "AND e.event_class = 'observation' "
    "AND e.segment >= ($1::timestamptz AT TIME ZONE 'UTC')::date "
    "AND e.received_at >= $1::timestamptz AND e.received_at < $1::timestamptz + interval '1 hour') "
    "ORDER BY n.node_id LIMIT $3"
)


async def store_hour(
    pool: asyncpg.Pool,
    node_id: str,
    hour: datetime,
    gpu_metrics: Sequence[str],
    host_metrics: Sequence[str],
    spent: list[float] | None = None,
) -> StoredHour:
    """Store (again) one node-hour from the log, in one transaction; two servers storing the
    same hour take turns (an advisory lock of the two-key space, which no stream lock uses).
    `spent`: the CPU seconds making the hour took are added to its one element."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "SELECT pg_advisory_xact_lock($1, hashtext($2 || $3::timestamptz::text))",
            _LOCK_SPACE,
            node_id,
            hour,
        )
        records = await conn.fetch(_HOUR_ROWS, node_id, hour, hour + HOUR)
        rows = [
            HourRow(r["global_position"], r["event_type"], r["body"], r["gpu_set_id"], r["received_at"])
            for r in records
        ]
        sets = await stored_sets(conn, {r.gpu_set_id for r in rows})
        try:
            # Tens of milliseconds of CPU for an eight-GPU node: in a thread, so the event loop
            # (the agents' reports, every request) waits a switch interval, not the whole hour.
            stored, cpu = await asyncio.to_thread(_timed, rows, sets, gpu_metrics, host_metrics)
            if spent is not None:
                spent[0] += cpu
        except UndecodableBody as exc:  # the read decodes the log and says so
            log.warning("telemetry_hours.undecodable", node_id=node_id, hour=hour.isoformat(), error=str(exc))
            stored = StoredHour(observations=len(rows), common=None, gpus={})
        await conn.execute("DELETE FROM telemetry_hours WHERE node_id = $1 AND hour = $2", node_id, hour)
        await conn.executemany(
            "INSERT INTO telemetry_hours (node_id, hour, subject, format, observations, body) "
            "VALUES ($1, $2, $3, $4, $5, $6)",
            [
                (node_id, hour, "", FORMAT, stored.observations, stored.common),
                *((node_id, hour, gpu, FORMAT, 0, body) for gpu, body in stored.gpus.items()),
            ],
        )
    return stored


_LOCK_SPACE = 7305820
# Nodes due in one hour asked for at a time (the next page is what is still due after them).
DUE_PAGE = 64


def _timed(
    rows: Sequence[HourRow], sets: Mapping[uuid.UUID, str], gpu: Sequence[str], host: Sequence[str]
) -> tuple[StoredHour, float]:
    """`stored_hour` and the CPU seconds its thread spent on it."""
    started = time.thread_time()
    return stored_hour(rows, sets, gpu, host), time.thread_time() - started


class HoursPass(msgspec.Struct):
    """A process's memory between passes: the hours every node has stored, and the oldest hour
    kept when the older ones were last removed; for /metrics, the node-hours it stored and the
    passes that stopped at their budget before they had looked at every hour."""

    done: set[datetime] = msgspec.field(default_factory=set)
    kept_from: datetime | None = None
    stored_total: int = 0
    short_passes: int = 0


async def store_due(
    pool: asyncpg.Pool,
    memory: HoursPass,
    *,
    keep: timedelta,
    gpu_metrics: Sequence[str],
    host_metrics: Sequence[str],
    now: datetime | None = None,
    budget: float = 1.0,
) -> int:
    """Store the closed hours not stored yet, the newest first, until making them took `budget`
    seconds of CPU (the thread's that makes them: the reports the process serves meanwhile are
    not counted against it); hours older than `keep` are not stored and their rows removed. The
    number of node-hours stored."""
    now = now or datetime.now(UTC)
    newest = floor_hour(now - GRACE) - HOUR
    oldest = floor_hour(now - keep)
    spent = [0.0]
    stored = 0
    if memory.kept_from != oldest:  # once an hour: the table has no index by hour alone
        await pool.execute("DELETE FROM telemetry_hours WHERE hour < $1", oldest)
        memory.kept_from = oldest
        memory.done = {h for h in memory.done if h >= oldest}
    stale = sorted(STALE, key=lambda s: s[1], reverse=True)
    STALE.clear()
    for node_id, hour in stale:
        if hour >= oldest and spent[0] < budget:
            await store_hour(pool, node_id, hour, gpu_metrics, host_metrics, spent)
            stored += 1
    hour = newest
    while hour >= oldest and spent[0] < budget:
        if hour in memory.done:
            hour -= HOUR
            continue
        nodes = [r["node_id"] for r in await pool.fetch(_DUE, hour, FORMAT, DUE_PAGE)]
        if not nodes:
            memory.done.add(hour)
            hour -= HOUR
            continue
        for node_id in nodes:
            await store_hour(pool, node_id, hour, gpu_metrics, host_metrics, spent)
            stored += 1
            if spent[0] >= budget:
                break
    if len(STALE) > _STALE_MOST:
        STALE.clear()
    memory.stored_total += stored
    if hour >= oldest:  # the budget ran out first
        memory.short_passes += 1
    return stored
