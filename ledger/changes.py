"""Which streams changed since a probe: the read models' invalidation signal.

The read models are written only inside the transactions that append events (inline projections)
and by `rebuild`'s swap. So "which streams' read-model rows may differ from what I saw at my last
probe" is "which streams got events from a transaction my last probe could not see", plus "was
anything rebuilt". A probe records its snapshot's `xmax` (every transaction id from there on was
not visible to it) and its in-progress list (`xip`); the next probe asks for the streams of events
whose `tx_id` is at least that `xmax` or in that list: every transaction that committed since is
one of the two, whatever order the commits came in, however long one ran (no position horizon:
a long transaction does not hold the answer back, it is simply reported when it commits).

Invalidation tolerates extra streams (a retention pass that moves kept observations to the
permanent segment reports their streams again), never missing ones; `read_log` stays the one
reader that delivers events.
"""

from __future__ import annotations

from datetime import datetime

import asyncpg
import msgspec

from ledger.reading import MAX_TX_ID


class ChangeMark(msgspec.Struct, frozen=True):
    """What a probe's snapshot could not see: transactions from `xmax` on and those `in_progress`."""

    xmax: int
    in_progress: tuple[int, ...]


class Changes(msgspec.Struct, frozen=True):
    mark: ChangeMark
    # Streams that got events since the previous mark (empty for a first probe).
    streams: frozenset[str]
    # False when more transactions' events came than one probe reads (`limit`): `streams` is then
    # only part of them, and the caller must treat every stream as changed.
    complete: bool
    # When the read models were last swapped in by `rebuild` (None: never).
    rebuilt_at: datetime | None


DEFAULT_LIMIT = 10_000
_FIRST = MAX_TX_ID  # a first probe only takes a mark: no event has a transaction id this high


async def read_changes(
    conn: asyncpg.Connection, since: ChangeMark | None, *, limit: int = DEFAULT_LIMIT
) -> Changes:
    """The streams changed since `since` (None: a first probe, which only takes a mark), and the
    mark to ask from next time. Run it outside an explicit transaction (or first in one) so its
    snapshot is taken when it runs. Reads at most `limit` events of transactions begun since."""
    # One statement (ledger/sql/functions/mf_read_changes.sql), so the snapshot it reports is the
    # one its reads see.
    row = await conn.fetchrow(
        "SELECT out_xmax, out_in_progress, out_recent, out_streams, out_rebuilt_at "
        "FROM mf_read_changes($1, $2, $3)",
        _FIRST if since is None else since.xmax,
        [] if since is None else list(since.in_progress),
        limit,
    )
    assert row is not None
    return Changes(
        mark=ChangeMark(xmax=row["out_xmax"], in_progress=tuple(sorted(row["out_in_progress"]))),
        streams=frozenset(row["out_streams"]),
        complete=row["out_recent"] <= limit,
        rebuilt_at=row["out_rebuilt_at"],
    )
