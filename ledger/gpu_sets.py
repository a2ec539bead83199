"""The GPU sets compact snapshots of formats 3 and 4 name (table `gpu_sets`, ledger/compact.py).

A snapshot of format 3 or 4 lists each GPU as its index in the set of GPUs it samples, the set
stored once under its digest (`sampled`, which the snapshot's row carries anyway): an eight-GPU node's
report is about 130 bytes smaller than with the UUIDs in every body. A set is written in the
transaction of the first snapshot that names it, and never changed nor removed (the database
refuses both), so a set this store saw committed by another transaction is stored for good: the
store remembers those and writes nothing for them again. One of its own transaction's is used
there but remembered only once another transaction finds it committed (a rollback takes it back
with the snapshot). `mf_append_many` refuses a snapshot whose set is not stored (SQLSTATE MF424:
after a failover that lost a set's commit), and the store then forgets what it remembered.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import asyncpg

from ledger.compact import GpuSet

# The sets sent, which of them the caller's transaction can name (stored now, by it, or by another
# transaction with the same GPUs) and which another transaction committed. A set stored under the
# same digest with other GPUs (an md5 collision) is neither: its snapshots stay format 2.
_STORE = """
WITH sent AS (SELECT * FROM unnest($1::uuid[], $2::text[]) AS s(sampled, gpus)),
added AS (
    INSERT INTO gpu_sets (sampled, gpus) SELECT sampled, gpus FROM sent
    ON CONFLICT (sampled) DO NOTHING
    RETURNING sampled
)
SELECT s.sampled,
       s.sampled IN (SELECT sampled FROM added) OR g.gpus IS NOT DISTINCT FROM s.gpus AS usable,
       g.gpus IS NOT DISTINCT FROM s.gpus
           AND g.tx_id IS DISTINCT FROM pg_current_xact_id_if_assigned() AS committed
FROM sent s LEFT JOIN gpu_sets g USING (sampled)
"""

# Enough for a fleet of 10,000 nodes with a few sets each; a set forgotten is stored again
# (nothing written: it is there) and remembered.
_REMEMBERED = 65_536


class GpuSets:
    """One store's memory of the GPU sets committed in its database."""

    def __init__(self) -> None:
        self._committed: dict[uuid.UUID, None] = {}

    def forget(self) -> None:
        self._committed.clear()

    async def usable(self, conn: asyncpg.Connection, sets: Iterable[GpuSet]) -> set[uuid.UUID]:
        """Of `sets`, the digests of those a snapshot written in `conn`'s transaction may name,
        each set not remembered stored first (one statement for all of them)."""
        committed = self._committed
        out: set[uuid.UUID] = set()
        pending: dict[uuid.UUID, str] = {}
        for s in sets:
            if not s.storable:
                continue
            if s.sampled in committed:
                out.add(s.sampled)
            else:
                pending[s.sampled] = s.joined
        if not pending:
            return out
        rows = await conn.fetch(_STORE, list(pending), list(pending.values()))
        for row in rows:
            if row["usable"]:
                out.add(row["sampled"])
            if row["committed"]:
                if len(committed) >= _REMEMBERED:
                    committed.clear()
                committed[row["sampled"]] = None
        return out


# Process-wide: a set's GPUs are fixed by its digest (the table's check holds md5(gpus) =
# sampled), whichever database holds it.
_NAMED: dict[uuid.UUID, str] = {}


async def stored_sets(conn: asyncpg.Connection, sampled: Iterable[uuid.UUID | None]) -> dict[uuid.UUID, str]:
    """The stored GPU sets (`gpu_sets.gpus`) of the digests given; one missing is left out (its
    snapshots are then refused as undecodable)."""
    wanted = {s for s in sampled if s is not None}
    missing = [s for s in wanted if s not in _NAMED]
    if missing:
        if len(_NAMED) + len(missing) > _REMEMBERED:
            _NAMED.clear()
        for row in await conn.fetch(
            "SELECT sampled, gpus FROM gpu_sets WHERE sampled = ANY($1::uuid[])", missing
        ):
            _NAMED[row["sampled"]] = row["gpus"]
    return {s: _NAMED[s] for s in wanted if s in _NAMED}
