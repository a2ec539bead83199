"""Reading the log: the one reader of event rows, and the one gap-safe read in commit order.

Every consumer that walks the log in commit order (the catch-up read, `GET /events`, `replay`, the
console's live feed) calls `read_log`; nothing else writes that SQL condition or that ordering.

Why commit order needs care: a global position is taken at INSERT but becomes visible at COMMIT,
so positions appear out of order. Rows are read only below the oldest transaction still running
(`pg_snapshot_xmin`) and in `(tx_id, global_position)` order, so a late-committing transaction
always has a smaller `tx_id` than the horizon and is read once the horizon passes it.

The cursor is numeric end to end: `tx_id` is an `xid8` (asyncpg hands it over as an int) and the
ORDER BY names the table's own columns. A select-list alias that shadows a column of another type
(`tx_id` cast to text and named `tx_id`) captures a bare ORDER BY name and sorts as text, so `'100000'` sorts
before `'99999'` and the cursor repeats or skips events wherever transaction ids gain a digit;
docs/architecture.md states the rule for every query.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime
from typing import Any, LiteralString

import asyncpg
import msgspec

from ledger.compact import UndecodableBody
from ledger.compact_decode import decode_body
from ledger.events import (
    OBSERVATION_EVENT_TYPES,
    EventClass,
    EventPayload,
    RecordedEvent,
    decode_metadata,
    decode_payload,
)

# The one column list of an event row. JSON columns come back as text under names of their own
# (decoding them with msgspec is faster than asyncpg's json codec, and no alias shadows a column);
# an event stored compact has its body instead (ledger/compact.py), and one of format 3 or 4 (its
# second byte) the GPU set its `sampled` names (ledger/gpu_sets.py).
EVENT_COLUMNS = (
    "events.global_position, events.stream_id, events.stream_version, events.event_id, "
    "events.event_type, events.event_class, events.schema_version, "
    "events.data::text AS data_json, events.metadata::text AS metadata_json, events.body, "
    "events.recorded_at, (SELECT g.gpus FROM gpu_sets g WHERE g.sampled = events.sampled "
    "AND get_byte(events.body, 1) IN (3, 4)) AS gpu_set"
)

# A page's rows are decoded this many at a time, the event loop let run in between: a page of a
# thousand telemetry snapshots is a hundred milliseconds and more of CPU, and the server's agent
# reports and requests wait on the same loop (docs/performance.md).
DECODE_SLICE = 64
# xid8 is unsigned 64-bit, but a cluster consuming a million ids a second needs 290,000 years to
# pass 2**63, so cursors bound both parts to bigint (msgspec checks bounds within int64).
MAX_TX_ID = 2**63 - 1
MAX_POSITION = 2**63 - 1


class Checkpoint(msgspec.Struct, frozen=True, order=True):
    """A position in the global commit order: (transaction id, global position)."""

    tx_id: int = 0
    position: int = 0


class UndecodableEvent(ValueError):
    """A stored event the catalog no longer accepts (edited in the database, or a schema drift).
    Names the event so an operator can find it."""

    def __init__(self, stream_id: str, stream_version: int, global_position: int, reason: str) -> None:
        super().__init__(
            f"event at stream {stream_id} version {stream_version} (global position {global_position}) "
            f"cannot be decoded by the event catalog: {reason}"
        )
        self.stream_id = stream_id
        self.stream_version = stream_version
        self.global_position = global_position
        self.reason = reason


class StoredEvent(msgspec.Struct, frozen=True):
    """An event as stored, for one the catalog cannot decode: audit reads show it marked as such
    instead of failing the whole page."""

    global_position: int
    stream_id: str
    stream_version: int
    event_id: uuid.UUID
    event_type: str
    event_class: EventClass
    schema_version: int
    data_json: str
    metadata_json: str
    recorded_at: datetime
    error: str

    def raw_data(self) -> Any:
        return _raw_json(self.data_json)

    def raw_metadata(self) -> Any:
        return _raw_json(self.metadata_json)


def _raw_json(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


LogEntry = RecordedEvent | StoredEvent


def _undecodable_body(body: bytes) -> str:
    """A compact body the catalog refuses, shown as what it is: its bytes, hex."""
    return msgspec.json.encode({"compact_body_hex": body.hex()}).decode()


def event_from_row(row: asyncpg.Record) -> RecordedEvent:
    """Decode one event row (selected with EVENT_COLUMNS). Raises UndecodableEvent naming it."""
    payload: EventPayload
    try:
        body = row["body"]
        if body is not None:
            payload, metadata = decode_body(body, row["stream_id"], row["gpu_set"])
        else:
            payload = decode_payload(row["data_json"])
            metadata = decode_metadata(row["metadata_json"])
    except (msgspec.ValidationError, msgspec.DecodeError, UndecodableBody) as exc:
        raise UndecodableEvent(
            row["stream_id"], row["stream_version"], row["global_position"], str(exc)
        ) from exc
    return RecordedEvent(
        global_position=row["global_position"],
        stream_id=row["stream_id"],
        stream_version=row["stream_version"],
        event_id=row["event_id"],
        event_type=row["event_type"],
        event_class=row["event_class"],
        schema_version=row["schema_version"],
        payload=payload,
        metadata=metadata,
        recorded_at=row["recorded_at"],
    )


def entry_from_row(row: asyncpg.Record) -> LogEntry:
    """Decode one event row, or keep it as stored when the catalog refuses it."""
    try:
        return event_from_row(row)
    except UndecodableEvent as exc:
        return StoredEvent(
            global_position=row["global_position"],
            stream_id=row["stream_id"],
            stream_version=row["stream_version"],
            event_id=row["event_id"],
            event_type=row["event_type"],
            event_class=row["event_class"],
            schema_version=row["schema_version"],
            data_json=row["data_json"] if row["body"] is None else _undecodable_body(row["body"]),
            metadata_json=row["metadata_json"] if row["body"] is None else "null",
            recorded_at=row["recorded_at"],
            error=exc.reason,
        )


class LogFilter(msgspec.Struct, frozen=True):
    """Which events a log read delivers; the commit order and the horizon are not negotiable."""

    stream_id: str | None = None
    event_types: tuple[str, ...] = ()
    event_class: EventClass | None = None
    accelerator_uuid: str | None = None
    # The lifecycle events of one GPU UUID, on every node: found by the permanent segment's
    # `events_permanent_gpu_uuid_idx`, not by reading the log (docs/lemons.md).
    gpu_uuid: str | None = None
    recorded_since: datetime | None = None  # inclusive
    recorded_until: datetime | None = None  # exclusive


class LogPage(msgspec.Struct, frozen=True):
    """One page of the log. `resume` is where the next read starts: after the last entry delivered,
    or the input checkpoint when nothing was. `more`: the page was cut by its limit."""

    entries: list[LogEntry]
    resume: Checkpoint
    more: bool


def of_stream(column: LiteralString, stream: LiteralString) -> LiteralString:
    """The SQL condition that the stream id `column` is `stream` (each an SQL expression), by the
    stream's key that the log's indexes by stream lead with. The id is checked too, as another
    stream may share the key, in the form that keeps PostgreSQL's row estimate the key's
    (schema.sql, "A stream's key")."""
    key, wanted = f"mf_stream_key({column})", f"mf_stream_key({stream})"
    return f"{key} = {wanted} AND ({column} = {stream} OR {key} <> {wanted})"


# The gap-safe read: after the checkpoint ($1, $2), below the horizon, in commit order. A filter
# adds its condition, a fixed fragment whose `{n}` is its parameter's number (the only thing ever
# put into one); the limit takes the last number.
_LOG_READ = (
    "SELECT " + EVENT_COLUMNS + ", events.tx_id FROM events "
    "WHERE (events.tx_id, events.global_position) > ($1::xid8, $2::bigint) "
    "AND events.tx_id < pg_snapshot_xmin(pg_current_snapshot())"
)
_BY_STREAM = " AND " + of_stream("events.stream_id", "${n}")
_BY_TYPES = " AND events.event_type = ANY(${n}::text[])"
_BY_CLASS = " AND events.event_class = ${n}"
_BY_ACCELERATOR = " AND (events.data->>'uuid' = ${n} OR events.data->>'accelerator_uuid' = ${n})"
# The expression and condition are those of the permanent segment's index by GPU UUID.
_BY_GPU_LIFECYCLE = (
    " AND events.event_class = 'lifecycle'"
    " AND coalesce(events.data->>'uuid', events.data->>'accelerator_uuid') = ${n}"
)
# A read of lifecycle events only (by class, by a GPU's lifecycle, or by types none of which is an
# observation's): they all live in the permanent segment, the only one with the indexes by type and
# by GPU UUID (schema.sql), and naming it leaves the day segments' telemetry out of the plan.
_LIFECYCLE_ONLY = " AND events.segment = 'infinity'"
_RECORDED_SINCE = " AND events.recorded_at >= ${n}"
_RECORDED_UNTIL = " AND events.recorded_at < ${n}"
_IN_COMMIT_ORDER = " ORDER BY events.tx_id, events.global_position LIMIT ${n}"


class _Statement:
    """A statement built of fixed fragments, each taking the next parameter number."""

    def __init__(self, text: str, *args: Any) -> None:
        self.parts = [text]
        self.args = list(args)

    def add(self, fragment: str, value: Any) -> None:
        self.args.append(value)
        self.parts.append(fragment.format(n=len(self.args)))

    def fixed(self, fragment: str) -> None:
        self.parts.append(fragment)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _log_query(after: Checkpoint, where: LogFilter, limit: int) -> _Statement:
    statement = _Statement(_LOG_READ, after.tx_id, after.position)
    if where.stream_id is not None:
        statement.add(_BY_STREAM, where.stream_id)
    if where.event_types:
        statement.add(_BY_TYPES, list(where.event_types))
    if where.event_class is not None:
        statement.add(_BY_CLASS, where.event_class)
    if (
        where.event_class == "lifecycle"
        or where.gpu_uuid is not None
        or (where.event_types and OBSERVATION_EVENT_TYPES.isdisjoint(where.event_types))
    ):
        statement.fixed(_LIFECYCLE_ONLY)
    if where.accelerator_uuid is not None:
        statement.add(_BY_ACCELERATOR, where.accelerator_uuid)
    if where.gpu_uuid is not None:
        statement.add(_BY_GPU_LIFECYCLE, where.gpu_uuid)
    if where.recorded_since is not None:
        statement.add(_RECORDED_SINCE, where.recorded_since)
    if where.recorded_until is not None:
        statement.add(_RECORDED_UNTIL, where.recorded_until)
    statement.add(_IN_COMMIT_ORDER, limit)
    return statement


async def read_log(
    conn: asyncpg.Connection,
    after: Checkpoint,
    *,
    limit: int,
    where: LogFilter | None = None,
) -> LogPage:
    """The gap-safe read: committed events after `after`, in commit order, each exactly once across
    successive calls that pass back `resume`."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    statement = _log_query(after, where or LogFilter(), limit + 1)
    rows = await conn.fetch(statement.text, *statement.args)
    page = rows[:limit]
    if not page:
        return LogPage(entries=[], resume=after, more=False)
    last = page[-1]
    entries: list[LogEntry] = []
    for start in range(0, len(page), DECODE_SLICE):
        if start:
            await asyncio.sleep(0)
        entries.extend(entry_from_row(r) for r in page[start : start + DECODE_SLICE])
    return LogPage(
        entries=entries,
        resume=Checkpoint(last["tx_id"], last["global_position"]),
        more=len(rows) > limit,
    )
