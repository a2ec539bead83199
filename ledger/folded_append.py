"""A batch appended in one statement, outside a transaction block: its events folded before they
are sent.

A batch on kept states (ledger/unit_of_work.py `append_kept`) is decided before anything is
sent; to write it as one statement, its read models' rows and checkpoints must be known before
the append too, and the fold that makes them reads each event's global position. So the writer
reserves the positions first (ledger/reserved_positions.py), folds the events with them, and
sends one statement (one round trip where a transaction takes five: BEGIN, the append, the rows,
the caller's own rows, COMMIT):

    WITH a AS (mf_append_folded: the locks, the kept states confirmed, the events appended at
               the positions folded, or SQLSTATE MF412 and nothing written),
         g AS (whether a appended: every part below writes only after it),
         the projection's rows and checkpoints (projections.framework.changes_ctes),
         the caller's own parts (`Part`, e.g. the agents' stream positions)
    SELECT the events' positions, versions and recorded times, each part's check (`mf_require`)

One statement is one transaction: it commits whole or not at all, and a check that fails (a kept
state that is not the stored one, a position that is not its stream's next, a read-model row or
checkpoint missing, a caller's part that did not find what it decided on) fails it whole. The
caller then appends the usual way, in a transaction, on what it reads there.

A state folded here never reads the events' recorded time (the database's clock at the append):
the projections' folds read positions and the events' own times, so what is folded before the
append is what `rebuild` folds from the log (`rebuild --verify` checks it row for row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime

import asyncpg
import msgspec
import structlog

from ledger.events import SCHEMA_VERSION, RecordedEvent
from ledger.state_cache import KeptState
from ledger.store import AppendRequest, AppendResult, EventStore, append_arguments

log = structlog.get_logger(__name__)

# What mf_append_folded and the checks raise where the statement was decided on something not
# current (MF412), the read models found less than they must (MF417), the caller's part did
# (MF418), or a snapshot names a GPU set that is not stored (MF424): nothing was written, and the
# batch is appended the usual way.
_PART_NOT_CURRENT = "MF418"
_NOT_CURRENT = frozenset({"MF412", "MF417", _PART_NOT_CURRENT, "MF424"})

_GATE = "(SELECT g.ok FROM g)"


class Part(msgspec.Struct, frozen=True):
    """A caller's part of the statement: data-modifying CTEs that write only where `gate` holds
    (their parameters numbered from the `base` they were built for), the check they must pass
    (an SQL condition over them: else the statement fails whole), and an SQL expression the
    statement answers once (its value is `FoldedAppend.answer`)."""

    ctes: tuple[str, ...]
    args: list[object]
    check: str
    answer: str = "NULL"


# A caller's part, built for the parameters after `base` and the gate its CTEs write behind.
PartBuilder = Callable[[int, str], Part]


class NotFolded(msgspec.Struct, frozen=True):
    """A folded append that wrote nothing; `by_part`: the caller's part's check failed."""

    by_part: bool


class FoldedAppend(msgspec.Struct, frozen=True):
    """What a folded append stored: each stream's result, and the value of the caller's part's
    `answer`."""

    results: list[AppendResult]
    answer: object


async def append_folded(
    store: EventStore,
    conn: asyncpg.Connection,
    requests: Sequence[AppendRequest],
    projection: str,
    kept: Sequence[KeptState],
    rebuild: datetime,
    part: PartBuilder | None = None,
) -> FoldedAppend | NotFolded:
    """Append each request's events (its stream at its kept version and state, `kept`, of
    `projection`'s `rebuild`) with the read models' writes and the caller's `part`, in one
    statement on `conn`, which must not be inside a transaction. NotFolded where nothing was
    written (a kept state or reserved position not current, a part's check failed, a projection
    other than `projection` folds one of the streams): the caller appends the usual way."""
    if conn.is_in_transaction():
        raise RuntimeError("a folded append is its own transaction: call it outside one")
    owner = next((p for p in store.projections if p.name == projection), None)
    if owner is None or any(
        p is not owner and p.handles(r.stream_id) for p in store.projections for r in requests
    ):
        return NotFolded(by_part=False)
    encoded = await store.encoded(conn, requests)
    # Above every stream's last position: where another append took a later one since this
    # process reserved, the reservation is renewed first rather than refused by the database.
    above = max(k.position for k in kept)
    positions = iter(await store.reserved.take(conn, sum(len(r.events) for r in requests), above=above))
    # The database's clock stamps the events; the fold never reads it (module docstring).
    provisional = datetime.now(UTC)
    recorded = [
        [
            RecordedEvent(
                global_position=next(positions),
                stream_id=r.stream_id,
                stream_version=k.version + j,
                event_id=e.event_id,
                event_type=e.event_type,
                event_class=e.event_class,
                schema_version=SCHEMA_VERSION,
                payload=code.payload,
                metadata=code.metadata,
                recorded_at=provisional,
            )
            for j, (e, code) in enumerate(zip(r.events, per, strict=True), start=1)
        ]
        for r, k, per in zip(requests, kept, encoded, strict=True)
    ]
    states, changes = owner.fold_many(
        [(r.stream_id, events, k.state) for r, k, events in zip(requests, kept, recorded, strict=True)]
    )
    written = owner.row_changes(changes)
    args: list[object] = [
        *append_arguments(
            [
                msgspec.structs.replace(r, expected_version=k.version)
                for r, k in zip(requests, kept, strict=True)
            ],
            encoded,
        ),
        [e.global_position for events in recorded for e in events],
        projection,
        [k.version for k in kept],
        [k.position for k in kept],
        rebuild,
    ]
    ctes = [
        "a AS (SELECT * FROM mf_append_folded(" + ", ".join(f"${i}" for i in range(1, len(args) + 1)) + "))",
        "g AS (SELECT count(*) > 0 AS ok FROM a)",
    ]
    base = len(args)
    own, found = owner.changes_statement(written, base=base, gate=_GATE, prefix="p")
    ctes.extend(own)
    args.extend([projection, *written.args, written.expected])
    # Counts are parameters, not literals: one statement text per shape of writes, whatever the
    # batch's size, so the connection's prepared statements are reused.
    checks = [
        f"mf_require(({found}) = ${len(args)}::bigint, 'MF417', 'read-model rows or checkpoints missing')"
    ]
    answer = "NULL"
    if part is not None:
        built = part(len(args), _GATE)
        ctes.extend(built.ctes)
        args.extend(built.args)
        refused = "'a part of the append found less than it must'"
        checks.append(f"mf_require({built.check}, '{_PART_NOT_CURRENT}', {refused})")
        answer = built.answer
    sql = (
        f"WITH {', '.join(ctes)} "
        "SELECT a.out_stream_index, a.out_global_position, a.out_stream_version, a.out_recorded_at, "
        f"c.answer FROM a, (SELECT {' AND '.join(checks)} AS ok, {answer} AS answer) c "
        "ORDER BY a.out_stream_index, a.out_stream_version"
    )
    try:
        rows = await conn.fetch(sql, *args)
    except asyncpg.PostgresError as exc:
        code = getattr(exc, "sqlstate", None)
        if code not in _NOT_CURRENT:
            raise
        if code == "MF424":
            store.gpu_sets.forget()
        # Counted where the transaction finds them so (`StateCache.stale`); the positions are
        # dropped, as one of them may be what was not current.
        store.reserved.drop()
        store.states.folded_refused += 1
        log.debug("append.folded_not_current", sqlstate=code, streams=len(requests))
        return NotFolded(by_part=code == _PART_NOT_CURRENT)
    sent = [(e.global_position, e.stream_version) for events in recorded for e in events]
    if [(r["out_global_position"], r["out_stream_version"]) for r in rows] != sent:
        # The function appends at exactly the positions and versions sent; anything else is a
        # defect, and what was folded cannot be trusted.
        raise RuntimeError("a folded append stored other positions or versions than it folded")
    at = rows[0]["out_recorded_at"]
    store.states.kept_appends += 1
    store.states.folded_appends += 1
    results: list[AppendResult] = []
    # The states as their checkpoints store them, worked out once, with the rows (in the order of
    # the streams the projection folds).
    persisted = iter(written.persisted)
    for r, events, state in zip(requests, recorded, states, strict=True):
        stored_events = [msgspec.structs.replace(e, recorded_at=at) for e in events]
        folded: dict[str, object] = {}
        if state is not None:
            folded[projection] = state
            version, position = owner.checkpoint_of(state)
            store.states.keep(projection, r.stream_id, version, position, next(persisted))
        results.append(
            AppendResult(r.stream_id, stored_events[-1].stream_version, stored_events, False, folded)
        )
    return FoldedAppend(results, rows[0]["answer"])
