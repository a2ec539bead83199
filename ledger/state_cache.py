"""The folded states an event store keeps after writing them, so that the next append of a stream
neither fetches nor decodes its state (`state_cache_streams` streams per projection; 0 keeps none).

The store tells `mf_open_streams` / `mf_append_kept` the checkpoint it holds for each stream, and
PostgreSQL sends a state only where the stored checkpoint is another one. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime

import msgspec

from runtime.settings import default

# Folded states kept per store and projection (the server's `state_cache_streams`).
STATE_CACHE_STREAMS: int = default("state_cache_streams")


class KeptState(msgspec.Struct, frozen=True):
    """A folded state this store wrote (or was sent), at its checkpoint (stream version, position)."""

    version: int
    position: int
    state: object


class StateCache:
    """The folded states this process last wrote, by projection and stream, with the checkpoint
    each is (stream version, position) and the projection's rebuild it belongs to. `mf_open_streams`
    sends a state only when the stored checkpoint is another one: another server wrote the stream
    since, a transaction of ours that wrote it rolled back, or a rebuild rewrote every state. So a
    kept state is only ever used where it equals the stored one, and dropping any is always
    safe. Least recently used first out: a fleet larger than the cache cycles through it and
    gains nothing, at no cost beyond the memory (docs/capacity.md)."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self._kept: dict[str, OrderedDict[str, KeptState]] = {}
        self._rebuild: dict[str, datetime] = {}
        self.hits = 0
        self.misses = 0
        # Appends in one round trip on kept states (`EventStore._append_kept`), and those that
        # found another checkpoint stored than the one kept (then opened as usual).
        self.kept_appends = 0
        # Of those, the ones whose events were folded before they were sent (ledger/folded_append.py).
        self.folded_appends = 0
        # Folded appends the database refused as decided on something not current.
        self.folded_refused = 0
        self.stale = 0

    def known(
        self, projection: str, stream_ids: Sequence[str]
    ) -> tuple[list[KeptState | None], datetime | None]:
        """What is kept of these streams, and the rebuild it belongs to (taken together: another
        caller may keep, drop or evict entries while the caller waits for PostgreSQL)."""
        kept = self._kept.get(projection)
        entries: list[KeptState | None] = [kept.get(sid) if kept else None for sid in stream_ids]
        return entries, self._rebuild.get(projection)

    def all_kept(self, projection: str, stream_ids: Sequence[str]) -> tuple[list[KeptState], datetime] | None:
        """`known`, where every one of these streams is kept and their rebuild known; else None."""
        entries, rebuild = self.known(projection, stream_ids)
        held = [e for e in entries if e is not None]
        if rebuild is None or len(held) != len(entries):
            return None
        return held, rebuild

    def used(self, projection: str, stream_id: str) -> None:
        kept = self._kept.get(projection)
        if kept is not None and stream_id in kept:
            kept.move_to_end(stream_id)
        self.hits += 1

    def saw_rebuild(self, projection: str, rebuild: datetime) -> None:
        if self._rebuild.get(projection) != rebuild:
            self._kept.pop(projection, None)  # every state was written anew
            self._rebuild[projection] = rebuild

    def keep(self, projection: str, stream_id: str, version: int, position: int, state: object) -> None:
        if self.streams <= 0:
            return
        kept = self._kept.setdefault(projection, OrderedDict())
        kept[stream_id] = KeptState(version, position, state)
        kept.move_to_end(stream_id)
        while len(kept) > self.streams:
            kept.popitem(last=False)
