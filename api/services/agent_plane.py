"""The server side of the agent plane: enrollment tokens, node credentials, and agent reports
(docs/NODE_AGENT_PROTOCOL.md).

Secrets: an enrollment token is `mfe_<token id>_<secret>`, a node credential `mfc_<credential
id>_<secret>`, each secret 256 random bits. Only the secret's SHA-256 is stored (in the event that
creates it, and in its read model); a presented secret is looked up by its id and compared in
constant time. Nothing here logs a secret.

Every write is events in the log (lifecycle, audited, immutable) appended under the stream lock,
with the read models updated in the same transaction:
- token created/revoked: the token's own stream `enrollment-token-<id>`;
- enrollment: ENROLLMENT_TOKEN_USED on the token's stream (locked first, so uses are counted
  exactly, across API processes) and CREDENTIAL_ISSUED on the node's stream (locked second);
- a report: one unit of work on the node's stream: one lock, one state load, the sequence check,
  the reconciliation (`HardwareInventoryService.reconcile_in`), one append, one fold.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated, Literal

import asyncpg
import msgspec
import structlog

from agent.protocol import (
    CREDENTIAL_PREFIX,
    ENROLLMENT_TOKEN_PREFIX,
    PROTOCOL_VERSION,
    STREAMS,
    EnrollRequest,
    EnrollResponse,
    Report,
    ReportAck,
    decode_report,
    observation_problems_after_decode,
)
from api.services.errors import (
    Conflict,
    DomainError,
    Forbidden,
    InvalidRequest,
    NodeIsDecommissioned,
    NotFound,
    Unauthenticated,
)
from api.services.inventory import HardwareInventoryService, open_node, reconcile_decision
from collectors.identity import IdentityError, NodeIdentity, validate_identity_key
from domain.node import CredentialState, NodeState, node_id_for
from ledger.events import (
    CredentialIssued,
    CredentialRevoked,
    EnrollmentTokenCreated,
    EnrollmentTokenRevoked,
    EnrollmentTokenUsed,
    EventMetadata,
    EventPayload,
    NewEvent,
    Source,
    enrollment_token_stream,
)
from ledger.group_commit import GroupCommit, TryAgain
from ledger.store import StreamTombstoned
from ledger.unit_of_work import Committed, KeptStreams, OpenStream, UnitOfWork
from projections.agent import ENROLLMENT_TOKEN_PROJECTION, TokenState
from runtime.settings import default

log = structlog.get_logger(__name__)

MAX_TOKEN_TTL = timedelta(days=30)
MAX_TOKEN_USES = 100_000


def _unauthorized(type_: str, detail: str) -> Unauthenticated:
    return Unauthenticated(type_, "Authentication failed", detail)


def _invalid(detail: str) -> InvalidRequest:
    return InvalidRequest("invalid-parameter", "Invalid parameter", detail)


# --- bodies ----------------------------------------------------------------------------------------


class TokenCreateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # The bounds create_token enforces, stated in the types so the API's schema says them.
    ttl_seconds: Annotated[float, msgspec.Meta(ge=1, le=MAX_TOKEN_TTL.total_seconds())] = 3600.0
    uses: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKEN_USES)] = 1
    description: Annotated[str, msgspec.Meta(max_length=200)] = ""


class TokenCreated(msgspec.Struct, frozen=True):
    """The token itself is shown once, here."""

    token_id: str
    token: str
    expires_at: datetime
    uses: int
    description: str


TokenStatus = Literal["active", "expired", "used_up", "revoked"]


class TokenBody(msgspec.Struct, frozen=True):
    token_id: str
    description: str
    status: TokenStatus
    uses: int
    uses_left: int
    created_at: datetime | None
    expires_at: datetime | None
    last_used_at: datetime | None
    revoked_at: datetime | None
    revoked_reason: str | None


class RevokeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reason: str = "revoked by an operator"


class CredentialBody(msgspec.Struct, frozen=True):
    credential_id: str
    node_id: str
    identity_key: str
    hostname: str
    enrollment_token_id: str
    status: Literal["active", "revoked"]
    issued_at: datetime
    revoked_at: datetime | None
    revoked_reason: str | None


class AgentStreamBody(msgspec.Struct, frozen=True):
    node_id: str
    stream: str
    last_sequence: int
    reports: int
    skipped: int
    last_observed_at: datetime | None
    last_received_at: datetime | None


class Principal(msgspec.Struct, frozen=True):
    """An authenticated agent: the credential and the node it is bound to."""

    credential_id: str
    node_id: str
    identity_key: str


# --- secrets ---------------------------------------------------------------------------------------


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _mint(prefix: str) -> tuple[str, str, str]:
    """(id, full token, sha256 of its secret): 256 random bits."""
    ident = uuid.uuid4().hex
    secret = secrets.token_urlsafe(32)
    return ident, f"{prefix}_{ident}_{secret}", _digest(secret)


def parse_secret(presented: str | None, prefix: str) -> tuple[str, str] | None:
    """(id, secret) of a token of the given kind, or None when it cannot be one."""
    if not presented:
        return None
    kind, _, rest = presented.partition("_")
    ident, _, secret = rest.partition("_")
    if kind != prefix or len(ident) != 32 or not secret or len(secret) > 128:
        return None
    try:
        int(ident, 16)
    except ValueError:
        return None
    return ident, secret


def _matches(secret: str, stored_sha256: str) -> bool:
    return hmac.compare_digest(_digest(secret), stored_sha256)


def _utcnow() -> datetime:
    return datetime.now(UTC)


# Credentials remembered as verified per process (about one per node of the fleet).
MAX_VERIFIED_CREDENTIALS = 100_000

# Agent-report transactions at once (the server's `report_transactions`).
REPORT_TRANSACTIONS: int = default("report_transactions")

# How many digests of accepted reports per stream are kept to recognize an unchanged retry.
RECENT_REPORT_DIGESTS = 32

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
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::jsonb[], $6::timestamptz[],
            $7::timestamptz[]) AS u(node_id, stream, last_sequence, skipped, recent, observed_at, received_at)
ON CONFLICT (node_id, stream) DO UPDATE SET
    last_sequence = EXCLUDED.last_sequence, reports = p.reports + 1, skipped = p.skipped + EXCLUDED.skipped,
    recent = EXCLUDED.recent, last_observed_at = EXCLUDED.last_observed_at,
    last_received_at = EXCLUDED.last_received_at
RETURNING p.node_id, p.stream, p.xmin::text::bigint AS written
"""

