"""A small projection framework: each read model is a pure fold per stream plus a pure mapping
from the folded state to table rows.

    fold(state, event) -> state          (pure; the same code inline and in `rebuild`)
    rows(state) -> {table: [row, ...]}   (pure; what the read-model tables must hold for the stream)

Inline, `apply` loads the stream's folded state (its checkpoint: `projection_state`), folds the
new events, and writes only the rows that changed, in the append's transaction. `rebuild` folds
the whole log into shadow tables with the same two functions, so "live == rebuilt" holds by
construction and is checked row for row by `rebuild --verify`.
"""

from __future__ import annotations

import functools
import operator
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import asyncpg
import msgspec

from ledger.events import RecordedEvent

S = TypeVar("S")
_K = TypeVar("_K")

Row = tuple[Any, ...]
Rows = Mapping[str, Sequence[Row]]

STATE_TABLE = "projection_state"

# The checkpoint's encoding, its first byte: msgpack deflated here, so PostgreSQL stores the bytes
# as they come (projection_state.state: STORAGE EXTERNAL) instead of compressing ~10 KB of JSON on
# every write. A checkpoint written as JSON begins with `{` and still decodes, so no stored state
# has to be rewritten and no projection version raised for the change of encoding.
_MSGPACK_DEFLATE = b"\x01"
# A checkpoint in two parts (`Projection.split`): what changes with every event first, as plain
# msgpack after its length (4 bytes, big-endian), then the rest as msgpack deflated. The rest
# comes out byte for byte the same while only the first part changes, and PostgreSQL logs an
# update on the row's own page as the bytes between the old and new row's common prefix and
# suffix: a steady report's checkpoint then costs the WAL of its first part, not of the state.
_SPLIT_DEFLATE = b"\x02"
_JSON_OBJECT = b"{"
# Raw deflate at its fastest level: within a few percent of level 6's size on a node's state at a
# fraction of the CPU (docs/profiles/steady-report.md); no zlib header, the marker says what it is.
_DEFLATE_LEVEL = 1
_DEFLATE_WBITS = -15
# A split checkpoint's rest is deflated once per change of it (`_deflated` keeps it), so it takes
# the better ratio: about 40 bytes less for an eight-GPU node, which keeps its row under the 2 KB
# past which PostgreSQL locks the old row (a WAL record) before every update.
_REST_DEFLATE_LEVEL = 6


_msgpack_encoder = msgspec.msgpack.Encoder()
# What a projection keeps per stream (`Projection._rest_bytes`, `row_changes`): the last rest
# with its deflate, and the last state with its rows, for as many streams as the folded states a
# server keeps (`state_cache_streams`' default), about 7 KB each.
_KEPT_RESTS = 10_000


def _keep(kept: dict[str, _K], stream_id: str, value: _K) -> None:
    """`value` as the stream's, in a memo of at most _KEPT_RESTS streams (first in, first out)."""
    kept.pop(stream_id, None)
    if len(kept) >= _KEPT_RESTS:
        del kept[next(iter(kept))]
    kept[stream_id] = value


class TableSpec(msgspec.Struct, frozen=True):
    """A read-model table: its columns (in order) and the columns that key one row."""

    name: str
    columns: tuple[str, ...]
    key: tuple[str, ...]


@functools.cache
def _key_positions(spec: TableSpec) -> tuple[int, ...]:
    # Looked up once per table: each append keys every row of both states (columns.index per
    # row and key column would cost a fifth of the projection's diff).
    return tuple(spec.columns.index(k) for k in spec.key)


@functools.cache
def _key_getter(spec: TableSpec) -> Callable[[Row], Any]:
    """A row's key as the diff compares it: the key column's value for a one-column key, else
    the tuple of the key columns' values (`operator.itemgetter`, one C call per row)."""
    return operator.itemgetter(*_key_positions(spec))


def _key_object(spec: TableSpec, key: Any) -> dict[str, Any]:
    """The key `_key_getter` gave, as the row object a delete is matched on."""
    return {spec.key[0]: key} if len(spec.key) == 1 else dict(zip(spec.key, key, strict=True))


