"""What the event store asks of a read model it keeps current inside each append (the
projections implement it; the ledger does not import them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import asyncpg

from ledger.events import RecordedEvent


class InlineProjection(Protocol):
    """A read model the store keeps current inside each append's transaction."""

    name: str

    async def apply(
        self,
        conn: asyncpg.Connection,
        stream_id: str,
        events: Sequence[RecordedEvent],
        prior: object = None,
    ) -> object:
        """Fold `events` into the read model and return the stream's new folded state (None when
        the projection does not handle the stream). `prior`: the stream's folded state as the
        caller already loaded it under the stream lock (saves reading it twice), else None."""
        ...

    async def apply_many(
        self, conn: asyncpg.Connection, appended: Sequence[tuple[str, Sequence[RecordedEvent], object]]
    ) -> list[object]:
        """`apply` for several streams at once, `(stream_id, events, prior)` each, in one write;
        the new states in the same order."""
        ...

    def checkpointed(self, stream_id: str, stored: bytes | None) -> object:
        """The stream's folded state from its checkpoint's bytes as `mf_open_streams` returns them
        (None: no checkpoint yet), or None for a stream this projection does not handle."""
        ...

    def persisted(self, state: Any) -> object:
        """The state as its checkpoint stores it (what `checkpointed` gives back from the bytes)."""
        ...

    def checkpoint_of(self, state: Any) -> tuple[int, int]:
        """(stream version, global position) the state has folded up to."""
        ...

    def handles(self, stream_id: str) -> bool:
        """Whether this read model folds `stream_id` at all."""
        ...

    def fold_many(
        self, appended: Sequence[tuple[str, Sequence[RecordedEvent], object]]
    ) -> tuple[list[Any], list[tuple[str, Any, Any]]]:
        """Each stream's events folded onto its prior state, without I/O: the new states (None
        for a stream it does not handle) and the changes to write."""
        ...

    def row_changes(self, changes: Sequence[tuple[str, Any, Any]]) -> RowWrites:
        """What writing these changes sends (pure)."""
        ...

    def changes_statement(
        self, written: Any, *, base: int, gate: str, prefix: str
    ) -> tuple[tuple[str, ...], str]:
        """`written` as data-modifying CTEs of a larger statement, their arguments (the
        projection's name, then `written.args`) numbered from `base` + 1, writing only where
        `gate` holds; with the SQL expression counting the stored rows they found."""
        ...


class RowWrites(Protocol):
    """A projection's writes of a batch, as one statement sends them."""

    @property
    def args(self) -> list[object]: ...

    @property
    def expected(self) -> int:
        """How many stored rows and checkpoints the writes must find."""
        ...

    @property
    def persisted(self) -> list[Any]:
        """Each folded state as its checkpoint stores it, in the order of the changes."""
        ...


class StateSource(Protocol):
    """Where the folded states `EventStore.open_states` hands out come from: a projection."""

    @property
    def name(self) -> str: ...

    def checkpointed(self, stream_id: str, stored: bytes | None) -> object: ...
