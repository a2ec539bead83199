"""Rebuild every projection from the log into shadow tables, then verify or swap them in.

1. Shadow tables are created beside the live ones (`<table>__shadow`, same definition).
2. Bulk phase, in one REPEATABLE READ snapshot: walk the log stream by stream in
   (stream_id, stream_version) order, fold each stream with the projection's own fold, and COPY
   the final rows into the shadows. Appends and API reads go on meanwhile.
3. Catch-up phase: take the rebuild gate exclusively (every append holds it shared, so this waits
   for in-flight appends and holds new ones for a moment), fold whatever each stream gained since
   the snapshot, then either compare shadows with live row for row (`--verify`) or swap them in
   with renames, all in that one short transaction.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import asyncpg
import msgspec
import structlog

from ledger.reading import EVENT_COLUMNS, UndecodableEvent, event_from_row
from ledger.store import REBUILD_GATE_KEY
from projections.framework import STATE_TABLE, Projection, TableSpec

log = structlog.get_logger(__name__)

SHADOW = "__shadow"
_REBUILD_LOCK_KEY = 7305820113
_BATCH = 5000

Progress = Callable[[int, int, float], None]  # done, total, events per second


class TableDifference(msgspec.Struct, frozen=True):
    table: str
    only_live: list[str]
    only_rebuilt: list[str]
    only_live_count: int
    only_rebuilt_count: int


class RebuildReport(msgspec.Struct, frozen=True):
    events: int
    streams: int
    seconds: float
    verified: bool
    differences: list[TableDifference]
    swapped: bool

    @property
    def events_per_second(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else 0.0


_STATE_SPEC = TableSpec(
    name=STATE_TABLE,
    columns=("projection", "stream_id", "stream_version", "position", "state"),
    key=("projection", "stream_id"),
)


def _all_tables(projections: Sequence[Projection[Any]]) -> list[str]:
    names = [STATE_TABLE]
    for p in projections:
        names.extend(t.name for t in p.tables)
    return names


async def _create_shadows(conn: asyncpg.Connection, tables: Sequence[str]) -> None:
    async with conn.transaction():
        for t in tables:
            await conn.execute(f"DROP TABLE IF EXISTS {t}{SHADOW}")
            await conn.execute(f"CREATE TABLE {t}{SHADOW} (LIKE {t} INCLUDING ALL)")
            # LIKE copies columns, storage and indexes but not the table's storage parameters
            # (schema.sql's fillfactor for the rows every report rewrites): the swap must not lose them.
            options = await conn.fetchval("SELECT reloptions FROM pg_class WHERE oid = $1::regclass", t)
            if options:
                await conn.execute(f"ALTER TABLE {t}{SHADOW} SET ({', '.join(options)})")


async def _drop_shadows(conn: asyncpg.Connection, tables: Sequence[str]) -> None:
    for t in tables:
        await conn.execute(f"DROP TABLE IF EXISTS {t}{SHADOW}")


class _Writer:
    """Buffers rows per shadow table and COPYs them in batches."""

    def __init__(self, conn: asyncpg.Connection, projections: Sequence[Projection[Any]]) -> None:
        self.conn = conn
        self.specs = {t.name: t for p in projections for t in p.tables}
        self.specs[STATE_TABLE] = _STATE_SPEC
        self.buffers: dict[str, list[tuple[Any, ...]]] = {name: [] for name in self.specs}

    async def add_stream(self, projection: Projection[Any], stream_id: str, state: Any) -> None:
        if not projection.handles(stream_id):
            return
        for table, rows in projection.rows(state).items():
            self.buffers[table].extend(rows)
        version, position = projection.checkpoint_of(state)
        self.buffers[STATE_TABLE].append(
            (
                projection.name,
                stream_id,
                version,
                position,
                projection.encode_state(state),
            )
        )
        if len(self.buffers[STATE_TABLE]) >= 500:
            await self.flush()

    async def flush(self) -> None:
        for table, rows in self.buffers.items():
            if rows:
                await self.conn.copy_records_to_table(
                    table + SHADOW, records=rows, columns=list(self.specs[table].columns)
                )
                rows.clear()


_SCAN = (
    f"SELECT {EVENT_COLUMNS} FROM events WHERE (events.stream_id, events.stream_version) > ($1, $2) "
    "ORDER BY events.stream_id, events.stream_version LIMIT $3"
)


async def _bulk(
    pool: asyncpg.Pool, projections: Sequence[Projection[Any]], progress: Progress | None
) -> tuple[int, int]:
    """Fold the whole log (as of one snapshot) into the shadows. Returns (events, streams)."""
    done = streams = 0
    started = time.perf_counter()
    async with pool.acquire() as read, pool.acquire() as write:
        async with read.transaction(isolation="repeatable_read", readonly=True):
            total = await read.fetchval("SELECT count(*) FROM events")
            writer = _Writer(write, projections)
            async with write.transaction():
                current: str | None = None
                folding: list[Projection[Any]] = []
                states: list[Any] = []

                def fetch(after: tuple[str, int]) -> asyncio.Task[list[asyncpg.Record]]:
                    query: Coroutine[Any, Any, list[asyncpg.Record]] = read.fetch(
                        _SCAN, after[0], after[1], _BATCH
                    )
                    return asyncio.ensure_future(query)

                # The next batch is read while this one is folded: the server scans while Python
                # decodes and folds, instead of each waiting for the other.
                pending = fetch(("", 0))
                try:
                    while True:
                        rows = await pending
                        if not rows:
                            break
                        pending = fetch((rows[-1]["stream_id"], rows[-1]["stream_version"]))
                        await asyncio.sleep(0)  # let the prefetch go out before the CPU-bound fold
                        for row in rows:
                            event = event_from_row(row)
                            if event.stream_id != current:
                                if current is not None:
                                    for p, st in zip(folding, states, strict=True):
                                        await writer.add_stream(p, current, st)
                                    streams += 1
                                current = event.stream_id
                                # Only the projections that handle this stream fold it (handles()).
                                folding = [p for p in projections if p.handles(current)]
                                states = [p.initial(current) for p in folding]
                            states = [p.fold(st, event) for p, st in zip(folding, states, strict=True)]
                        done += len(rows)
                        if progress is not None:
                            elapsed = time.perf_counter() - started
                            progress(done, max(total, done), done / elapsed if elapsed else 0.0)
                finally:
                    # A fold that raised (an undecodable event) must not leave the prefetch in
                    # flight: leaving the read transaction then breaks its connection, and the
                    # operator would see a connection error instead of the event's name.
                    if not pending.done():
                        await asyncio.gather(pending, return_exceptions=True)
                if current is not None:
                    for p, st in zip(folding, states, strict=True):
                        await writer.add_stream(p, current, st)
                    streams += 1
                await writer.flush()
    return done, streams


async def _catch_up(conn: asyncpg.Connection, projections: Sequence[Projection[Any]]) -> int:
    """Under the gate: fold what each stream gained since the bulk snapshot into the shadows."""
    caught = 0
    for p in projections:
        behind = await conn.fetch(
            f"SELECT s.stream_id, coalesce(ps.stream_version, 0) AS folded FROM streams s "
            f"LEFT JOIN {STATE_TABLE}{SHADOW} ps ON ps.projection = $1 AND ps.stream_id = s.stream_id "
            "WHERE s.version > coalesce(ps.stream_version, 0)",
            p.name,
        )
        for row in behind:
            if not p.handles(row["stream_id"]):
                continue
            events = [
                event_from_row(r)
                for r in await conn.fetch(
                    f"SELECT {EVENT_COLUMNS} FROM events WHERE events.stream_id = $1 "
                    "AND events.stream_version > $2 ORDER BY events.stream_version",
                    row["stream_id"],
                    row["folded"],
                )
            ]
            if not events:
                continue
            before = await p.load_state(conn, row["stream_id"], suffix=SHADOW)
            after = p.fold_all(before, events)
            await p.write_changes(conn, row["stream_id"], before, after, suffix=SHADOW)
            caught += len(events)
    return caught


async def _index_names(conn: asyncpg.Connection, table: str) -> dict[str, str]:
    """Index name by its definition with the table name taken out."""
    rows = await conn.fetch(
        "SELECT c.relname AS name, pg_get_indexdef(i.indexrelid) AS def FROM pg_index i "
        "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = $1::regclass",
        table,
    )
    return {r["def"].split(" ON ", 1)[1].replace(f"{table} ", "", 1): r["name"] for r in rows}


async def _swap(conn: asyncpg.Connection, table: str) -> None:
    """Swap the shadow in by renames, and give its indexes the live names back (so migrations
    that name indexes keep finding them)."""
    live = await _index_names(conn, f"public.{table}")
    shadow = await _index_names(conn, f"public.{table}{SHADOW}")
    await conn.execute(f"ALTER TABLE {table} RENAME TO {table}__old")
    await conn.execute(f"ALTER TABLE {table}{SHADOW} RENAME TO {table}")
    await conn.execute(f"DROP TABLE {table}__old")
    for definition, name in shadow.items():
        wanted = live.get(definition)
        if wanted and wanted != name:
            await conn.execute(f'ALTER INDEX "{name}" RENAME TO "{wanted}"')


def _state_json(projection: Projection[Any] | None, raw: bytes) -> Any:
    """A checkpoint as a difference shows it: its state, or its bytes in hex when undecodable."""
    try:
        return msgspec.to_builtins(projection.decode_state(raw)) if projection else raw.hex()
    except (ValueError, msgspec.DecodeError):
        return raw.hex()


async def _compare_states(
    conn: asyncpg.Connection, projections: Sequence[Projection[Any]], limit: int
) -> TableDifference | None:
    """The folded states compare by value: checkpoints whose bytes differ are decoded and
    compared as states, since the same state may be stored in either of its encodings (a JSON
    checkpoint written before the binary one, or converted from the jsonb column of schema
    version 4)."""
    by_name = {p.name: p for p in projections}
    only_live: list[str] = []
    only_rebuilt: list[str] = []
    n_live = n_rebuilt = 0
    cursor = conn.cursor(
        f"SELECT projection, stream_id, l.stream_version AS live_version, l.position AS live_position, "
        f"l.state AS live_state, r.stream_version AS rebuilt_version, r.position AS rebuilt_position, "
        f"r.state AS rebuilt_state FROM {STATE_TABLE} l FULL JOIN {STATE_TABLE}{SHADOW} r "
        "USING (projection, stream_id) WHERE (l.stream_version, l.position, l.state) "
        "IS DISTINCT FROM (r.stream_version, r.position, r.state)",
        prefetch=200,
    )
    async for row in cursor:
        projection = by_name.get(row["projection"])
        sides = {
            side: None
            if row[f"{side}_state"] is None
            else (
                row[f"{side}_version"],
                row[f"{side}_position"],
                _state_json(projection, row[f"{side}_state"]),
            )
            for side in ("live", "rebuilt")
        }
        if sides["live"] is not None and sides["live"] == sides["rebuilt"]:
            continue
        for side, out in (("live", only_live), ("rebuilt", only_rebuilt)):
            kept = sides[side]
            if kept is None:
                continue
            if side == "live":
                n_live += 1
            else:
                n_rebuilt += 1
            if len(out) < limit:
                version, position, state = kept
                out.append(
                    msgspec.json.encode(
                        {
                            "projection": row["projection"],
                            "stream_id": row["stream_id"],
                            "stream_version": version,
                            "position": position,
                            "state": state,
                        }
                    ).decode()
                )
    if not (n_live or n_rebuilt):
        return None
    return TableDifference(
        table=STATE_TABLE,
        only_live=only_live,
        only_rebuilt=only_rebuilt,
        only_live_count=n_live,
        only_rebuilt_count=n_rebuilt,
    )


async def compare(
    conn: asyncpg.Connection,
    tables: Sequence[str],
    projections: Sequence[Projection[Any]] = (),
    *,
    limit: int = 20,
) -> list[TableDifference]:
    """Row-for-row comparison of each live table with its shadow (jsonb compares by value, and so
    do the folded states of `projections`, decoded: `_compare_states`). Runs in a transaction
    (the states are read through a cursor)."""
    diffs: list[TableDifference] = []
    for t in tables:
        if t == STATE_TABLE:
            state_diff = await _compare_states(conn, projections, limit)
            if state_diff is not None:
                diffs.append(state_diff)
            continue
        live, rebuilt = f"SELECT * FROM {t}", f"SELECT * FROM {t}{SHADOW}"
        only_live = await conn.fetch(
            f"SELECT row_to_json(x)::text AS r FROM ({live} EXCEPT ALL {rebuilt}) x LIMIT $1", limit
        )
        only_rebuilt = await conn.fetch(
            f"SELECT row_to_json(x)::text AS r FROM ({rebuilt} EXCEPT ALL {live}) x LIMIT $1", limit
        )
        if only_live or only_rebuilt:
            n_live = await conn.fetchval(f"SELECT count(*) FROM ({live} EXCEPT ALL {rebuilt}) x")
            n_rebuilt = await conn.fetchval(f"SELECT count(*) FROM ({rebuilt} EXCEPT ALL {live}) x")
            diffs.append(
                TableDifference(
                    table=t,
                    only_live=[r["r"] for r in only_live],
                    only_rebuilt=[r["r"] for r in only_rebuilt],
                    only_live_count=n_live,
                    only_rebuilt_count=n_rebuilt,
                )
            )
    return diffs


async def rebuild(
    pool: asyncpg.Pool,
    projections: Sequence[Projection[Any]],
    *,
    verify: bool = False,
    progress: Progress | None = None,
) -> RebuildReport:
    """Rebuild (or, with `verify`, rebuild and compare without swapping) every projection."""
    tables = _all_tables(projections)
    started = time.perf_counter()
    async with pool.acquire() as control:
        # One rebuild at a time; a second waits rather than fighting over the shadows.
        await control.execute("SELECT pg_advisory_lock($1)", _REBUILD_LOCK_KEY)
        try:
            await _create_shadows(control, tables)
            try:
                events, streams = await _bulk(pool, projections, progress)
                async with control.transaction():
                    await control.execute("SELECT pg_advisory_xact_lock($1)", REBUILD_GATE_KEY)
                    events += await _catch_up(control, projections)
                    differences = await compare(control, tables, projections) if verify else []
                    swapped = False
                    if not verify:
                        for t in tables:
                            await _swap(control, t)
                        horizon = await control.fetchrow(
                            "SELECT pg_snapshot_xmin(pg_current_snapshot()) AS horizon_tx, "
                            "coalesce(max(global_position), 0) AS horizon_position FROM events"
                        )
                        for p in projections:
                            await control.execute(
                                "INSERT INTO projection_checkpoints (projection, tx_id, position, "
                                "rebuilt_at) VALUES ($1, $2::xid8, $3, now()) "
                                "ON CONFLICT (projection) DO UPDATE "
                                "SET tx_id = EXCLUDED.tx_id, position = EXCLUDED.position, "
                                "rebuilt_at = EXCLUDED.rebuilt_at",
                                p.name,
                                horizon["horizon_tx"],
                                horizon["horizon_position"],
                            )
                        swapped = True
            finally:
                await _drop_shadows(control, tables)
        finally:
            await control.execute("SELECT pg_advisory_unlock($1)", _REBUILD_LOCK_KEY)
    return RebuildReport(
        events=events,
        streams=streams,
        seconds=time.perf_counter() - started,
        verified=verify,
        differences=differences,
        swapped=swapped,
    )


async def outdated(conn: asyncpg.Connection, projections: Sequence[Projection[Any]]) -> list[str]:
    """The projections whose read models were built with an older shape than the code's."""
    built = {
        r["projection"]: r["version"]
        for r in await conn.fetch("SELECT projection, version FROM projection_versions")
    }
    return [p.name for p in projections if built.get(p.name, 1) < p.version]


async def rebuild_outdated(pool: asyncpg.Pool, projections: Sequence[Projection[Any]]) -> list[str]:
    """After `migrate`: rebuild from the log every projection whose shape changed since the
    database was last built (an upgrade), and record the versions. Returns the names rebuilt."""
    async with pool.acquire() as conn:
        stale = await outdated(conn, projections)
    if stale:
        log.info("projections.rebuilding_outdated", projections=stale)
        try:
            await rebuild(pool, projections)
        except UndecodableEvent as exc:
            # Served as they are (the older shape decodes with defaults), and `verify` names the
            # event; the rebuild is tried again at the next start.
            log.error("projections.rebuild_refused", projections=stale, error=str(exc))
            return []
    async with pool.acquire() as conn:
        await conn.executemany(
            "INSERT INTO projection_versions (projection, version) VALUES ($1, $2) "
            "ON CONFLICT (projection) DO UPDATE SET version = EXCLUDED.version, built_at = now() "
            "WHERE projection_versions.version < EXCLUDED.version",
            [(p.name, p.version) for p in projections],
        )
    return stale