@functools.cache
def _changes_sql(ops: tuple[tuple[str, str, TableSpec], ...], state_table: str) -> str:
    """One statement for every change of the rows of one or more streams: a data-modifying CTE
    per table and operation, each fed one jsonb array of row objects (`jsonb_populate_recordset`
    types the values by the table's own columns), then the new folded states. One round trip and
    one statement however many rows and streams changed, where a statement per row (executemany)
    cost a parse, a plan and an executor start each. Deleted, updated and inserted keys are
    disjoint, so the CTEs never touch the same row twice. The folded states come as the
    projection's name ($1) and five arrays (stream ids, versions, positions, encoded states, and
    whether the stream has a stored checkpoint; the tables' row arrays follow from $7, a delete's
    with its keys): a state is bytes to PostgreSQL (`projection_state.state` is bytea), never
    parsed there.

    Rows are written by upsert (INSERT ... ON CONFLICT DO UPDATE), changed ones too: its arbiter
    finds each row by its key's index, where an UPDATE joining the rows to the table planned a hash
    join over a scan of it, about 0.1 ms more of the database's CPU per table and batch
    (docs/performance.md); the upsert
    logs a row lock before each update, about 50 bytes of WAL a row, the price of that CPU. A
    changed row and a stored checkpoint must already be there: the version an upsert writes over a
    row it found carries the lock it took (`xmax` is not 0), an inserted one has none. The
    statement answers how many such rows it found; the caller checks that every one it expected
    was there."""
    ctes, found = changes_ctes(ops, state_table, base=0, gate=None, prefix="")
    return f"WITH {', '.join(ctes)} SELECT {found}"


@functools.cache
def changes_ctes(
    ops: tuple[tuple[str, str, TableSpec], ...], state_table: str, *, base: int, gate: str | None, prefix: str
) -> tuple[tuple[str, ...], str]:
    """`_changes_sql`'s data-modifying CTEs, to be part of a larger statement: their parameters
    numbered from `base` + 1 (the projection's name, then the states' five arrays, then the
    tables' row arrays), their names begun with `prefix`, and every one of them writing only
    where `gate` (an SQL condition that names no row: planned as a one-time filter, evaluated
    before the CTE writes a row) holds. With the expression that counts the existing rows and
    checkpoints they found."""
    when = f" AND {gate}" if gate else ""
    where = f" WHERE {gate}" if gate else ""
    ctes: list[str] = []
    counted: list[str] = []
    n = base + 6
    for i, (op, table, spec) in enumerate(ops):
        n += 1
        param = f"${n}"
        source = f"jsonb_populate_recordset(NULL::{table}, {param})"
        cols = ", ".join(spec.columns)
        name = f"{prefix}c{i}"
        if op == "delete":
            # The rows' first key column's values come again as an array ($n+1): planned against
            # jsonb_populate_recordset's guess of 100 rows alone, the join reads the whole table.
            n += 1
            match = " AND ".join(f"t.{k} = x.{k}" for k in spec.key)
            ctes.append(
                f"{name} AS (DELETE FROM {table} t USING {source} x "
                f"WHERE t.{spec.key[0]} = ANY(${n}::text[]) AND {match}{when})"
            )
            continue
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in spec.columns if c not in spec.key)
        conflict = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
        returning = ""
        if op == "update":
            returning = " RETURNING xmax::text <> '0' AS found"
            counted.append(name)
        ctes.append(
            f"{name} AS (INSERT INTO {table} ({cols}) SELECT {cols} FROM {source}{where} "
            f"ON CONFLICT ({', '.join(spec.key)}) {conflict}{returning})"
        )
    states = (
        f"unnest(${base + 2}::text[], ${base + 3}::bigint[], ${base + 4}::bigint[], ${base + 5}::bytea[], "
        f"${base + 6}::boolean[]) AS u(stream_id, stream_version, position, state, stored)"
    )
    upsert = (
        "ON CONFLICT (projection, stream_id) DO UPDATE SET stream_version = EXCLUDED.stream_version, "
        "position = EXCLUDED.position, state = EXCLUDED.state"
    )
    insert = (
        f"INSERT INTO {state_table} (projection, stream_id, stream_version, position, state) "
        f"SELECT ${base + 1}, u.stream_id, u.stream_version, u.position, u.state FROM {states}"
    )
    ctes.append(f"{prefix}s AS ({insert} WHERE u.stored{when} {upsert} RETURNING xmax::text <> '0' AS found)")
    counted.append(f"{prefix}s")
    ctes.append(f"{prefix}n AS ({insert} WHERE NOT u.stored{when} {upsert})")
    found = " + ".join(f"(SELECT count(*) FROM {c} WHERE {c}.found)" for c in counted)
    return tuple(ctes), found


class RowChanges(msgspec.Struct, frozen=True):
    """A batch's changes of one projection's rows and checkpoints, as one statement sends them
    (`changes_ctes`): the operations, their arguments after the projection's name (the states'
    five arrays, then each operation's rows), and how many stored rows and checkpoints the
    operations must find."""

    ops: tuple[tuple[str, str, TableSpec], ...]
    args: list[object]
    expected: int
    # Each change's state as its checkpoint stores it (`persisted`), in the changes' order.
    persisted: list[Any] = msgspec.field(default_factory=list)