# The advance of positions the batch decided on from kept copies: each row only if it is still
# the one the copy was taken of (written by the same transaction); the rows it advanced come back.
_ADVANCE_KEPT_SQL = """
UPDATE agent_stream_positions AS p SET
    last_sequence = u.last_sequence, reports = p.reports + 1, skipped = p.skipped + u.skipped,
    recent = u.recent, last_observed_at = u.observed_at, last_received_at = u.received_at
FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bigint[], $5::jsonb[], $6::timestamptz[],
            $7::timestamptz[], $8::bigint[])
     AS u(node_id, stream, last_sequence, skipped, recent, observed_at, received_at, written)
WHERE p.node_id = u.node_id AND p.stream = u.stream AND p.xmin::text::bigint = u.written
RETURNING p.node_id, p.stream, p.xmin::text::bigint AS written
"""


class KeptPosition(msgspec.Struct, frozen=True):
    """A copy of one `agent_stream_positions` row: what a report's decision reads of it, the
    transaction that wrote the row (its `xmin`), and the node's checkpoint (stream version,
    position) in the transaction that read or wrote it: a copy is used only with that same kept
    node state, so that a batch never decides on a node state and a position of two moments."""

    last_sequence: int
    recent: bytes  # the row's `recent` as JSON: half the memory of the dict, decoded when used
    written: int
    node_version: int
    node_position: int


class KeptPositions:
    """The stream positions this process last read or wrote, by (node, agent stream), so that a
    batch of reports on kept node states can be decided before anything is sent and committed in
    five statements instead of seven (`EnrollmentService._commit_kept`). A copy is only a guess:
    the advance applies to a row only while its `xmin` is the copy's (no other transaction wrote
    it since: another server, or ours rolled back), else the batch is rolled back and runs again
    on what it reads (ledger.group_commit.TryAgain). Least recently used first out."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self._kept: OrderedDict[tuple[str, str], KeptPosition] = OrderedDict()
        self.stale = 0  # batches that found a kept position was not the stored one (/metrics)

    def get(self, node_id: str, stream: str) -> KeptPosition | None:
        return self._kept.get((node_id, stream))

    def keep(
        self,
        node_id: str,
        stream: str,
        last_sequence: int,
        recent: dict[str, str],
        written: int,
        node: NodeState,
    ) -> None:
        if self.streams <= 0:
            return
        key = (node_id, stream)
        self._kept[key] = KeptPosition(
            last_sequence, msgspec.json.encode(recent), written, node.stream_version, node.position
        )
        self._kept.move_to_end(key)
        while len(self._kept) > self.streams:
            self._kept.popitem(last=False)

    def carry(self, node_id: str, wrote: str, before: tuple[int, int], after: NodeState) -> None:
        """After this process's own commit of a report on `wrote`, the node's other streams' copies
        that were paired with the checkpoint (stream version, position) the commit moved the node
        on from are paired with the one it moved to: the commit wrote the node's events and the
        position row of `wrote` only, so their rows are as they were when copied, and a node
        whose reports alternate between its streams is still decided in five statements. Should
        a row have been written all the same, its advance's `xmin` check still refuses the copy."""
        for stream in STREAMS:
            if stream == wrote:
                continue
            copy = self._kept.get((node_id, stream))
            if copy is not None and (copy.node_version, copy.node_position) == before:
                self._kept[(node_id, stream)] = msgspec.structs.replace(
                    copy, node_version=after.stream_version, node_position=after.position
                )

    def drop(self, node_id: str, stream: str) -> None:
        self._kept.pop((node_id, stream), None)


