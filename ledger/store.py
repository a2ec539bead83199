"""The PostgreSQL event store: append with optimistic concurrency and idempotency, stream reads,
and the gap-safe global catch-up read.

Appends go through the `mf_append_positioned` database function (ledger/sql/functions/) in one
round trip; the inline projections then run in the same transaction, so a reader of the read
models sees its own writes and a crash never leaves events without their projections (or the
reverse). The folded states the store keeps after writing them: ledger/state_cache.py; an append
whose fold precedes it, written by one statement with its read models: ledger/folded_append.py.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Literal

import asyncpg
import msgspec
import structlog

from ledger.compact import GpuSet, gpu_set
from ledger.events import (
    SCHEMA_VERSION,
    NewEvent,
    NodeTelemetryObserved,
    RecordedEvent,
)
from ledger.gpu_sets import GpuSets
from ledger.group_commit import GroupCommit, TryAgain
from ledger.inline_projection import InlineProjection, StateSource
from ledger.reading import (
    EVENT_COLUMNS,
    Checkpoint,
    StoredEvent,
    UndecodableEvent,
    event_from_row,
    read_log,
)
from ledger.reserved_positions import ReservedPositions
from ledger.state_cache import STATE_CACHE_STREAMS, KeptState, StateCache
from ledger.stored_form import StoredForm, stored_form

__all__ = ["Checkpoint", "EventStore", "UndecodableEvent", "event_from_row"]

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

    def __init__(self, stream_id: str, detail: str, tombstoned_at: datetime | None = None) -> None:
        super().__init__(detail)
        self.stream_id = stream_id
        self.tombstoned_at = tombstoned_at


class DuplicateEvent(LedgerError):
    """Part of a batch is already stored: a batch is idempotent only as a whole."""


class GpuSetNotStored(TryAgain, LedgerError):
    """A snapshot named a GPU set the store remembered stored and the database lacks (a failover
    lost its commit); nothing was written. The store has forgotten what it remembered: the same
    append again stores the set first (a group commit runs it again at once)."""


class StreamInfo(msgspec.Struct, frozen=True):
    stream_id: str
    version: int
    lifecycle_version: int
    tombstoned_at: datetime | None


class AppendResult(msgspec.Struct, frozen=True):
    stream_id: str
    stream_version: int
    events: list[RecordedEvent]
    already_stored: bool
    # Each inline projection's folded state after the append, by projection name (absent for a
    # projection that does not handle the stream, and for a batch that was already stored).
    states: dict[str, object] = {}


class AppendRequest(msgspec.Struct, frozen=True):
    """One stream's part of `EventStore.append_many`."""

    stream_id: str
    expected_version: int | None
    events: Sequence[NewEvent]
    # Each inline projection's folded state of the stream as the caller loaded it, by name.
    prior_states: Mapping[str, object] = {}


def _translate(exc: asyncpg.PostgresError, stream_id: str, expected: int | None) -> LedgerError | None:
    code: object = getattr(exc, "sqlstate", None)
    if code == "MF409":
        detail = getattr(exc, "detail", None)
        return StreamVersionConflict(stream_id, expected, int(detail) if detail else None)
    if code == "MF410":
        return StreamTombstoned(stream_id, str(exc))
    if code == "MF422":
        return DuplicateEvent(str(exc))
    return None


# The two append functions (ledger/sql/functions/): the events' arrays, then `p_locked` for
# mf_append_many (called as mf_append_positioned, without positions: one call fewer), or the kept
# checkpoints for mf_append_kept.
_APPEND_SQL = {
    "mf_append_many": "SELECT out_stream_index, out_global_position, out_stream_version, "
    "out_already_stored, out_recorded_at "
    "FROM mf_append_positioned($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, NULL)",
    "mf_append_kept": "SELECT out_stream_index, out_global_position, out_stream_version, "
    "out_already_stored, out_recorded_at "
    "FROM mf_append_kept($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)",
}
# A batch already stored, as stored.
_STORED_EVENTS = "SELECT " + EVENT_COLUMNS + " FROM events WHERE event_id = ANY($1) ORDER BY global_position"
# One stream's events after a version.
_STREAM_EVENTS = (
    "SELECT " + EVENT_COLUMNS + " FROM events WHERE stream_id = $1 AND stream_version > $2 "
    "ORDER BY stream_version"
)


