"""Agent reports (docs/NODE_AGENT_PROTOCOL.md): validated here, decided on the node's folded state
and the stream's position (domain.report_decisions.decide_report), and committed with the other
reports that arrive at the same time (ledger/group_commit.py): one transaction per batch, every
node's unit of work opened at once, each report decided alone, the accepted ones appended,
folded and their stream positions advanced together. Nothing is appended unless a report is
accepted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

import asyncpg
import msgspec
import structlog

from agent.protocol import (
    PROTOCOL_VERSION,
    STREAMS,
    ReportAck,
    decode_report,
    observation_problems_after_decode,
)
from api.services.clock import central_now
from api.services.credentials import CredentialService, Principal
from api.services.errors import (
    Conflict,
    DomainError,
    Forbidden,
    InvalidRequest,
    NodeIsDecommissioned,
    unauthenticated,
)
from api.services.inventory import HardwareInventoryService
from api.services.positions import KeptPosition, KeptPositions, advanced_bytes, recent_bytes, recent_digests
from collectors.identity import NodeIdentity
from domain.node import NodeState, node_id_for
from domain.report_decisions import (
    AcceptedReport,
    CredentialRefusal,
    DuplicateReport,
    ReportItem,
    SequenceConflict,
    decide_report,
)
from ledger.folded_append import NotFolded, Part, PartBuilder
from ledger.group_commit import GroupCommit, TryAgain
from ledger.store import StreamTombstoned
from ledger.unit_of_work import Committed, KeptStreams, OpenStream
from runtime.settings import default

log = structlog.get_logger(__name__)

# Agent-report transactions at once (the server's `report_transactions`).
REPORT_TRANSACTIONS: int = default("report_transactions")

# Under the nodes' stream locks, for a batch of reports (one per node): their streams' positions,
# row-locked, then advanced together. (Each credential's revocation is read from its node's folded
# state, which the unit of work already holds.) `xmin`: the transaction that wrote the row, what
# a kept copy of the row is checked against (`KeptPositions`).
_POSITIONS_SQL = """
SELECT p.node_id, p.stream, p.last_sequence, p.recent, p.xmin::text::bigint AS written
FROM agent_stream_positions p
JOIN unnest($1::text[], $2::text[]) AS u(node_id, stream) ON u.node_id = p.node_id AND u.stream = p.stream
FOR UPDATE OF p
"""

_ADVANCE_MANY_SQL = """
INSERT INTO agent_stream_positions AS p
    (node_id, stream, last_sequence, reports, skipped, recent, last_observed_at, last_received_at)
SELECT u.node_id, u.stream, u.last_sequence, 1, u.skipped, u.recent, u.observed_at, u.received_at
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::bytea[], $6::timestamptz[],
            $7::timestamptz[]) AS u(node_id, stream, last_sequence, skipped, recent, observed_at, received_at)
ON CONFLICT (node_id, stream) DO UPDATE SET
    last_sequence = EXCLUDED.last_sequence, reports = p.reports + 1, skipped = p.skipped + EXCLUDED.skipped,
    recent = EXCLUDED.recent, last_observed_at = EXCLUDED.last_observed_at,
    last_received_at = EXCLUDED.last_received_at
RETURNING p.node_id, p.stream, p.xmin::text::bigint AS written
"""


def _advance_arguments(
    items: Sequence[ReportItem], decided: Sequence[tuple[KeptPosition, AcceptedReport]], recent: list[bytes]
) -> list[object]:
    """`mf_advance_positions`' arguments for a batch decided on kept copies."""
    return [
        [i.node_id for i in items],
        [i.stream for i in items],
        [i.sequence for i in items],
        [d.gap for _p, d in decided],
        recent,
        [i.observed_at for i in items],
        [i.received_at for i in items],
        [p.written for p, _d in decided],
    ]