def token_body(state: TokenState, now: datetime) -> TokenBody:
    uses_left = max(0, state.uses - state.used)
    status: TokenStatus
    if state.revoked_at is not None:
        status = "revoked"
    elif uses_left <= 0:
        status = "used_up"
    elif state.expires_at is not None and now >= state.expires_at:
        status = "expired"
    else:
        status = "active"
    return TokenBody(
        token_id=state.token_id,
        description=state.description,
        status=status,
        uses=state.uses,
        uses_left=uses_left,
        created_at=state.created_at,
        expires_at=state.expires_at,
        last_used_at=state.last_used_at,
        revoked_at=state.revoked_at,
        revoked_reason=state.revoked_reason,
    )


def credential_body(node_id: str, c: CredentialState) -> CredentialBody:
    return CredentialBody(
        credential_id=c.credential_id,
        node_id=node_id,
        identity_key=c.identity_key,
        hostname=c.hostname,
        enrollment_token_id=c.enrollment_token_id,
        status="revoked" if c.revoked_at is not None else "active",
        issued_at=c.issued_at,
        revoked_at=c.revoked_at,
        revoked_reason=c.revoked_reason,
    )


def token_refusal(state: TokenState, now: datetime) -> Unauthenticated | None:
    """Why a token (its secret already checked) cannot be used now, or None: pure."""
    if state.revoked_at is not None:
        return _unauthorized("enrollment-token-revoked", "the enrollment token was revoked")
    if state.expires_at is None or now >= state.expires_at:
        when = state.expires_at.isoformat() if state.expires_at else "?"
        return _unauthorized("enrollment-token-expired", f"the enrollment token expired at {when}")
    if state.uses - state.used <= 0:
        return _unauthorized(
            "enrollment-token-used-up", f"the enrollment token's {state.uses} use(s) are spent"
        )
    return None


def sequence_refusal(
    stream: str, seq: int, last: int | None, recent: dict[str, str], digest: str
) -> Conflict | None:
    """A report's sequence against the stream's last accepted one: None to accept (or to answer
    `duplicate`, decided by the caller), else the conflict: pure."""
    if last is None or seq > last or recent.get(str(seq)) == digest:
        return None
    if seq == last:
        detail = f"sequence {seq} of stream {stream} was already accepted with other content"
    else:
        detail = f"sequence {seq} of stream {stream} is older than the last accepted ({last})"
        if str(seq) in recent:
            detail += " and was accepted with other content"
    return Conflict(
        "sequence-conflict",
        "Sequence already used",
        detail,
        stream=stream,
        sequence=seq,
        last_sequence=last,
    )


class ReportItem(msgspec.Struct, frozen=True):
    """A validated report waiting for its node's unit of work in a group commit."""

    principal: Principal
    report: Report
    digest: str
    received_at: datetime
    sent_at: datetime | None


class AcceptedReport(msgspec.Struct, frozen=True):
    """What a report that passed its checks appends, and how its stream position moves."""

    events: list[NewEvent]
    last: int | None
    gap: int
    recent: dict[str, str]


def _accepted_ack(item: ReportItem, decision: AcceptedReport, done: Committed[NodeState]) -> ReportAck:
    return ReportAck(
        status="accepted",
        node_id=item.report.node_id,
        stream=item.report.stream,
        sequence=item.report.sequence,
        previous_sequence=decision.last,
        gap=decision.gap,
        received_at=item.received_at,
        events=len(done.events),
        lifecycle_events=[e.event_type for e in done.events if e.event_class == "lifecycle"],
    )


