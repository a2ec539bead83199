"""One command on one stream, as one unit of work.

Every write above the ledger (a local refresh, an agent report, an enrollment, a credential
revocation, a work lease, a decommission) is the same transaction:

    lock the stream once (`mf_open_stream`: the rebuild gate shared + the stream's advisory lock)
    -> know its version and whether it is tombstoned
    -> and its current folded state (the owning projection's checkpoint), in the same round trip
    -> hand that state to a pure decision, which returns the events
    -> append them at the known version (`mf_append`, told the lock is held)
    -> the inline projections fold them once, in the same transaction
    -> the new state comes back from that fold (nothing folds twice, nothing decodes twice).

The ledger knows read models only through the `StateOwner` protocol, so this module does not
import `projections`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Generic, Protocol, TypeVar

import asyncpg
import msgspec

from ledger.events import NewEvent, RecordedEvent
from ledger.store import EventStore, StreamInfo, StreamTombstoned

S = TypeVar("S")
S_co = TypeVar("S_co", covariant=True)


class StateOwner(Protocol[S_co]):
    """The inline projection whose folded state the decisions of a stream read."""

    @property
    def name(self) -> str: ...

    @property
    def state_type(self) -> type[S_co]: ...

    def initial(self, stream_id: str) -> S_co: ...

    def decode_state(self, raw: str | bytes) -> S_co: ...


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

    async def append(self, events: Sequence[NewEvent]) -> Committed[S]:
        """Append at the version this unit knows; the lock is held, so it cannot have moved."""
        if not events:
            return Committed(events=[], state=self.state, stream_version=self.info.version)
        result = await self.store.append(
            self.stream_id,
            self.info.version,
            events,
            conn=self.conn,
            locked=True,
            prior_states={self.owner.name: self.state},
        )
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
        info, raw = await self.store.open_stream(conn, stream_id, self.owner.name)
        if info.tombstoned_at is not None:
            raise StreamTombstoned(
                stream_id, f"stream {stream_id} is tombstoned and takes no more events", info.tombstoned_at
            )
        state = self.owner.initial(stream_id) if raw is None else self.owner.decode_state(raw)
        return OpenStream(self.store, self.owner, conn, info, state)
