"""Enrollment tokens and enrollment (docs/NODE_AGENT_PROTOCOL.md): an operator creates a token
`mfe_<token id>_<secret>` (shown once, only its secret's SHA-256 stored), an agent exchanges it
for a node credential (api/services/credentials.py issues it).

Every write is events appended under the stream lock, with the read models updated in the same
transaction: a token's creation and revocation on its own stream `enrollment-token-<id>`; an
enrollment as ENROLLMENT_TOKEN_USED on the token's stream (locked first, so uses are counted
exactly, across API processes) and the credential's events on the node's stream (locked second).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Annotated, Literal

import asyncpg
import msgspec
import structlog

from agent.protocol import ENROLLMENT_TOKEN_PREFIX, EnrollRequest, EnrollResponse
from api.services.clock import central_now
from api.services.credentials import CredentialService, new_credential
from api.services.errors import (
    InvalidRequest,
    NodeIsDecommissioned,
    NotFound,
    Unauthenticated,
    invalid_parameter,
    unauthenticated,
)
from api.services.inventory import HardwareInventoryService, open_node
from collectors.identity import IdentityError, NodeIdentity, validate_identity_key
from domain.node import node_id_for
from domain.report_decisions import TokenRefusal, token_refusal
from ledger.events import (
    EnrollmentTokenCreated,
    EnrollmentTokenRevoked,
    EnrollmentTokenUsed,
    EventMetadata,
    NewEvent,
    enrollment_token_stream,
)
from ledger.store import StreamTombstoned
from ledger.unit_of_work import UnitOfWork
from projections.agent import ENROLLMENT_TOKEN_PROJECTION, TokenState
from runtime.secrets import matches, mint, parse

log = structlog.get_logger(__name__)

MAX_TOKEN_TTL = timedelta(days=30)
MAX_TOKEN_USES = 100_000


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


def _refused(refusal: TokenRefusal) -> Unauthenticated:
    return unauthenticated(refusal.problem, refusal.detail)


def _token_required() -> Unauthenticated:
    return unauthenticated("enrollment-token-invalid", "an enrollment token is required (Bearer mfe_...)")


def _token_invalid() -> Unauthenticated:
    return unauthenticated("enrollment-token-invalid", "the enrollment token is not valid")


class EnrollmentService:
    def __init__(
        self,
        inventory: HardwareInventoryService,
        credentials: CredentialService,
        *,
        clock: Callable[[], datetime] = central_now,
    ) -> None:
        self.inventory = inventory
        self.credentials = credentials
        self.nodes = inventory.nodes
        self.tokens: UnitOfWork[TokenState] = UnitOfWork(inventory.store, ENROLLMENT_TOKEN_PROJECTION)
        self.clock = clock

    @property
    def pool(self) -> asyncpg.Pool:
        return self.inventory.pool

    # --- enrollment tokens ---------------------------------------------------------------------

    async def create_token(
        self, ttl_seconds: float, uses: int, description: str = "", *, actor: str = "operator"
    ) -> TokenCreated:
        if not 1 <= ttl_seconds <= MAX_TOKEN_TTL.total_seconds():
            raise invalid_parameter(f"ttl must be between 1 second and {MAX_TOKEN_TTL.days} days")
        if not 1 <= uses <= MAX_TOKEN_USES:
            raise invalid_parameter(f"uses must be between 1 and {MAX_TOKEN_USES}")
        if len(description) > 200:
            raise invalid_parameter("description is longer than 200 characters")
        minted = mint(ENROLLMENT_TOKEN_PREFIX)
        now = self.clock()
        expires_at = now + timedelta(seconds=ttl_seconds)
        event = EnrollmentTokenCreated(
            token_id=minted.ident,
            secret_sha256=minted.sha256,
            expires_at=expires_at,
            uses=uses,
            description=description,
        )
        metadata = EventMetadata(received_at=now, source="operator", actor=actor)
        async with self.tokens.open(enrollment_token_stream(minted.ident)) as stream:
            await stream.append([NewEvent(payload=event, metadata=metadata)])
        log.info(
            "enrollment_token.created",
            enrollment_id=minted.ident,
            uses=uses,
            expires_at=expires_at.isoformat(),
        )
        return TokenCreated(
            token_id=minted.ident,
            token=minted.token,
            expires_at=expires_at,
            uses=uses,
            description=description,
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
                metadata = EventMetadata(received_at=now, source="operator", actor=actor)
                revoked = EnrollmentTokenRevoked(token_id=token_id, reason=reason[:200])
                await stream.append([NewEvent(payload=revoked, metadata=metadata)])
            state = stream.state
        log.info("enrollment_token.revoked", enrollment_id=token_id)
        return token_body(state, now)

    # --- enrollment ------------------------------------------------------------------------------

    async def enroll(self, presented: str | None, request: EnrollRequest) -> EnrollResponse:
        try:
            return await self._enroll(presented, request)
        except NodeIsDecommissioned as exc:
            # Refused: the whole transaction rolled back, so the token's use is not spent.
            parsed = parse(presented, ENROLLMENT_TOKEN_PREFIX)
            token_id = parsed.ident if parsed is not None else "?"
            await self.inventory.record_revival_refused(
                exc.node_id, "enrollment", f"enrollment-token:{token_id}", exc.detail
            )
            raise

    async def check_enrollment_token(self, presented: str | None) -> None:
        """401 unless `presented` is the secret of a known enrollment token: run before the body
        is read, so an unauthenticated caller costs no parsing. Its state (revoked, expired, used
        up) is checked again under the token's lock by `enroll`."""
        parsed = parse(presented, ENROLLMENT_TOKEN_PREFIX)
        if parsed is None:
            raise _token_required()
        async with self.pool.acquire() as conn:
            digest = await conn.fetchval(
                "SELECT secret_sha256 FROM hw_enrollment_tokens WHERE token_id = $1", parsed.ident
            )
        if digest is None or not matches(parsed.secret, digest):
            raise _token_invalid()

    async def _enroll(self, presented: str | None, request: EnrollRequest) -> EnrollResponse:
        parsed = parse(presented, ENROLLMENT_TOKEN_PREFIX)
        if parsed is None:
            raise _token_required()
        token_id = parsed.ident
        try:
            key = validate_identity_key(request.identity_key, what="identity_key")
        except IdentityError as exc:
            raise InvalidRequest("invalid-identity", "Invalid node identity", str(exc)) from exc
        if not request.hostname.strip():
            raise invalid_parameter("hostname is empty")
        identity = NodeIdentity(key=key, source=request.identity_source)
        node_id = node_id_for(identity.key)
        async with self.pool.acquire() as conn:
            # The secret is checked before any lock: an unauthenticated caller serializes nothing.
            digest = await conn.fetchval(
                "SELECT secret_sha256 FROM hw_enrollment_tokens WHERE token_id = $1", token_id
            )
            if digest is None or not matches(parsed.secret, digest):
                raise _token_invalid()
            async with conn.transaction():
                # Token stream first, node stream second (the only order anything takes both).
                try:
                    async with self.tokens.open(enrollment_token_stream(token_id), conn=conn) as token:
                        now = self.clock()
                        refusal = token_refusal(token.state, now)
                        if refusal is not None:
                            raise _refused(refusal)
                        async with open_node(self.nodes, node_id, conn=conn) as node:
                            credential = new_credential()
                            metadata = EventMetadata(
                                received_at=now, source="agent", actor=f"enrollment-token:{token_id}"
                            )
                            used = EnrollmentTokenUsed(
                                token_id=token_id, node_id=node_id, credential_id=credential.ident
                            )
                            await token.append([NewEvent(payload=used, metadata=metadata)])
                            response = await self.credentials.issue(
                                node, identity, request.hostname.strip(), token_id, credential, metadata
                            )
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