# The advance of positions a folded batch decided on from kept copies (`_commit_folded`), as part
# of its one statement: behind the append's gate, every row found (else the statement fails whole),
# and the transaction that wrote them, the new rows' `xmin`, as the answer.
def _advance_part(
    items: Sequence[ReportItem], decided: Sequence[tuple[KeptPosition, AcceptedReport]], recent: list[bytes]
) -> PartBuilder:
    def build(base: int, gate: str) -> Part:
        params = ", ".join(f"${base + i}" for i in range(1, 9))
        return Part(
            ctes=(f"adv AS (SELECT * FROM mf_advance_positions({params}) WHERE {gate})",),
            args=[*_advance_arguments(items, decided, recent), len(items)],
            check=f"(SELECT count(*) = ${base + 9}::bigint AND count(DISTINCT out_written) = 1 FROM adv)",
            answer="(SELECT max(out_written) FROM adv)",
        )

    return build


# The advance of positions the batch decided on from kept copies: each row only if it is still
# the one the copy was taken of (written by the same transaction); the rows it advanced come back
# (mf_advance_positions, a function for its generic plan).
_ADVANCE_KEPT_SQL = """
SELECT out_node_id AS node_id, out_stream AS stream, out_written AS written
FROM mf_advance_positions($1, $2, $3, $4, $5, $6, $7, $8)
"""


class BodyRefused(Exception):
    """The edge's guard refused a report's body (`refusal`): answered as it is, before anything
    else the service would check."""

    def __init__(self, refusal: Exception) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