def decide_report(
    state: NodeState, item: ReportItem, last: int | None, recent: dict[str, str]
) -> ReportAck | DomainError | AcceptedReport:
    """A report against its node's folded state and its stream's position: refused (the error),
    an unchanged retry (the `duplicate` ack), or accepted (the events to append). Pure."""
    principal, report = item.principal, item.report
    credential = state.credentials.get(principal.credential_id)
    if credential is None or credential.revoked_at is not None:
        return _unauthorized("credential-revoked", "the node credential was revoked")
    seq, stream_name = report.sequence, report.stream
    refusal = sequence_refusal(stream_name, seq, last, recent, item.digest)
    if refusal is not None:
        return refusal
    if last is not None and seq <= last:  # the same content again: an unchanged retry
        return ReportAck(
            status="duplicate",
            node_id=report.node_id,
            stream=stream_name,
            sequence=seq,
            previous_sequence=last,
            gap=0,
            received_at=item.received_at,
            events=0,
        )
    gap = seq - (last or 0) - 1
    metadata = EventMetadata(
        received_at=item.received_at,
        source="agent",
        observed_at=report.observed_at,
        agent_stream=stream_name,
        agent_sequence=seq,
        agent_sent_at=item.sent_at,
        agent_report_sha256=item.digest,
        agent_sequence_gap=gap if gap > 0 else None,
        actor=f"credential:{principal.credential_id}",
    )
    identity = NodeIdentity(key=report.identity_key, source=report.identity_source)
    kept = {k: v for k, v in recent.items() if int(k) > seq - RECENT_REPORT_DIGESTS}
    kept[str(seq)] = item.digest
    events = reconcile_decision(identity, report.observation, metadata)(state)
    return AcceptedReport(events=events, last=last, gap=max(0, gap), recent=kept)