def append_arguments(
    requests: Sequence[AppendRequest], encoded: Sequence[Sequence[StoredForm]]
) -> list[object]:
    """The twelve arrays every append function takes first: the streams, their expected
    versions and counts, then each event's id, type, class, schema version, jsonb data and
    metadata or compact body, received time and sampled GPUs."""
    flat = [e for r in requests for e in r.events]
    codes = [c for per in encoded for c in per]
    return [
        [r.stream_id for r in requests],
        [r.expected_version for r in requests],
        [len(r.events) for r in requests],
        [e.event_id for e in flat],
        [e.event_type for e in flat],
        [e.event_class for e in flat],
        [SCHEMA_VERSION] * len(flat),
        [None if c.data is None else msgspec.Raw(c.data) for c in codes],
        [None if c.metadata_json is None else msgspec.Raw(c.metadata_json) for c in codes],
        [c.body for c in codes],
        [c.metadata.received_at for c in codes],
        [c.sampled for c in codes],
    ]


class EventStore:
    def __init__(
        self,
        pool: asyncpg.Pool,
        projections: Sequence[InlineProjection] = (),
        *,
        state_cache_streams: int = STATE_CACHE_STREAMS,
    ) -> None:
        self.pool = pool
        self.projections = tuple(projections)
        self.states = StateCache(state_cache_streams)
        self.gpu_sets = GpuSets()
        self.reserved = ReservedPositions()
        # Appends of concurrent callers (each its own transaction before) share one: a commit and
        # its WAL flush, one `mf_append_many` and one projection write for the lot. A lone append
        # still runs at once, alone; a conflict in a batch has each of its appends run again alone.
        self._appends: GroupCommit[AppendRequest, AppendResult] = GroupCommit(
            pool, self._append_together, concurrency=2, share=True
        )

    @property
    def appends_committed(self) -> tuple[int, int]:
        """(transactions, appends) committed by `append` without a connection (for diagnostics)."""
        return self._appends.batches, self._appends.units

    async def append(
        self,
        stream_id: str,
        expected_version: int | None,
        events: Sequence[NewEvent],
        *,
        conn: asyncpg.Connection | None = None,
        locked: bool = False,
        prior_states: Mapping[str, object] | None = None,
    ) -> AppendResult:
        """Append `events` to `stream_id` if it is at `expected_version` (None: any version).

        Raises StreamVersionConflict (nothing written) when the stream moved on, StreamTombstoned
        for a tombstoned stream, EventValidationError for an event the catalog rejects (checked
        before anything is sent). Appending the same batch again (same event ids) returns the
        stored events and writes nothing. With `conn`, runs inside the caller's transaction (a
        store with inline projections refuses a connection outside one; without projections the
        append there is one statement, a transaction of its own);
        `locked=True` says the caller already holds the stream's lock (see `lock_stream`).
        Without either, concurrent appends to different streams commit together
        (ledger.group_commit), each still all or nothing and answered once committed.
        """
        if not events:
            raise ValueError("append needs at least one event")
        request = AppendRequest(stream_id, expected_version, events, prior_states or {})
        if conn is None and not locked:
            return await self._appends.run(stream_id, request)
        if conn is None:
            async with self.pool.acquire() as own, own.transaction():
                (result,) = await self.append_many(own, [request], locked=locked)
                return result
        (result,) = await self.append_many(conn, [request], locked=locked)
        return result

    async def _append_together(
        self, conn: asyncpg.Connection, requests: Sequence[AppendRequest]
    ) -> list[AppendResult]:
        # One stream each, sorted by stream id (GroupCommit): their locks taken in that order, at
        # once, then one mf_append_many for all of them. Any refusal raises for
        # the whole batch, which then runs each append alone, where the typed error names its stream.
        # The first projection's states come with the locks, in the same round trip (read after
        # the locks are held, so they are the checkpoints this batch folds onto), unless this
        # store kept every one of them (`_append_kept`).
        first = self.projections[0] if self.projections else None
        if first is None:
            await self.open_streams(conn, [r.stream_id for r in requests], "")
            return await self.append_many(conn, requests, locked=True)
        encoded = await self.encoded(conn, requests)
        kept = await self._append_kept(conn, requests, encoded, first)
        if kept is not None:
            return kept
        opened = await self.open_states(conn, [r.stream_id for r in requests], first)
        requests = [
            r
            if first.name in r.prior_states
            else msgspec.structs.replace(r, prior_states={**r.prior_states, first.name: state})
            for r, (_info, state) in zip(requests, opened, strict=True)
        ]
        rows = await self._send(conn, requests, encoded, "mf_append_many", (True,))
        return await self._recorded(conn, requests, encoded, rows)

    async def _append_kept(
        self,
        conn: asyncpg.Connection,
        requests: Sequence[AppendRequest],
        encoded: Sequence[Sequence[StoredForm]],
        first: InlineProjection,
    ) -> list[AppendResult] | None:
        """`append_kept` where this store kept every stream's state of the first projection and
        no caller named another version or state; None where it did not, or where it found
        another checkpoint stored (nothing written, the locks held)."""
        kept = self.states.all_kept(first.name, [r.stream_id for r in requests])
        if kept is None:
            return None
        held, rebuild = kept
        for request, entry in zip(requests, held, strict=True):
            if first.name in request.prior_states or request.expected_version not in (None, entry.version):
                return None
        return await self._send_kept(conn, requests, encoded, first.name, held, rebuild)

    async def append_kept(
        self,
        conn: asyncpg.Connection,
        requests: Sequence[AppendRequest],
        projection: str,
        kept: Sequence[KeptState],
        rebuild: datetime,
    ) -> list[AppendResult] | None:
        """Append in the caller's transaction on states this store kept (`StateCache.known`:
        `kept` per request, and the projection's `rebuild` they belong to), in one round trip:
        `mf_append_kept` takes the locks (in the order given: callers sort), confirms under them
        that each stream is at its kept version with the kept checkpoint stored and no rebuild
        since, and only then appends at those versions, folding onto the kept states. None where
        another checkpoint is stored: nothing written, the locks held; the caller opens the
        streams (`open_states`) in the same transaction and decides again."""
        return await self._send_kept(
            conn, requests, await self.encoded(conn, requests), projection, kept, rebuild
        )

    async def _send_kept(
        self,
        conn: asyncpg.Connection,
        requests: Sequence[AppendRequest],
        encoded: Sequence[Sequence[StoredForm]],
        projection: str,
        kept: Sequence[KeptState],
        rebuild: datetime,
    ) -> list[AppendResult] | None:
        requests = [
            msgspec.structs.replace(
                r, expected_version=e.version, prior_states={**r.prior_states, projection: e.state}
            )
            for r, e in zip(requests, kept, strict=True)
        ]
        rows = await self._send(
            conn,
            requests,
            encoded,
            "mf_append_kept",
            (projection, [e.version for e in kept], [e.position for e in kept], rebuild),
        )
        if rows and rows[0]["out_stream_index"] == 0:
            self.states.stale += 1
            return None
        self.states.kept_appends += 1
        for request in requests:
            self.states.used(projection, request.stream_id)
        return await self._recorded(conn, requests, encoded, rows)

    async def append_many(
        self, conn: asyncpg.Connection, requests: Sequence[AppendRequest], *, locked: bool = False
    ) -> list[AppendResult]:
        """Append to several streams in the caller's transaction, in one round trip
        (`mf_append_many`), then fold every stream's events into the inline projections in one
        write per projection. Each stream is checked as `append` checks it; with more than one
        stream, a conflict, tombstone or duplicate raises a plain LedgerError for the whole call
        (the caller's group commit then runs each alone, where the typed error names its stream)."""
        encoded = await self.encoded(conn, requests)
        rows = await self._send(conn, requests, encoded, "mf_append_many", (locked,))
        return await self._recorded(conn, requests, encoded, rows)

    async def encoded(
        self, conn: asyncpg.Connection, requests: Sequence[AppendRequest]
    ) -> list[list[StoredForm]]:
        """Each event as the log stores it, the GPU sets its snapshots name stored first."""
        if any(not r.events for r in requests):
            raise ValueError("append needs at least one event per stream")
        # Each snapshot's GPU set, worked out once for both the store's memory and the encoding.
        sets: list[list[GpuSet | None]] = [
            [gpu_set(e.payload) if isinstance(e.payload, NodeTelemetryObserved) else None for e in r.events]
            for r in requests
        ]
        named = [g for per in sets for g in per if g is not None]
        usable = await self.gpu_sets.usable(conn, named) if named else None
        return [
            [stored_form(e, r.stream_id, usable, gpus=g) for e, g in zip(r.events, per, strict=True)]
            for r, per in zip(requests, sets, strict=True)
        ]

    async def _send(
        self,
        conn: asyncpg.Connection,
        requests: Sequence[AppendRequest],
        encoded: Sequence[Sequence[StoredForm]],
        function: Literal["mf_append_many", "mf_append_kept"],
        extra: tuple[object, ...],
    ) -> list[asyncpg.Record]:
        """One call of an append function (`mf_append_many`, or `mf_append_kept` with the kept
        checkpoints after the events), the store's errors typed."""
        if self.projections and not conn.is_in_transaction():
            # The events and their read-model rows are one unit of work: outside a transaction
            # block each statement commits alone, and the events would be stored without them.
            raise RuntimeError("an append with inline projections runs in the caller's transaction")
        try:
            rows: list[asyncpg.Record] = await conn.fetch(
                _APPEND_SQL[function], *append_arguments(requests, encoded), *extra
            )
        except asyncpg.PostgresError as exc:
            if getattr(exc, "sqlstate", None) == "MF424":
                self.gpu_sets.forget()
                raise GpuSetNotStored(str(exc)) from exc
            if len(requests) == 1:
                translated = _translate(exc, requests[0].stream_id, requests[0].expected_version)
            else:
                translated = LedgerError(f"a batch of {len(requests)} appends failed: {exc}")
            if translated is not None:
                raise translated from exc
            raise
        return rows

    async def _recorded(
        self,
        conn: asyncpg.Connection,
        requests: Sequence[AppendRequest],
        encoded: Sequence[Sequence[StoredForm]],
        rows: Sequence[asyncpg.Record],
    ) -> list[AppendResult]:
        """The appended events as recorded, folded into the inline projections (one write each)."""
        by_stream: list[list[asyncpg.Record]] = [[] for _ in requests]
        for row in rows:
            by_stream[row["out_stream_index"] - 1].append(row)
        results: list[AppendResult | None] = []
        fresh: list[tuple[int, list[RecordedEvent]]] = []
        for i, (request, stream_rows, per) in enumerate(zip(requests, by_stream, encoded, strict=True)):
            if stream_rows and stream_rows[0]["out_already_stored"]:
                results.append(await self._stored(conn, request))
                continue
            recorded = [
                RecordedEvent(
                    global_position=row["out_global_position"],
                    stream_id=request.stream_id,
                    stream_version=row["out_stream_version"],
                    event_id=event.event_id,
                    event_type=event.event_type,
                    event_class=event.event_class,
                    schema_version=SCHEMA_VERSION,
                    # Fold what the log will give back on rebuild (decoded once, by the validation).
                    payload=code.payload,
                    metadata=code.metadata,
                    recorded_at=row["out_recorded_at"],
                )
                for row, event, code in zip(stream_rows, request.events, per, strict=True)
            ]
            results.append(None)
            fresh.append((i, recorded))
        states: list[dict[str, object]] = [{} for _ in fresh]
        for projection in self.projections:
            after = await projection.apply_many(
                conn,
                [
                    (requests[i].stream_id, recorded, requests[i].prior_states.get(projection.name))
                    for i, recorded in fresh
                ],
            )
            for k, state in enumerate(after):
                if state is not None:
                    states[k][projection.name] = state
                    version, position = projection.checkpoint_of(state)
                    self.states.keep(
                        projection.name,
                        requests[fresh[k][0]].stream_id,
                        version,
                        position,
                        projection.persisted(state),
                    )
        for (i, recorded), folded in zip(fresh, states, strict=True):
            results[i] = AppendResult(
                requests[i].stream_id, recorded[-1].stream_version, recorded, False, folded
            )
        return [r for r in results if r is not None]

    async def _stored(self, conn: asyncpg.Connection, request: AppendRequest) -> AppendResult:
        stored = await conn.fetch(_STORED_EVENTS, [e.event_id for e in request.events])
        recorded = [event_from_row(r) for r in stored]
        log.info("append.idempotent", stream_id=request.stream_id, events=len(recorded))
        return AppendResult(request.stream_id, recorded[-1].stream_version, recorded, already_stored=True)

    async def lock_stream(self, conn: asyncpg.Connection, stream_id: str) -> StreamInfo:
        """Serialize work on one stream for the rest of the caller's transaction (other streams
        proceed in parallel) and return where the stream stands (`open_streams` of one)."""
        ((info, _state),) = await self.open_streams(conn, [stream_id], "")
        return info

    async def open_streams(
        self, conn: asyncpg.Connection, stream_ids: Sequence[str], state_of: str
    ) -> list[tuple[StreamInfo, bytes | None]]:
        """Lock `stream_ids` in the order given for the rest of the caller's transaction (callers
        sort them: one lock order for everyone) and say where each stands, with the folded state
        projection `state_of` checkpointed for it (its stored JSON bytes; None before its first event),
        in one round trip (`mf_open_streams`)."""
        rows = await conn.fetch("SELECT * FROM mf_open_streams($1, $2)", list(stream_ids), state_of)
        return [
            (
                StreamInfo(
                    r["out_stream_id"], r["out_version"], r["out_lifecycle_version"], r["out_tombstoned_at"]
                ),
                r["out_state"],
            )
            for r in rows
        ]

    async def open_states(
        self, conn: asyncpg.Connection, stream_ids: Sequence[str], source: StateSource
    ) -> list[tuple[StreamInfo, object]]:
        """`open_streams`, with each stream's folded state as `source` checkpointed it: the state
        this store kept when it wrote that same checkpoint, else decoded from the bytes stored."""
        entries, rebuild = self.states.known(source.name, stream_ids)
        rows = await conn.fetch(
            "SELECT * FROM mf_open_streams($1, $2, $3, $4, $5)",
            list(stream_ids),
            source.name,
            [e.version if e else None for e in entries],
            [e.position if e else None for e in entries],
            rebuild,
        )
        if rows:  # the same for every row: the projection's last rebuild
            self.states.saw_rebuild(source.name, rows[0]["out_rebuild"])
        out: list[tuple[StreamInfo, object]] = []
        for r, entry in zip(rows, entries, strict=True):
            sid = r["out_stream_id"]
            info = StreamInfo(sid, r["out_version"], r["out_lifecycle_version"], r["out_tombstoned_at"])
            if r["out_state"] is None and r["out_state_version"] is not None and entry is not None:
                # The stored checkpoint is the one this entry holds (same version, position and
                # rebuild): PostgreSQL left the state out.
                self.states.used(source.name, sid)
                out.append((info, entry.state))
                continue
            state = source.checkpointed(sid, r["out_state"])
            if r["out_state_version"] is not None:
                self.states.misses += 1
                self.states.keep(source.name, sid, r["out_state_version"], r["out_state_position"], state)
            out.append((info, state))
        return out

    async def read_stream(
        self, stream_id: str, *, after_version: int = 0, conn: asyncpg.Connection | None = None
    ) -> list[RecordedEvent]:
        if conn is None:
            async with self.pool.acquire() as own:
                rows = await own.fetch(_STREAM_EVENTS, stream_id, after_version)
        else:
            rows = await conn.fetch(_STREAM_EVENTS, stream_id, after_version)
        return [event_from_row(r) for r in rows]

    async def read_all(
        self, after: Checkpoint, *, limit: int = 1000, conn: asyncpg.Connection | None = None
    ) -> tuple[list[RecordedEvent], Checkpoint]:
        """The catch-up read for consumers that fold (ledger.reading.read_log, gap-safe): every
        committed event after `after` exactly once. An event the catalog cannot decode stops the
        consumer with UndecodableEvent naming it, rather than being folded past."""
        if conn is None:
            async with self.pool.acquire() as own:
                page = await read_log(own, after, limit=limit)
        else:
            page = await read_log(conn, after, limit=limit)
        events: list[RecordedEvent] = []
        for entry in page.entries:
            if isinstance(entry, StoredEvent):
                raise UndecodableEvent(
                    entry.stream_id, entry.stream_version, entry.global_position, entry.error
                )
            events.append(entry)
        return events, page.resume


def deterministic_event_id(*parts: object) -> uuid.UUID:
    """An idempotency key derived from what makes an event unique (e.g. agent stream + sequence)."""
    return uuid.uuid5(uuid.NAMESPACE_OID, "/".join(str(p) for p in parts))