def report_item(
    principal: Principal,
    raw: bytes,
    received_at: datetime,
    sent_at: datetime | None,
    body_guard: Callable[[bytes], None] | None = None,
) -> ReportItem:
    """A report's bytes, validated against the protocol and its credential: what its decision
    reads. Raises InvalidRequest or Forbidden, or what `body_guard` raises (below)."""
    try:
        report = decode_report(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        # The edge's hostile-input guard, deferred to here: a body the typed decode accepts holds
        # no NUL (a raw one is malformed JSON, an escaped one is out of contract) and is nested no
        # deeper than the schema, so the guard refuses only bodies the decode refused; where it
        # refuses one, its answer comes first, as where it runs before the route.
        if body_guard is not None:
            try:
                body_guard(raw)
            except Exception as refusal:
                raise BodyRefused(refusal) from exc
        if not isinstance(exc, msgspec.ValidationError):
            raise InvalidRequest("malformed-json", "Malformed JSON", str(exc)) from exc
        raise InvalidRequest(
            "validation-failed",
            "Request validation failed",
            "the report does not match the schema",
            errors=[str(exc)],
        ) from exc
    if report.protocol != PROTOCOL_VERSION:
        raise InvalidRequest(
            "unsupported-protocol",
            "Unsupported protocol version",
            f"this server speaks protocol {PROTOCOL_VERSION}, the report says {report.protocol}",
        )
    if report.stream not in STREAMS:
        raise InvalidRequest(
            "unknown-stream",
            "Unknown report stream",
            f"stream must be one of {', '.join(STREAMS)}; got {report.stream[:64]!r}",
        )
    if node_id_for(report.identity_key) != report.node_id:
        raise InvalidRequest(
            "node-id-mismatch", "Inconsistent node identity", "node_id is not the id of identity_key"
        )
    if report.node_id != principal.node_id or report.identity_key != principal.identity_key:
        raise Forbidden(
            "credential-node-mismatch",
            "Credential of another node",
            "this credential may publish only for the node it was issued to",
        )
    errors = observation_problems_after_decode(report.observation)
    if errors:
        raise InvalidRequest(
            "invalid-observation",
            "Invalid observation",
            f"{len(errors)} value(s) of the observation are not acceptable",
            errors=errors[:50],
        )
    return ReportItem(
        credential_id=principal.credential_id,
        node_id=report.node_id,
        identity=NodeIdentity(key=report.identity_key, source=report.identity_source),
        stream=report.stream,
        sequence=report.sequence,
        observed_at=report.observed_at,
        observation=report.observation,
        digest=hashlib.sha256(raw).hexdigest(),
        received_at=received_at,
        sent_at=sent_at,
    )


def _answer(
    item: ReportItem, decision: CredentialRefusal | SequenceConflict | DuplicateReport
) -> ReportAck | DomainError:
    """A report's outcome that appends nothing: the refusal as the services' error, or the
    `duplicate` ack."""
    match decision:
        case CredentialRefusal():
            return unauthenticated(decision.problem, decision.detail)
        case SequenceConflict():
            return Conflict(
                "sequence-conflict",
                "Sequence already used",
                decision.detail,
                stream=decision.stream,
                sequence=decision.sequence,
                last_sequence=decision.last_sequence,
            )
        case DuplicateReport():
            return ReportAck(
                status="duplicate",
                node_id=item.node_id,
                stream=item.stream,
                sequence=item.sequence,
                previous_sequence=decision.last,
                gap=0,
                received_at=item.received_at,
                events=0,
            )


def _accepted_ack(item: ReportItem, decision: AcceptedReport, done: Committed[NodeState]) -> ReportAck:
    return ReportAck(
        status="accepted",
        node_id=item.node_id,
        stream=item.stream,
        sequence=item.sequence,
        previous_sequence=decision.last,
        gap=decision.gap,
        received_at=item.received_at,
        events=len(done.events),
        lifecycle_events=[e.event_type for e in done.events if e.event_class == "lifecycle"],
    )


class ReportService:
    def __init__(
        self,
        inventory: HardwareInventoryService,
        credentials: CredentialService,
        *,
        clock: Callable[[], datetime] = central_now,
        report_transactions: int = REPORT_TRANSACTIONS,
    ) -> None:
        self.inventory = inventory
        self.credentials = credentials
        self.store = inventory.store
        self.nodes = inventory.nodes
        self.clock = clock
        # Two agent streams per node whose state is kept.
        self.positions = KeptPositions(2 * inventory.store.states.streams)
        # Concurrent reports of different nodes share transactions and statements
        # (ledger/group_commit.py), `report_transactions` of them at once (docs/capacity.md).
        self.group_commit: GroupCommit[ReportItem, ReportAck] = GroupCommit(
            inventory.store.pool,
            self._commit_reports,
            concurrency=report_transactions,
            outside=self._commit_folded,
        )

    async def accept_report(
        self,
        principal: Principal,
        raw: bytes,
        sent_at: datetime | None,
        body_guard: Callable[[bytes], None] | None = None,
    ) -> ReportAck:
        """Validate, check the sequence, and reconcile one report: one unit of work on the node's
        stream (one lock, one state load, one append, one fold). Nothing is appended unless the
        report is accepted (a report for a decommissioned node is refused and audited in a stream
        of its own). `body_guard`: the edge's check of a body it has not run yet (`report_item`)."""
        try:
            item = report_item(principal, raw, self.clock(), sent_at, body_guard)
            await self.inventory.health_policies.fresh()
            ack = await self.group_commit.run(item.node_id, item)
        except BodyRefused as exc:
            raise exc.refusal from None
        except (InvalidRequest, Forbidden):
            await self.credentials.reverify(principal)
            raise
        except NodeIsDecommissioned as exc:
            await self.inventory.record_revival_refused(
                principal.node_id, "agent_report", f"credential:{principal.credential_id}", exc.detail
            )
            raise
        if ack.gap > 0:
            log.warning(
                "agent.report_gap",
                node_id=ack.node_id,
                stream=ack.stream,
                sequence=ack.sequence,
                skipped=ack.gap,
            )
        return ack

    async def _commit_reports(
        self, conn: asyncpg.Connection, items: Sequence[ReportItem]
    ) -> list[ReportAck | BaseException]:
        """A group commit's batch of reports, one per node, in the batch's transaction: every
        node's unit of work opened at once (locks in node-id order), each report decided alone
        on its own node's state and stream position (`decide_report`), the accepted ones
        appended, folded and their positions advanced together: seven statements per batch, or
        five where every node's state and position was kept (`_commit_kept`). A batch comes here
        where its one statement outside a transaction (`_commit_folded`) could not be sent or
        wrote nothing."""
        kept = self._decide_kept(items)
        if kept is not None:
            done = await self._commit_kept(conn, items, *kept)
            if done is not None:
                return done
        node_ids = [i.node_id for i in items]
        opened = await self.nodes.open_many(conn, node_ids)
        rows = await conn.fetch(_POSITIONS_SQL, node_ids, [i.stream for i in items])
        positions = {(r["node_id"], r["stream"]): r for r in rows}
        outcomes: list[ReportAck | BaseException | None] = []
        accepted: list[tuple[int, OpenStream[NodeState], ReportItem, AcceptedReport]] = []
        for k, item in enumerate(items):
            node = opened[item.node_id]
            if isinstance(node, StreamTombstoned):
                outcomes.append(NodeIsDecommissioned(node.stream_id, node.tombstoned_at))
                continue
            row = positions.get((item.node_id, item.stream))
            last: int | None = row["last_sequence"] if row is not None else None
            stored: bytes = row["recent"] if row is not None else b""
            window = recent_digests(stored, last)
            decision = decide_report(node.state, item, last, window, self.inventory.health_policies.current)
            if isinstance(decision, AcceptedReport):
                accepted.append((k, node, item, decision))
                outcomes.append(None)
                continue
            if row is not None:  # kept as read; an accepted report's position is kept as advanced
                self.positions.keep(
                    item.node_id,
                    item.stream,
                    row["last_sequence"],
                    stored,
                    window,
                    row["written"],
                    node.state,
                )
            outcomes.append(_answer(item, decision))
        if accepted:
            stored_by = {key: row["recent"] for key, row in positions.items()}
            await self._append_accepted(conn, accepted, outcomes, stored_by)
        return [o for o in outcomes if o is not None]

    async def _commit_folded(
        self, conn: asyncpg.Connection, items: Sequence[ReportItem]
    ) -> list[ReportAck | BaseException] | None:
        """A group commit's batch as one statement outside a transaction block, where every
        node's state and stream position is kept and every report is accepted: decided on the
        copies, folded and appended with the read models' rows and the positions' advance
        (ledger/folded_append.py). None where it wrote nothing (not all kept, a refusal, a copy
        not current): the batch goes to `_commit_reports`, in a transaction."""
        kept = self._decide_kept(items)
        if kept is None:
            return None
        streams, decided = kept
        recent = [
            advanced_bytes(d.recent, i.sequence, p.recent) for i, (p, d) in zip(items, decided, strict=True)
        ]
        done = await self.nodes.append_folded(
            conn, streams, [d.events for _p, d in decided], _advance_part(items, decided, recent)
        )
        if isinstance(done, NotFolded):
            if done.by_part:
                # A stream position was not its copy: the transaction reads them.
                self.positions.stale += 1
                for item in items:
                    self.positions.drop(item.node_id, item.stream)
            return None
        committed, written = done
        if not isinstance(written, int):
            raise RuntimeError("the positions' advance answered no transaction")
        acks: list[ReportAck | BaseException] = []
        for item, (_p, d), node, state, packed in zip(
            items, decided, streams.kept, committed, recent, strict=True
        ):
            key = (item.node_id, item.stream)
            self.positions.keep(*key, item.sequence, packed, d.recent, written, state.state)
            self.positions.carry(*key, (node.version, node.position), state.state)
            self.inventory.reconciled(item.node_id, state, "agent")
            acks.append(_accepted_ack(item, d, state))
        return acks

    def _decide_kept(
        self, items: Sequence[ReportItem]
    ) -> tuple[KeptStreams[NodeState], list[tuple[KeptPosition, AcceptedReport]]] | None:
        """Every report of the batch decided on its node's kept state and its stream's kept
        position, before anything is sent; None unless all of them are kept and every report is
        accepted with events to append (a refusal or a retry goes the usual way, on what it reads)."""
        streams = self.nodes.kept([i.node_id for i in items])
        if streams is None or streams.stream_ids != [i.node_id for i in items]:
            return None
        decided: list[tuple[KeptPosition, AcceptedReport]] = []
        for item, node in zip(items, streams.kept, strict=True):
            state = streams.states[item.node_id]
            position = self.positions.get(item.node_id, item.stream)
            if (
                position is None
                or (position.node_version, position.node_position) != (node.version, node.position)
                or state.decommissioned_at is not None
            ):
                return None
            decision = decide_report(
                state,
                item,
                position.last_sequence,
                position.window,
                self.inventory.health_policies.current,
            )
            if not isinstance(decision, AcceptedReport) or not decision.events:
                return None
            decided.append((position, decision))
        return streams, decided

    async def _commit_kept(
        self,
        conn: asyncpg.Connection,
        items: Sequence[ReportItem],
        streams: KeptStreams[NodeState],
        decided: list[tuple[KeptPosition, AcceptedReport]],
    ) -> list[ReportAck | BaseException] | None:
        """The batch as decided on kept copies, confirmed under the locks: the nodes' states by the
        append (`mf_append_kept`; None where one is not the stored one: nothing was written, and
        the batch is opened as usual in this transaction), the positions by their advance (a row
        another transaction wrote since its copy fails the batch with TryAgain, its copies
        dropped, so that it runs again on what it reads)."""
        committed = await self.nodes.append_kept(conn, streams, [d.events for _p, d in decided])
        if committed is None:
            return None
        recent = [
            advanced_bytes(d.recent, i.sequence, p.recent) for i, (p, d) in zip(items, decided, strict=True)
        ]
        rows = await conn.fetch(_ADVANCE_KEPT_SQL, *_advance_arguments(items, decided, recent))
        if len(rows) != len(items):
            self.positions.stale += 1
            for item in items:
                self.positions.drop(item.node_id, item.stream)
            raise TryAgain("a kept stream position is not the stored one")
        written = {(r["node_id"], r["stream"]): r["written"] for r in rows}
        acks: list[ReportAck | BaseException] = []
        for item, (_p, d), node, done, packed in zip(
            items, decided, streams.kept, committed, recent, strict=True
        ):
            key = (item.node_id, item.stream)
            self.positions.keep(*key, item.sequence, packed, d.recent, written[key], done.state)
            self.positions.carry(*key, (node.version, node.position), done.state)
            self.inventory.reconciled(item.node_id, done, "agent")
            acks.append(_accepted_ack(item, d, done))
        return acks

    async def _append_accepted(
        self,
        conn: asyncpg.Connection,
        accepted: list[tuple[int, OpenStream[NodeState], ReportItem, AcceptedReport]],
        outcomes: list[ReportAck | BaseException | None],
        stored_by: Mapping[tuple[str, str], bytes],
    ) -> None:
        # The checkpoints decided on: the append moves each open stream's state on.
        before = [(node.state.stream_version, node.state.position) for _k, node, _i, _d in accepted]
        committed = await self.nodes.append_many(conn, [(node, d.events) for _k, node, _i, d in accepted])
        recent = [
            recent_bytes(d.recent, i.sequence, stored_by.get((i.node_id, i.stream), b""))
            for _k, _n, i, d in accepted
        ]
        rows = await conn.fetch(
            _ADVANCE_MANY_SQL,
            [i.node_id for _k, _n, i, _d in accepted],
            [i.stream for _k, _n, i, _d in accepted],
            [i.sequence for _k, _n, i, _d in accepted],
            [d.gap for _k, _n, _i, d in accepted],
            recent,
            [i.observed_at for _k, _n, i, _d in accepted],
            [i.received_at for _k, _n, i, _d in accepted],
        )
        written = {(r["node_id"], r["stream"]): r["written"] for r in rows}
        for (k, node, item, d), was, done, packed in zip(accepted, before, committed, recent, strict=True):
            key = (item.node_id, item.stream)
            self.positions.keep(*key, item.sequence, packed, d.recent, written[key], done.state)
            self.positions.carry(*key, was, done.state)
            self.inventory.reconciled(node.stream_id, done, "agent")
            outcomes[k] = _accepted_ack(item, d, done)
