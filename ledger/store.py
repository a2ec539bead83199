"""The PostgreSQL event store: append with optimistic concurrency and idempotency, stream reads,
and the gap-safe global catch-up read.

Appends go through the `mf_append` database function (schema.sql) in one round trip; the inline
projections then run in the same transaction, so a reader of the read models sees its own writes
and a crash never leaves events without their projections (or the reverse).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import asyncpg
import msgspec
import structlog

from ledger.events import (
    SCHEMA_VERSION,
    EventClass,
    NewEvent,
    RecordedEvent,
    decode_metadata,
    decode_payload,
    validate_metadata,
    validate_payload,
)

log = structlog.get_logger(__name__)

# The rebuild gate: every append holds it shared; `rebuild` holds it exclusively for its swap.
REBUILD_GATE_KEY = 7305820111


class LedgerError(Exception):
    """Base of the event store's typed errors."""


class StreamVersionConflict(LedgerError):
    """The stream moved on since the caller read it; nothing was written."""

    def __init__(self, stream_id: str, expected: int | None, actual: int | None) -> None:
        super().__init__(f"stream {stream_id} is at version {actual}, expected {expected}")
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual


class StreamTombstoned(LedgerError):
    """The stream ended with a tombstone (a decommissioned node) and takes no more events."""

    def __init__(self, stream_id: str, detail: str) -> None:
        super().__init__(detail)
        self.stream_id = stream_id


class DuplicateEvent(LedgerError):
    """Part of a batch is already stored: a batch is idempotent only as a whole."""


class StreamInfo(msgspec.Struct, frozen=True):
    stream_id: str
    version: int
    lifecycle_version: int
    tombstoned_at: datetime | None


class Checkpoint(msgspec.Struct, frozen=True, order=True):
    """A position in the global catch-up order: (transaction id, global position)."""

    tx_id: int = 0
    position: int = 0


class AppendResult(msgspec.Struct, frozen=True):
    stream_id: str
    stream_version: int
    events: list[RecordedEvent]
    already_stored: bool


class InlineProjection(Protocol):
    """A read model the store keeps current inside each append's transaction."""

    name: str

    async def apply(
        self,
        conn: asyncpg.Connection,
        stream_id: str,
        events: Sequence[RecordedEvent],
        prior: Any = None,
    ) -> None:
        """Fold `events` into the read model. `prior`: the stream's folded state as the caller
        already loaded it under the stream lock (saves reading it twice), else None."""
        ...


_EVENT_COLUMNS = (
    "global_position, stream_id, stream_version, event_id, event_type, event_class, "
    "schema_version, data::text AS data, metadata::text AS metadata, recorded_at"
)


def event_from_row(row: asyncpg.Record) -> RecordedEvent:
    return RecordedEvent(
        global_position=row["global_position"],
        stream_id=row["stream_id"],
        stream_version=row["stream_version"],
        event_id=row["event_id"],
        event_type=row["event_type"],
        event_class=row["event_class"],
        schema_version=row["schema_version"],
        payload=decode_payload(row["data"]),
        metadata=decode_metadata(row["metadata"]),
        recorded_at=row["recorded_at"],
    )


def _translate(exc: asyncpg.PostgresError, stream_id: str, expected: int | None) -> LedgerError | None:
    code = getattr(exc, "sqlstate", None)
    if code == "MF409":
        detail = getattr(exc, "detail", None)
        return StreamVersionConflict(stream_id, expected, int(detail) if detail else None)
    if code == "MF410":
        return StreamTombstoned(stream_id, str(exc))
    if code == "MF422":
        return DuplicateEvent(str(exc))
    return None