class EnrollmentService:
    def __init__(
        self,
        inventory: HardwareInventoryService,
        *,
        clock: Callable[[], datetime] = _utcnow,
        report_transactions: int = REPORT_TRANSACTIONS,
    ) -> None:
        self.inventory = inventory
        self.store = inventory.store
        self.nodes = inventory.nodes
        self.tokens: UnitOfWork[TokenState] = UnitOfWork(inventory.store, ENROLLMENT_TOKEN_PROJECTION)
        self.clock = clock
        # Credentials this process has verified: id -> (secret digest, principal). It only says
        # which node a presented secret belongs to; whether the credential is still valid is read
        # from the node's folded state under its stream lock by every report (`_accept_report`),
        # so a revocation by any server is honoured at once. Saves a query and a pool round per
        # report.
        self._verified: dict[str, tuple[str, Principal]] = {}
        # Two agent streams per node whose state is kept.
        self.positions = KeptPositions(2 * inventory.store.states.streams)
        # Concurrent reports of different nodes share transactions and statements
        # (ledger/group_commit.py), `report_transactions` of them at once (docs/capacity.md).
        self.reports: GroupCommit[ReportItem, ReportAck] = GroupCommit(
            inventory.store.pool, self._commit_reports, concurrency=report_transactions
        )

    @property
    def pool(self) -> asyncpg.Pool:
        return self.store.pool

    def _meta(self, source: Source, actor: str, now: datetime) -> EventMetadata:
        return EventMetadata(received_at=now, source=source, actor=actor)

    # --- enrollment tokens ---------------------------------------------------------------------

    async def create_token(
        self, ttl_seconds: float, uses: int, description: str = "", *, actor: str = "operator"
    ) -> TokenCreated:
        if not 1 <= ttl_seconds <= MAX_TOKEN_TTL.total_seconds():
            raise _invalid(f"ttl must be between 1 second and {MAX_TOKEN_TTL.days} days")
        if not 1 <= uses <= MAX_TOKEN_USES:
            raise _invalid(f"uses must be between 1 and {MAX_TOKEN_USES}")
        if len(description) > 200:
            raise _invalid("description is longer than 200 characters")
        token_id, token, digest = _mint(ENROLLMENT_TOKEN_PREFIX)
        now = self.clock()
        expires_at = now + timedelta(seconds=ttl_seconds)
        event = EnrollmentTokenCreated(
            token_id=token_id, secret_sha256=digest, expires_at=expires_at, uses=uses, description=description
        )
        async with self.tokens.open(enrollment_token_stream(token_id)) as stream:
            await stream.append([NewEvent(payload=event, metadata=self._meta("operator", actor, now))])
        log.info(
            "enrollment_token.created", enrollment_id=token_id, uses=uses, expires_at=expires_at.isoformat()
        )
        return TokenCreated(
            token_id=token_id, token=token, expires_at=expires_at, uses=uses, description=description
        )

    async def list_tokens(self) -> list[TokenBody]:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch("SELECT * FROM hw_enrollment_tokens ORDER BY created_at, token_id")
        now = self.clock()
        return [
            token_body(
                TokenState(
                    token_id=r["token_id"],
                    created=True,
                    description=r["description"],
                    uses=r["uses"],
                    used=r["uses"] - r["uses_left"],
                    created_at=r["created_at"],
                    expires_at=r["expires_at"],
                    last_used_at=r["last_used_at"],
                    revoked_at=r["revoked_at"],
                    revoked_reason=r["revoked_reason"],
                ),
                now,
            )
            for r in rows
        ]

    async def revoke_token(self, token_id: str, reason: str, *, actor: str = "operator") -> TokenBody:
        async with self.tokens.open(enrollment_token_stream(token_id)) as stream:
            if not stream.state.created:
                raise NotFound(
                    "enrollment-token-not-found", "Unknown enrollment token", f"no token {token_id!r}"
                )
            now = self.clock()
            if stream.state.revoked_at is None:
                await stream.append(
                    [
                        NewEvent(
                            payload=EnrollmentTokenRevoked(token_id=token_id, reason=reason[:200]),
                            metadata=self._meta("operator", actor, now),
                        )
                    ]
                )
            state = stream.state
        log.info("enrollment_token.revoked", enrollment_id=token_id)
        return token_body(state, now)

    # --- enrollment ------------------------------------------------------------------------------

    async def enroll(self, presented: str | None, request: EnrollRequest) -> EnrollResponse:
        try:
            return await self._enroll(presented, request)
        except NodeIsDecommissioned as exc:
            # Refused: the whole transaction rolled back, so the token's use is not spent.
            token_id = (parse_secret(presented, ENROLLMENT_TOKEN_PREFIX) or ("?", ""))[0]
            await self.inventory.record_revival_refused(
                exc.node_id, "enrollment", f"enrollment-token:{token_id}", exc.detail
            )
            raise

    async def check_enrollment_token(self, presented: str | None) -> None:
        """401 unless `presented` is the secret of a known enrollment token: run before the body
        is read, so an unauthenticated caller costs no parsing. Its state (revoked, expired, used
        up) is checked again under the token's lock by `enroll`."""
        parsed = parse_secret(presented, ENROLLMENT_TOKEN_PREFIX)
        if parsed is None:
            raise _unauthorized(
                "enrollment-token-invalid", "an enrollment token is required (Bearer mfe_...)"
            )
        async with self.pool.acquire() as conn:
            digest = await conn.fetchval(
                "SELECT secret_sha256 FROM hw_enrollment_tokens WHERE token_id = $1", parsed[0]
            )
        if digest is None or not _matches(parsed[1], digest):
            raise _unauthorized("enrollment-token-invalid", "the enrollment token is not valid")

    async def _enroll(self, presented: str | None, request: EnrollRequest) -> EnrollResponse:
        parsed = parse_secret(presented, ENROLLMENT_TOKEN_PREFIX)
        if parsed is None:
            raise _unauthorized(
                "enrollment-token-invalid", "an enrollment token is required (Bearer mfe_...)"
            )
        token_id, secret = parsed
        try:
            key = validate_identity_key(request.identity_key, what="identity_key")
        except IdentityError as exc:
            raise InvalidRequest("invalid-identity", "Invalid node identity", str(exc)) from exc
        if not request.hostname.strip():
            raise _invalid("hostname is empty")
        identity = NodeIdentity(key=key, source=request.identity_source)
        node_id = node_id_for(identity.key)
        async with self.pool.acquire() as conn:
            # The secret is checked before any lock: an unauthenticated caller serializes nothing.
            digest = await conn.fetchval(
                "SELECT secret_sha256 FROM hw_enrollment_tokens WHERE token_id = $1", token_id
            )
            if digest is None or not _matches(secret, digest):
                raise _unauthorized("enrollment-token-invalid", "the enrollment token is not valid")
            async with conn.transaction():
                # Token stream first, node stream second (the only order anything takes both).
                try:
                    async with self.tokens.open(enrollment_token_stream(token_id), conn=conn) as token:
                        now = self.clock()
                        refusal = token_refusal(token.state, now)
                        if refusal is not None:
                            raise refusal
                        async with open_node(self.nodes, node_id, conn=conn) as node:
                            response = await self._issue(token, node, identity, request, now)
                except StreamTombstoned as exc:  # a token stream is never tombstoned
                    raise RuntimeError(str(exc)) from exc
        log.info(
            "agent.enrolled",
            node_id=node_id,
            key_id=response.credential_id,
            enrollment_id=token_id,
            hostname=request.hostname,
            superseded=response.superseded_credentials,
        )
        return response

    async def _issue(
        self,
        token: OpenStream[TokenState],
        node: OpenStream[NodeState],
        identity: NodeIdentity,
        request: EnrollRequest,
        now: datetime,
    ) -> EnrollResponse:
        token_id = token.state.token_id
        node_id = node.stream_id
        credential_id, credential, credential_digest = _mint(CREDENTIAL_PREFIX)
        superseded = sorted(c.credential_id for c in node.state.credentials.values() if c.revoked_at is None)
        meta = self._meta("agent", f"enrollment-token:{token_id}", now)
        await token.append(
            [
                NewEvent(
                    payload=EnrollmentTokenUsed(
                        token_id=token_id, node_id=node_id, credential_id=credential_id
                    ),
                    metadata=meta,
                )
            ]
        )
        node_events: list[EventPayload] = [
            CredentialRevoked(credential_id=c, reason=f"superseded by credential {credential_id}")
            for c in superseded
        ]
        node_events.append(
            CredentialIssued(
                credential_id=credential_id,
                node_id=node_id,
                identity_key=identity.key,
                identity_source=identity.source,
                hostname=request.hostname.strip(),
                secret_sha256=credential_digest,
                enrollment_token_id=token_id,
            )
        )
        await node.append([NewEvent(payload=p, metadata=meta) for p in node_events])
        streams = {
            r["stream"]: r["last_sequence"]
            for r in await node.conn.fetch(
                "SELECT stream, last_sequence FROM agent_stream_positions WHERE node_id = $1", node_id
            )
        }
        return EnrollResponse(
            node_id=node_id,
            identity_key=identity.key,
            credential_id=credential_id,
            credential=credential,
            streams=streams,
            superseded_credentials=superseded,
        )

    # --- credentials -----------------------------------------------------------------------------

    async def authenticate(self, presented: str | None) -> Principal:
        parsed = parse_secret(presented, CREDENTIAL_PREFIX)
        if parsed is None:
            raise _unauthorized("credential-invalid", "a node credential is required (Bearer mfc_...)")
        credential_id, secret = parsed
        known = self._verified.get(credential_id)
        if known is not None and _matches(secret, known[0]):
            return known[1]
        row = await self._credential_row(credential_id)
        if row is None or not _matches(secret, row["secret_sha256"]):
            raise _unauthorized("credential-invalid", "the node credential is not valid")
        await self._refuse_if_revoked(credential_id, row)
        principal = Principal(
            credential_id=credential_id, node_id=row["node_id"], identity_key=row["identity_key"]
        )
        if len(self._verified) >= MAX_VERIFIED_CREDENTIALS:
            self._verified.clear()  # bounded: a fleet's live credentials are re-verified once each
        self._verified[credential_id] = (row["secret_sha256"], principal)
        return principal

    async def _credential_row(self, credential_id: str) -> asyncpg.Record | None:
        async with self.pool.acquire() as conn:
            row: asyncpg.Record | None = await conn.fetchrow(
                "SELECT c.node_id, c.identity_key, c.secret_sha256, c.revoked_at, s.tombstoned_at "
                "FROM hw_node_credentials c LEFT JOIN streams s ON s.stream_id = c.node_id "
                "WHERE c.credential_id = $1",
                credential_id,
            )
        return row

    async def _refuse_if_revoked(self, credential_id: str, row: asyncpg.Record) -> None:
        if row["revoked_at"] is None:
            return
        self._verified.pop(credential_id, None)
        if row["tombstoned_at"] is not None:
            # Revoked by the node's decommission: say so (410), so the agent stops for good.
            gone = NodeIsDecommissioned(row["node_id"], row["tombstoned_at"])
            await self.inventory.record_revival_refused(
                row["node_id"], "agent_report", f"credential:{credential_id}", gone.detail
            )
            raise gone
        raise _unauthorized("credential-revoked", "the node credential was revoked")

    async def _reverify(self, principal: Principal) -> None:
        """Before a report is refused on grounds other than its credential: a remembered
        credential that has since been revoked gets 401 (or 410) whatever it sent, as it would
        have without the memory."""
        row = await self._credential_row(principal.credential_id)
        if row is not None:
            await self._refuse_if_revoked(principal.credential_id, row)

    async def list_credentials(self, node_id: str | None = None) -> list[CredentialBody]:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT * FROM hw_node_credentials WHERE $1::text IS NULL OR node_id = $1 "
                "ORDER BY node_id, issued_at, credential_id",
                node_id,
            )
        return [
            credential_body(
                r["node_id"],
                CredentialState(
                    credential_id=r["credential_id"],
                    identity_key=r["identity_key"],
                    hostname=r["hostname"],
                    secret_sha256="",
                    enrollment_token_id=r["enrollment_token_id"],
                    issued_at=r["issued_at"],
                    position=0,
                    revoked_at=r["revoked_at"],
                    revoked_reason=r["revoked_reason"],
                ),
            )
            for r in rows
        ]

    async def revoke_credential(
        self, credential_id: str, reason: str, *, actor: str = "operator"
    ) -> CredentialBody:
        async with self.pool.acquire() as conn:
            node_id = await conn.fetchval(
                "SELECT node_id FROM hw_node_credentials WHERE credential_id = $1", credential_id
            )
        if node_id is None:
            raise NotFound("credential-not-found", "Unknown credential", f"no credential {credential_id!r}")
        try:
            credential = await self._revoke(node_id, credential_id, reason, actor)
        except NodeIsDecommissioned:
            # The tombstone revoked every credential of the node already: show it as it stands.
            return next(c for c in await self.list_credentials(node_id) if c.credential_id == credential_id)
        log.info("credential.revoked", node_id=node_id, key_id=credential_id)
        return credential_body(node_id, credential)

    async def _revoke(self, node_id: str, credential_id: str, reason: str, actor: str) -> CredentialState:
        async with open_node(self.nodes, node_id) as node:
            if node.state.credentials[credential_id].revoked_at is None:
                await node.append(
                    [
                        NewEvent(
                            payload=CredentialRevoked(credential_id=credential_id, reason=reason[:200]),
                            metadata=self._meta("operator", actor, self.clock()),
                        )
                    ]
                )
            return node.state.credentials[credential_id]

    async def list_streams(self, node_id: str | None = None) -> list[AgentStreamBody]:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT * FROM agent_stream_positions WHERE $1::text IS NULL OR node_id = $1 "
                "ORDER BY node_id, stream",
                node_id,
            )
        return [
            AgentStreamBody(
                node_id=r["node_id"],
                stream=r["stream"],
                last_sequence=r["last_sequence"],
                reports=r["reports"],
                skipped=r["skipped"],
                last_observed_at=r["last_observed_at"],
                last_received_at=r["last_received_at"],
            )
            for r in rows
        ]

    # --- reports ---------------------------------------------------------------------------------

    async def accept_report(self, principal: Principal, raw: bytes, sent_at: datetime | None) -> ReportAck:
        """Validate, check the sequence, and reconcile one report: one unit of work on the node's
        stream (one lock, one state load, one append, one fold). Nothing is appended unless the
        report is accepted (a report for a decommissioned node is refused and audited in a stream
        of its own)."""
        try:
            return await self._accept_report(principal, raw, sent_at)
        except (InvalidRequest, Forbidden):
            await self._reverify(principal)
            raise
        except NodeIsDecommissioned as exc:
            await self.inventory.record_revival_refused(
                principal.node_id, "agent_report", f"credential:{principal.credential_id}", exc.detail
            )
            raise

    async def _accept_report(self, principal: Principal, raw: bytes, sent_at: datetime | None) -> ReportAck:
        received_at = self.clock()
        try:
            report = decode_report(raw)
        except msgspec.ValidationError as exc:  # a DecodeError too: catch it first
            raise InvalidRequest(
                "validation-failed",
                "Request validation failed",
                "the report does not match the schema",
                errors=[str(exc)],
            ) from exc
        except msgspec.DecodeError as exc:
            raise InvalidRequest("malformed-json", "Malformed JSON", str(exc)) from exc
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
        digest = hashlib.sha256(raw).hexdigest()
        item = ReportItem(principal, report, digest, received_at, sent_at)
        ack = await self.reports.run(report.node_id, item)
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
        five where every node's state and position was kept (`_commit_kept`)."""
        kept = self._decide_kept(items)
        if kept is not None:
            done = await self._commit_kept(conn, items, *kept)
            if done is not None:
                return done
        node_ids = [i.report.node_id for i in items]
        opened = await self.nodes.open_many(conn, node_ids)
        rows = await conn.fetch(_POSITIONS_SQL, node_ids, [i.report.stream for i in items])
        positions = {(r["node_id"], r["stream"]): r for r in rows}
        outcomes: list[ReportAck | BaseException | None] = []
        accepted: list[tuple[int, OpenStream[NodeState], ReportItem, AcceptedReport]] = []
        for k, item in enumerate(items):
            node = opened[item.report.node_id]
            if isinstance(node, StreamTombstoned):
                outcomes.append(NodeIsDecommissioned(node.stream_id, node.tombstoned_at))
                continue
            row = positions.get((item.report.node_id, item.report.stream))
            last: int | None = row["last_sequence"] if row is not None else None
            recent: dict[str, str] = (row["recent"] if row is not None else None) or {}
            decision = decide_report(node.state, item, last, recent)
            if isinstance(decision, AcceptedReport):
                accepted.append((k, node, item, decision))
            elif row is not None:  # kept as read; an accepted report's position is kept as advanced
                self.positions.keep(
                    item.report.node_id,
                    item.report.stream,
                    row["last_sequence"],
                    recent,
                    row["written"],
                    node.state,
                )
            outcomes.append(None if isinstance(decision, AcceptedReport) else decision)
        if accepted:
            await self._append_accepted(conn, accepted, outcomes)
        return [o for o in outcomes if o is not None]

    def _decide_kept(
        self, items: Sequence[ReportItem]
    ) -> tuple[KeptStreams[NodeState], list[tuple[KeptPosition, AcceptedReport]]] | None:
        """Every report of the batch decided on its node's kept state and its stream's kept
        position, before anything is sent; None unless all of them are kept and every report is
        accepted with events to append (a refusal or a retry goes the usual way, on what it reads)."""
        streams = self.nodes.kept([i.report.node_id for i in items])
        if streams is None or streams.stream_ids != [i.report.node_id for i in items]:
            return None
        decided: list[tuple[KeptPosition, AcceptedReport]] = []
        for item, node in zip(items, streams.kept, strict=True):
            state = streams.states[item.report.node_id]
            position = self.positions.get(item.report.node_id, item.report.stream)
            if (
                position is None
                or (position.node_version, position.node_position) != (node.version, node.position)
                or state.decommissioned_at is not None
            ):
                return None
            recent = msgspec.json.decode(position.recent, type=dict[str, str])
            decision = decide_report(state, item, position.last_sequence, recent)
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
        rows = await conn.fetch(
            _ADVANCE_KEPT_SQL,
            [i.report.node_id for i in items],
            [i.report.stream for i in items],
            [i.report.sequence for i in items],
            [d.gap for _p, d in decided],
            [d.recent for _p, d in decided],
            [i.report.observed_at for i in items],
            [i.received_at for i in items],
            [p.written for p, _d in decided],
        )
        if len(rows) != len(items):
            self.positions.stale += 1
            for item in items:
                self.positions.drop(item.report.node_id, item.report.stream)
            raise TryAgain("a kept stream position is not the stored one")
        written = {(r["node_id"], r["stream"]): r["written"] for r in rows}
        acks: list[ReportAck | BaseException] = []
        for item, (_p, d), node, done in zip(items, decided, streams.kept, committed, strict=True):
            key = (item.report.node_id, item.report.stream)
            self.positions.keep(*key, item.report.sequence, d.recent, written[key], done.state)
            self.positions.carry(*key, (node.version, node.position), done.state)
            self.inventory.reconciled(item.report.node_id, done, "agent")
            acks.append(_accepted_ack(item, d, done))
        return acks

    async def _append_accepted(
        self,
        conn: asyncpg.Connection,
        accepted: list[tuple[int, OpenStream[NodeState], ReportItem, AcceptedReport]],
        outcomes: list[ReportAck | BaseException | None],
    ) -> None:
        # The checkpoints decided on: the append moves each open stream's state on.
        before = [(node.state.stream_version, node.state.position) for _k, node, _i, _d in accepted]
        committed = await self.nodes.append_many(conn, [(node, d.events) for _k, node, _i, d in accepted])
        rows = await conn.fetch(
            _ADVANCE_MANY_SQL,
            [i.report.node_id for _k, _n, i, _d in accepted],
            [i.report.stream for _k, _n, i, _d in accepted],
            [i.report.sequence for _k, _n, i, _d in accepted],
            [d.gap for _k, _n, _i, d in accepted],
            [d.recent for _k, _n, _i, d in accepted],
            [i.report.observed_at for _k, _n, i, _d in accepted],
            [i.received_at for _k, _n, i, _d in accepted],
        )
        written = {(r["node_id"], r["stream"]): r["written"] for r in rows}
        for (k, node, item, d), was, done in zip(accepted, before, committed, strict=True):
            key = (item.report.node_id, item.report.stream)
            self.positions.keep(*key, item.report.sequence, d.recent, written[key], done.state)
            self.positions.carry(*key, was, done.state)
            self.inventory.reconciled(node.stream_id, done, "agent")
            outcomes[k] = _accepted_ack(item, d, done)
