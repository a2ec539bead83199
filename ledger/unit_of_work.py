"""One command on one stream, as one unit of work.

Every write above the ledger (a local refresh, an agent report, an enrollment, a credential
revocation, a work lease, a decommission) is the same transaction:

    lock the stream once (`mf_open_streams`: the rebuild gate shared + the stream's advisory lock)
    -> know its version and whether it is tombstoned
    -> and its current folded state (the owning projection's checkpoint), in the same round trip
       (the store's own copy when it wrote that very checkpoint: `ledger.state_cache.StateCache`)
    -> hand that state to a pure decision, which returns the events
    -> append them at the known version (`mf_append_many`, told the lock is held)
    -> the inline projections fold them once, in the same transaction
    -> the new state comes back from that fold (nothing folds twice, nothing decodes twice).

Several units of a group commit's batch (ledger/group_commit.py) open their streams together
(`UnitOfWork.open_many`: one round trip, locks in sorted order) and append together
(`UnitOfWork.append_many`: one append call, one write per projection); each still decides alone
on its own stream's state.

Where the store kept every stream's state (`UnitOfWork.kept`), a batch may decide on those copies
before sending anything and append with `append_kept`: one round trip that takes the locks and
confirms under them that each kept checkpoint is the one stored, else writes nothing and answers
None, and the caller opens the streams with `open_many` in the same transaction and decides again.
Or, outside a transaction block, with `append_folded`: the same confirmation, the events folded
before they are sent and the read models' rows written by the same statement
(ledger/folded_append.py), or nothing written and the caller goes the transaction's way.

The ledger knows read models only through the `StateOwner` protocol, so this module does not
import `projections`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Generic, Protocol, TypeVar

import asyncpg
import msgspec

from ledger.events import NewEvent, RecordedEvent
from ledger.folded_append import NotFolded, PartBuilder, append_folded
from ledger.state_cache import KeptState
from ledger.store import AppendRequest, AppendResult, EventStore, StreamInfo, StreamTombstoned

S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)


class StateOwner(Protocol[S_co]):
    """The inline projection whose folded state the decisions of a stream read."""

    @property
    def name(self) -> str: ...

    @property
    def state_type(self) -> type[S_co]: ...

    def initial(self, stream_id: str) -> S_co: ...

    def checkpointed(self, stream_id: str, stored: bytes | None) -> S_co | None:
        """The state from its checkpoint's bytes (None: no checkpoint, the initial state)."""
        ...


class Committed(msgspec.Struct, Generic[S], frozen=True):
    """What one append of a unit did: the recorded events and the stream's state after them."""

    events: list[RecordedEvent]
    state: S
    stream_version: int
    already_stored: bool = False


class OpenStream(Generic[S]):
    """A stream locked for the rest of the transaction, with its version and folded state."""

    def __init__(
        self, store: EventStore, owner: StateOwner[S], conn: asyncpg.Connection, info: StreamInfo, state: S
    ) -> None:
        self.store = store
        self.owner = owner
        self.conn = conn
        self.info = info
        self.state = state

    @property
    def stream_id(self) -> str:
        return self.info.stream_id

    @property
    def version(self) -> int:
        return self.info.version

    def request(self, events: Sequence[NewEvent]) -> AppendRequest:
        """What appending `events` at the version this unit knows asks of the store."""
        return AppendRequest(self.stream_id, self.info.version, events, {self.owner.name: self.state})

    async def append(self, events: Sequence[NewEvent]) -> Committed[S]:
        """Append at the version this unit knows; the lock is held, so it cannot have moved."""
        if not events:
            return Committed(events=[], state=self.state, stream_version=self.info.version)
        (result,) = await self.store.append_many(self.conn, [self.request(events)], locked=True)
        return self.committed(result)

    def committed(self, result: AppendResult) -> Committed[S]:
        """Take the store's result of this unit's append as the unit's new state and version."""
        after = result.states.get(self.owner.name)
        state_type = self.owner.state_type
        # An already-stored batch is folded into the state this unit loaded; nothing to refold.
        new_state = after if isinstance(after, state_type) else self.state
        self.state = new_state
        self.info = msgspec.structs.replace(self.info, version=result.stream_version)
        return Committed(
            events=result.events,
            state=new_state,
            stream_version=result.stream_version,
            already_stored=result.already_stored,
        )

    async def decide(self, decision: Callable[[S], Sequence[NewEvent]]) -> Committed[S]:
        """Hand the current state to a pure decision and append what it returns."""
        return await self.append(decision(self.state))


class KeptStreams(Generic[S]):
    """The states the store kept of a batch's streams (sorted ids), for a decision made before
    anything is sent (`UnitOfWork.kept`); `append_kept` confirms them under the locks."""

    def __init__(
        self, stream_ids: list[str], kept: list[KeptState], rebuild: datetime, states: dict[str, S]
    ) -> None:
        self.stream_ids = stream_ids
        self.kept = kept
        self.rebuild = rebuild
        self.states = states


