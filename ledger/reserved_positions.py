"""Global positions a writer reserves from the log's own sequence before it appends, so that it
can fold its events into the read models first and send the append, the rows and the checkpoints
as one statement (ledger/folded_append.py).

A position handed out here is never handed out again, by this process or by the sequence; one not
used (a failed statement, a process that stops) is a gap, as a rolled-back append's is. The
database refuses a position that is not above its stream's last one (`mf_append_folded`), so a
stream's events keep their positions in the order of their versions however writers interleave;
a writer refused drops what it reserved, and the next reservation lies above every position
handed out before it."""

from __future__ import annotations

import time

import asyncpg

# Positions reserved a time: one round trip per this many folded events. Few, so that what a
# writer holds stays close to the sequence: another writer's append to a stream this one folds
# lands above the whole reservation, and refuses the rest of it for that stream.
RESERVED_AT_ONCE = 128

# How long a reservation is used. A position commits at most this much later than the sequence
# handed it out (plus its statement's time), so a reader that pages the log by position alone
# (the health backtest, `verify`) sees a late one within the same bound as a long transaction's,
# and a quiet server does not hold positions for minutes.
MAX_AGE_SECONDS = 1.0

_RESERVE = "SELECT nextval('events_global_position_seq'::regclass) AS p FROM generate_series(1, $1)"


class ReservedPositions:
    """One process's reserved positions, handed out in ascending order."""

    def __init__(self, at_once: int = RESERVED_AT_ONCE, max_age: float = MAX_AGE_SECONDS) -> None:
        if at_once < 1:
            raise ValueError("at_once must be at least 1")
        self.at_once = at_once
        self.max_age = max_age
        self._free: list[int] = []
        self._since = 0.0
        # Observability: reservations made and dropped.
        self.reservations = 0
        self.dropped = 0

    async def take(self, conn: asyncpg.Connection, n: int, *, above: int = 0) -> list[int]:
        """`n` positions, ascending, each above every position this process took before and above
        `above` (the last position of the streams they are for: what is reserved below it is
        dropped, and a new reservation lies above every position handed out so far); none
        reserved more than `max_age` seconds ago."""
        if self._free and (self._free[0] <= above or time.monotonic() - self._since > self.max_age):
            self.drop()
        if len(self._free) < n:
            if not self._free:
                self._since = time.monotonic()
            rows = await conn.fetch(_RESERVE, max(self.at_once, n))
            self.reservations += 1
            # Two callers may reserve at once: whatever arrives, what is handed out ascends.
            self._free = sorted(self._free + [r["p"] for r in rows])
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def drop(self) -> None:
        """Forget what is reserved (below a stream's last position, refused by the database, or
        reserved too long ago)."""
        if self._free:
            self.dropped += 1
        self._free = []