class Projection(Generic[S]):
    """Base of a per-stream read model. Subclasses define `name`, `tables`, `state_type`,
    `initial`, `fold` and `rows`; this class does the I/O."""

    name: str
    tables: tuple[TableSpec, ...]
    state_type: type[S]
    # Raised whenever what the projection keeps changes shape (its persisted state or its rows):
    # a database built with an older version is rebuilt from the log on `migrate` / `serve`.
    version: int = 1

    def __init__(self) -> None:
        self._rests: dict[str, tuple[Any, bytes]] = {}
        # Each stream's last checkpointed state with the rows written for it (`row_changes`).
        self._written: dict[str, tuple[Any, Rows]] = {}

    def initial(self, stream_id: str) -> S:
        raise NotImplementedError

    def handles(self, stream_id: str) -> bool:
        """Whether this read model folds `stream_id` at all (default: every stream). A stream it
        does not handle gets no state and no rows, inline and in `rebuild` alike."""
        return True

    def fold(self, state: S, event: RecordedEvent) -> S:
        raise NotImplementedError

    def rows(self, state: S) -> Rows:
        raise NotImplementedError

    def rows_after(self, before: S, before_rows: Rows, after: S) -> Rows:
        """`rows(after)`, given `before_rows`, the rows of `before`: a projection may take those of
        them it can tell unchanged from the two states without building them again (default:
        none). Equal to `rows(after)` whatever the states (tests/test_projection_property.py)."""
        return self.rows(after)

    def persisted(self, state: S) -> S:
        """The state as its checkpoint stores it (default: whole). A projection may leave out
        what only its own rows need and what changes with every event, as long as every row built
        from the slimmer state still compares equal to the row built from the whole one whenever
        the fold did not replace that part (so a diff against it writes exactly what changed)."""
        return state

    def checkpoint_of(self, state: S) -> tuple[int, int]:
        """(stream version, global position) the state has folded up to."""
        raise NotImplementedError

    # The first part of a split checkpoint, as `split` gives it (None: checkpoints are not split).
    volatile_type: type[Any] | None = None

    def split(self, state: S) -> tuple[Any, S]:
        """A persisted state in two: what changes with (nearly) every event, of `volatile_type`,
        and the rest, which `joined` puts back together exactly."""
        raise NotImplementedError

    def joined(self, volatile: Any, rest: S) -> S:
        """The state `split` took apart."""
        raise NotImplementedError

    # --- pure helpers --------------------------------------------------------------------------

    def fold_all(self, state: S, events: Sequence[RecordedEvent]) -> S:
        for event in events:
            state = self.fold(state, event)
        return state

    def encode_state(self, state: S) -> bytes:
        """The checkpoint's bytes (`projection_state.state`): a format byte, then the persisted
        state as msgpack, deflated, or in its two parts where the projection splits it."""
        return self._encode_persisted(self.persisted(state))

    def _encode_persisted(self, kept: S, stream_id: str | None = None) -> bytes:
        """`encode_state` of a state `persisted` already gave (of the stream `stream_id`, where
        known: its rest's bytes may be kept, `_rest_bytes`)."""
        if self.volatile_type is None:
            packed = _msgpack_encoder.encode(kept)
            return _MSGPACK_DEFLATE + zlib.compress(packed, _DEFLATE_LEVEL, _DEFLATE_WBITS)
        volatile, rest = self.split(kept)
        head = _msgpack_encoder.encode(volatile)
        tail = self._rest_bytes(rest, stream_id)
        return b"".join((_SPLIT_DEFLATE, len(head).to_bytes(4, "big"), head, tail))

    def _rest_bytes(self, rest: S, stream_id: str | None) -> bytes:
        """The rest's msgpack, deflated. A steady report leaves the rest as its stream's previous
        one was, so the last rest of each stream is kept with its bytes: an equal rest (one
        comparison of the two, which share most of their objects) takes them instead of being
        encoded and deflated again. Equal rests encode alike: a rest's values only change through
        events, which the decisions make where a value differs (by the same `==`), so an equal
        rest holds the very values the kept one did; tests/test_checkpoint_split.py compares the
        bytes with fresh ones over arbitrary histories. First in, first out, per stream."""
        if stream_id is not None:
            kept = self._rests.get(stream_id)
            if kept is not None and kept[0] == rest:
                return kept[1]
        tail = zlib.compress(_msgpack_encoder.encode(rest), _REST_DEFLATE_LEVEL, _DEFLATE_WBITS)
        if stream_id is not None:
            _keep(self._rests, stream_id, (rest, tail))
        return tail

    def decode_state(self, raw: str | bytes) -> S:
        """A checkpoint's state from its bytes, in either encoding it may have been written in."""
        if isinstance(raw, str):
            return msgspec.json.decode(raw, type=self.state_type)
        head = raw[:1]
        if head == _MSGPACK_DEFLATE:
            packed = zlib.decompress(memoryview(raw)[1:], _DEFLATE_WBITS)
            return msgspec.msgpack.decode(packed, type=self.state_type)
        if head == _SPLIT_DEFLATE and self.volatile_type is not None:
            view = memoryview(raw)
            end = 5 + int.from_bytes(view[1:5], "big")
            volatile = msgspec.msgpack.decode(view[5:end], type=self.volatile_type)
            rest = msgspec.msgpack.decode(zlib.decompress(view[end:], _DEFLATE_WBITS), type=self.state_type)
            return self.joined(volatile, rest)
        if head == _JSON_OBJECT:
            return msgspec.json.decode(raw, type=self.state_type)
        raise ValueError(f"{self.name}: a checkpoint in an unknown encoding (first byte {head!r})")

    # --- I/O -------------------------------------------------------------------------------------

    def checkpointed(self, stream_id: str, stored: bytes | None) -> S | None:
        """The state from its checkpoint's bytes (None: no checkpoint, the initial state), or
        None for a stream this projection does not handle."""
        if not self.handles(stream_id):
            return None
        return self.decode_state(stored) if stored is not None else self.initial(stream_id)

    async def load_state(self, conn: asyncpg.Connection, stream_id: str, *, suffix: str = "") -> S:
        return (await self.load_states(conn, [stream_id], suffix=suffix))[stream_id]

    async def load_states(
        self, conn: asyncpg.Connection, stream_ids: Sequence[str], *, suffix: str = ""
    ) -> dict[str, S]:
        """Each stream's folded state as checkpointed (its initial state before its first event),
        several streams in one query."""
        rows = await conn.fetch(
            f"SELECT stream_id, state FROM {STATE_TABLE}{suffix} "
            "WHERE projection = $1 AND stream_id = ANY($2::text[])",
            self.name,
            list(stream_ids),
        )
        stored = {r["stream_id"]: r["state"] for r in rows}
        return {
            sid: self.decode_state(stored[sid]) if sid in stored else self.initial(sid) for sid in stream_ids
        }

    async def apply(
        self,
        conn: asyncpg.Connection,
        stream_id: str,
        events: Sequence[RecordedEvent],
        prior: object = None,
    ) -> S | None:
        """Fold `events` into the read model inline and return the stream's new state (None for
        a stream this projection does not handle). `prior`: the state as the caller loaded it."""
        (after,) = await self.apply_many(conn, [(stream_id, events, prior)])
        return after

    async def apply_many(
        self, conn: asyncpg.Connection, appended: Sequence[tuple[str, Sequence[RecordedEvent], object]]
    ) -> list[S | None]:
        """`apply` for several streams (a group commit's batch): each folded alone, every change
        written in one statement."""
        # The states no caller loaded, in one round trip (a query per stream made a batch's
        # latency grow with its size).
        missing = [
            sid for sid, _e, prior in appended if self.handles(sid) and not isinstance(prior, self.state_type)
        ]
        loaded = await self.load_states(conn, missing) if missing else {}
        out, changes = self.fold_many(
            [(sid, events, loaded.get(sid, prior)) for sid, events, prior in appended]
        )
        if changes:
            await self.write_changes_many(conn, changes)
        return out

    def fold_many(
        self, appended: Sequence[tuple[str, Sequence[RecordedEvent], object]]
    ) -> tuple[list[S | None], list[tuple[str, S, S]]]:
        """Each stream's events folded onto its prior state (every stream this projection
        handles must have one): the new states (None for a stream it does not handle) and the
        changes `(stream_id, before, after)` to write."""
        out: list[S | None] = []
        changes: list[tuple[str, S, S]] = []
        for stream_id, events, prior in appended:
            if not self.handles(stream_id):
                out.append(None)
                continue
            if not isinstance(prior, self.state_type):
                raise TypeError(f"{self.name}: no prior state of {stream_id} to fold onto")
            after = self.fold_all(prior, events)
            changes.append((stream_id, prior, after))
            out.append(after)
        return out, changes

    async def write_changes(
        self, conn: asyncpg.Connection, stream_id: str, before: S, after: S, *, suffix: str = ""
    ) -> None:
        """Write the difference between the rows of `before` and `after`, and the new state."""
        await self.write_changes_many(conn, [(stream_id, before, after)], suffix=suffix)

    async def write_changes_many(
        self, conn: asyncpg.Connection, changes: Sequence[tuple[str, S, S]], *, suffix: str = ""
    ) -> None:
        """`write_changes` for several streams `(stream_id, before, after)`, in one statement."""
        written = self.row_changes(changes, suffix=suffix)
        updated = await conn.fetchval(
            _changes_sql(written.ops, STATE_TABLE + suffix), self.name, *written.args
        )
        if updated != written.expected:
            raise RuntimeError(self.not_stored_message(written.expected - updated))

    def not_stored_message(self, missing: int) -> str:
        # A row or checkpoint the stream's state had is not stored: the read model is not the
        # fold of its log (`rebuild` makes it so). Refused, so the append writes nothing.
        return (
            f"{self.name}: {missing} of the rows and checkpoints the folded states had "
            "are not stored; run `modelforge-hw rebuild`"
        )

    def changes_statement(
        self, written: RowChanges, *, base: int, gate: str, prefix: str
    ) -> tuple[tuple[str, ...], str]:
        """`written` as CTEs of a larger statement (`changes_ctes`): their arguments are the
        projection's name, then `written.args`, numbered from `base` + 1."""
        return changes_ctes(written.ops, STATE_TABLE, base=base, gate=gate, prefix=prefix)

    def row_changes(self, changes: Sequence[tuple[str, S, S]], *, suffix: str = "") -> RowChanges:
        """What `write_changes_many` sends for these changes (pure): the operations, their
        arguments after the projection's name, and how many stored rows and checkpoints they
        must find."""
        if len({stream_id for stream_id, _b, _a in changes}) != len(changes):
            raise ValueError("one statement writes each stream once: fold a stream's events together")
        # By table, only where a row is gone, changed or added (a steady report: two tables).
        gone_by: dict[str, list[dict[str, Any]]] = {}
        changed_by: dict[str, list[dict[str, Any]]] = {}
        added_by: dict[str, list[dict[str, Any]]] = {}
        versions: list[int] = []
        positions: list[int] = []
        states: list[bytes] = []
        stored: list[bool] = []
        persisted: list[S] = []
        for stream_id, before, after in changes:
            # Where `before` is the state this projection last checkpointed for the stream (the
            # kept copy a folded append starts from), its rows are the ones written then.
            last = self._written.get(stream_id)
            old_rows = last[1] if last is not None and last[0] is before else self.rows(before)
            new_rows = self.rows_after(before, old_rows, after)
            for spec in self.tables:
                old_list, new_list = old_rows.get(spec.name, ()), new_rows.get(spec.name, ())
                # Most of a stream's tables do not change with an event (a steady report changes
                # its telemetry rows only): equal lists, in the order `rows` builds them, are
                # told apart in one comparison, without keying every row of both.
                if old_list == new_list:
                    continue
                key_of = _key_getter(spec)
                old = {key_of(r): r for r in old_list}
                new = {key_of(r): r for r in new_list}
                for k, r in new.items():
                    was = old.get(k)
                    if was is None:
                        added_by.setdefault(spec.name, []).append(dict(zip(spec.columns, r, strict=True)))
                    elif was != r:
                        changed_by.setdefault(spec.name, []).append(dict(zip(spec.columns, r, strict=True)))
                left = [_key_object(spec, k) for k in old if k not in new]
                if left:
                    gone_by.setdefault(spec.name, []).extend(left)
            version, position = self.checkpoint_of(after)
            versions.append(version)
            positions.append(position)
            kept = self.persisted(after)
            persisted.append(kept)
            states.append(self._encode_persisted(kept, stream_id))
            _keep(self._written, stream_id, (kept, new_rows))
            # A state folded from any event was checkpointed with it (the initial state is at 0).
            stored.append(self.checkpoint_of(before)[0] > 0)
        ops: list[tuple[str, str, TableSpec]] = []
        args: list[object] = [
            [stream_id for stream_id, _b, _a in changes],
            versions,
            positions,
            states,
            stored,
        ]
        expected = sum(stored)
        for spec in self.tables:
            gone = gone_by.get(spec.name)
            if gone:
                ops.append(("delete", spec.name + suffix, spec))
                args.append(gone)
                args.append(list({r[spec.key[0]] for r in gone}))
            changed = changed_by.get(spec.name)
            if changed:
                ops.append(("update", spec.name + suffix, spec))
                args.append(changed)
                expected += len(changed)
            added = added_by.get(spec.name)
            if added:
                ops.append(("upsert", spec.name + suffix, spec))
                args.append(added)
        return RowChanges(tuple(ops), args, expected, persisted)