class UnitOfWork(Generic[S]):
    """Opens streams whose state `owner` folds: `async with uow.open(stream_id) as stream`."""

    def __init__(self, store: EventStore, owner: StateOwner[S]) -> None:
        self.store = store
        self.owner = owner

    @asynccontextmanager
    async def open(
        self, stream_id: str, *, conn: asyncpg.Connection | None = None
    ) -> AsyncIterator[OpenStream[S]]:
        """Lock `stream_id` and load its state. With `conn` the unit joins the caller's
        transaction (a caller that locks two streams takes them in its own fixed order); without,
        it runs in a transaction of its own, committed when the block ends without an error.
        Raises StreamTombstoned (nothing locked beyond the transaction) for a tombstoned stream."""
        if conn is None:
            async with self.store.pool.acquire() as own, own.transaction():
                yield await self._lock(own, stream_id)
        else:
            yield await self._lock(conn, stream_id)

    async def _lock(self, conn: asyncpg.Connection, stream_id: str) -> OpenStream[S]:
        (opened,) = (await self.open_many(conn, [stream_id])).values()
        if isinstance(opened, StreamTombstoned):
            raise opened
        return opened

    async def open_many(
        self, conn: asyncpg.Connection, stream_ids: Sequence[str]
    ) -> dict[str, OpenStream[S] | StreamTombstoned]:
        """Lock several streams in the caller's transaction (in sorted order, as every batch does)
        and load each one's state: an open stream per id, or the StreamTombstoned a unit on that
        stream would raise."""
        out: dict[str, OpenStream[S] | StreamTombstoned] = {}
        state_type = self.owner.state_type
        for info, loaded in await self.store.open_states(conn, sorted(set(stream_ids)), self.owner):
            sid = info.stream_id
            if info.tombstoned_at is not None:
                out[sid] = StreamTombstoned(
                    sid, f"stream {sid} is tombstoned and takes no more events", info.tombstoned_at
                )
                continue
            state = loaded if isinstance(loaded, state_type) else self.owner.initial(sid)
            out[sid] = OpenStream(self.store, self.owner, conn, info, state)
        return out

    async def append_many(
        self, conn: asyncpg.Connection, appends: Sequence[tuple[OpenStream[S], Sequence[NewEvent]]]
    ) -> list[Committed[S]]:
        """Append each open stream's events at the version it knows (one stream once), in one
        call; their committed states in the same order."""
        requests = [stream.request(events) for stream, events in appends if events]
        results = iter(await self.store.append_many(conn, requests, locked=True) if requests else [])
        return [
            stream.committed(next(results))
            if events
            else Committed(events=[], state=stream.state, stream_version=stream.version)
            for stream, events in appends
        ]

    def kept(self, stream_ids: Sequence[str]) -> KeptStreams[S] | None:
        """The states the store kept of every one of these streams, or None where it kept not all
        of them. Only a guess until `append_kept` confirms it under the streams' locks."""
        ids = sorted(set(stream_ids))
        found = self.store.states.all_kept(self.owner.name, ids)
        if found is None:
            return None
        kept, rebuild = found
        states: dict[str, S] = {}
        for sid, entry in zip(ids, kept, strict=True):
            if not isinstance(entry.state, self.owner.state_type):
                return None
            states[sid] = entry.state
        return KeptStreams(ids, kept, rebuild, states)

    async def append_kept(
        self, conn: asyncpg.Connection, kept: KeptStreams[S], events: Sequence[Sequence[NewEvent]]
    ) -> list[Committed[S]] | None:
        """Append each kept stream's events (in `kept.stream_ids` order, at least one each) at its
        kept version, in one round trip, in the caller's transaction: the committed states, or
        None where another checkpoint is stored than the one kept (nothing written, the locks
        held: open the streams with `open_many` in the same transaction and decide again)."""
        requests = [
            AppendRequest(sid, entry.version, evs, {self.owner.name: entry.state})
            for sid, entry, evs in zip(kept.stream_ids, kept.kept, events, strict=True)
        ]
        results = await self.store.append_kept(conn, requests, self.owner.name, kept.kept, kept.rebuild)
        return None if results is None else self._committed(kept, results)

    def _committed(self, kept: KeptStreams[S], results: Sequence[AppendResult]) -> list[Committed[S]]:
        out: list[Committed[S]] = []
        for sid, result in zip(kept.stream_ids, results, strict=True):
            after = result.states.get(self.owner.name)
            state = after if isinstance(after, self.owner.state_type) else kept.states[sid]
            out.append(Committed(result.events, state, result.stream_version, result.already_stored))
        return out

    async def append_folded(
        self,
        conn: asyncpg.Connection,
        kept: KeptStreams[S],
        events: Sequence[Sequence[NewEvent]],
        part: PartBuilder | None = None,
    ) -> tuple[list[Committed[S]], object] | NotFolded:
        """`append_kept` as one statement outside a transaction block, the caller's `part` in it
        (ledger/folded_append.py): the committed states and the part's answer, or NotFolded where
        nothing was written (the caller appends the usual way, in a transaction)."""
        requests = [
            AppendRequest(sid, entry.version, evs, {self.owner.name: entry.state})
            for sid, entry, evs in zip(kept.stream_ids, kept.kept, events, strict=True)
        ]
        done = await append_folded(self.store, conn, requests, self.owner.name, kept.kept, kept.rebuild, part)
        if isinstance(done, NotFolded):
            return done
        return self._committed(kept, done.results), done.answer