class EventStore:
    def __init__(self, pool: asyncpg.Pool, projections: Sequence[InlineProjection] = ()) -> None:
        self.pool = pool
        self.projections = tuple(projections)

    async def append(
        self,
        stream_id: str,
        expected_version: int | None,
        events: Sequence[NewEvent],
        *,
        conn: asyncpg.Connection | None = None,
        locked: bool = False,
        prior_states: Mapping[str, Any] | None = None,
    ) -> AppendResult:
        """Append `events` to `stream_id` if it is at `expected_version` (None: any version).

        Raises StreamVersionConflict (nothing written) when the stream moved on, StreamTombstoned
        for a tombstoned stream, EventValidationError for an event the catalog rejects (checked
        before anything is sent). Appending the same batch again (same event ids) returns the
        stored events and writes nothing. With `conn`, runs inside the caller's transaction;
        `locked=True` says the caller already holds the stream's lock (see `lock_stream`).
        """
        if not events:
            raise ValueError("append needs at least one event")
        encoded = [(validate_payload(e.payload), validate_metadata(e.metadata)) for e in events]
        if conn is None:
            async with self.pool.acquire() as own, own.transaction():
                return await self._append(
                    own, stream_id, expected_version, events, encoded, locked, prior_states
                )
        return await self._append(conn, stream_id, expected_version, events, encoded, locked, prior_states)

    async def _append(
        self,
        conn: asyncpg.Connection,
        stream_id: str,
        expected_version: int | None,
        events: Sequence[NewEvent],
        encoded: list[tuple[bytes, bytes]],
        locked: bool,
        prior_states: Mapping[str, Any] | None = None,
    ) -> AppendResult:
        classes: list[EventClass] = [e.event_class for e in events]
        try:
            rows = await conn.fetch(
                "SELECT out_global_position, out_stream_version, out_already_stored, out_recorded_at "
                "FROM mf_append($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                stream_id,
                expected_version,
                [e.event_id for e in events],
                [e.event_type for e in events],
                classes,
                [SCHEMA_VERSION] * len(events),
                [msgspec.Raw(d) for d, _ in encoded],
                [msgspec.Raw(m) for _, m in encoded],
                locked,
            )
        except asyncpg.PostgresError as exc:
            translated = _translate(exc, stream_id, expected_version)
            if translated is not None:
                raise translated from exc
            raise
        if rows and rows[0]["out_already_stored"]:
            stored = await conn.fetch(
                f"SELECT {_EVENT_COLUMNS} FROM events WHERE event_id = ANY($1) ORDER BY global_position",
                [e.event_id for e in events],
            )
            recorded = [event_from_row(r) for r in stored]
            log.info("append.idempotent", stream_id=stream_id, events=len(recorded))
            return AppendResult(stream_id, recorded[-1].stream_version, recorded, already_stored=True)

        recorded = [
            RecordedEvent(
                global_position=row["out_global_position"],
                stream_id=stream_id,
                stream_version=row["out_stream_version"],
                event_id=event.event_id,
                event_type=event.event_type,
                event_class=cls,
                schema_version=SCHEMA_VERSION,
                # Fold what the log will give back on rebuild, not the caller's objects.
                payload=decode_payload(data),
                metadata=decode_metadata(meta),
                recorded_at=row["out_recorded_at"],
            )
            for row, event, cls, (data, meta) in zip(rows, events, classes, encoded, strict=True)
        ]
        priors = prior_states or {}
        for projection in self.projections:
            await projection.apply(conn, stream_id, recorded, priors.get(projection.name))
        return AppendResult(stream_id, recorded[-1].stream_version, recorded, already_stored=False)

    async def lock_stream(self, conn: asyncpg.Connection, stream_id: str) -> StreamInfo:
        """Serialize work on one stream for the rest of the caller's transaction (other streams
        proceed in parallel) and return where the stream stands."""
        row = await conn.fetchrow("SELECT * FROM mf_lock_stream($1)", stream_id)
        return StreamInfo(
            stream_id, row["out_version"], row["out_lifecycle_version"], row["out_tombstoned_at"]
        )

    async def read_stream(
        self, stream_id: str, *, after_version: int = 0, conn: asyncpg.Connection | None = None
    ) -> list[RecordedEvent]:
        query = (
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE stream_id = $1 AND stream_version > $2 "
            "ORDER BY stream_version"
        )
        if conn is None:
            async with self.pool.acquire() as own:
                rows = await own.fetch(query, stream_id, after_version)
        else:
            rows = await conn.fetch(query, stream_id, after_version)
        return [event_from_row(r) for r in rows]

    async def read_all(
        self, after: Checkpoint, *, limit: int = 1000, conn: asyncpg.Connection | None = None
    ) -> tuple[list[RecordedEvent], Checkpoint]:
        """The gap-safe global catch-up read (NOTES.md section 2).

        Global positions are taken at insert but become visible at commit, so they appear out of
        order. Reading only below the oldest running transaction (`pg_snapshot_xmin`) and in
        (tx_id, position) order means an event is never passed by: a late-committing transaction
        has a smaller tx_id than the horizon, and is read once the horizon moves past it.
        """
        query = (
            # Not `AS tx_id`: ORDER BY would bind to the text alias and sort 1000 before 999.
            f"SELECT {_EVENT_COLUMNS}, tx_id::text AS tx_text FROM events "
            "WHERE (tx_id, global_position) > ($1::text::xid8, $2) "
            "AND tx_id < pg_snapshot_xmin(pg_current_snapshot()) "
            "ORDER BY tx_id, global_position LIMIT $3"
        )
        if conn is None:
            async with self.pool.acquire() as own:
                rows = await own.fetch(query, str(after.tx_id), after.position, limit)
        else:
            rows = await conn.fetch(query, str(after.tx_id), after.position, limit)
        if not rows:
            return [], after
        last = rows[-1]
        return [event_from_row(r) for r in rows], Checkpoint(int(last["tx_text"]), last["global_position"])


def deterministic_event_id(*parts: Any) -> uuid.UUID:
    """An idempotency key derived from what makes an event unique (e.g. agent stream + sequence)."""
    return uuid.uuid5(uuid.NAMESPACE_OID, "/".join(str(p) for p in parts))
