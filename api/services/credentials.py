"""Node credentials (docs/NODE_AGENT_PROTOCOL.md): issued at enrollment onto the node's stream,
presented by the agent as `mfc_<credential id>_<secret>` with every report, listed and revoked by
an operator; and the agents' stream positions, shown to an operator.

Only the secret's SHA-256 is stored (in `CREDENTIAL_ISSUED` and its read model
`hw_node_credentials`); a presented secret is looked up by its id and compared in constant time
(runtime/secrets.py). Nothing here logs a secret.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Literal

import asyncpg
import msgspec
import structlog

from agent.protocol import CREDENTIAL_PREFIX, EnrollResponse
from api.services.clock import central_now
from api.services.errors import NodeIsDecommissioned, NotFound, unauthenticated
from api.services.inventory import HardwareInventoryService, open_node
from collectors.identity import NodeIdentity
from domain.node import CredentialState, NodeState
from ledger.events import CredentialIssued, CredentialRevoked, EventMetadata, EventPayload, NewEvent
from ledger.unit_of_work import OpenStream
from runtime.secrets import MintedSecret, matches, mint, parse

log = structlog.get_logger(__name__)

# Credentials remembered as verified per process (about one per node of the fleet).
MAX_VERIFIED_CREDENTIALS = 100_000


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


def new_credential() -> MintedSecret:
    """A node credential's id, the credential (shown to its agent once) and its stored digest."""
    return mint(CREDENTIAL_PREFIX)


class CredentialService:
    def __init__(
        self, inventory: HardwareInventoryService, *, clock: Callable[[], datetime] = central_now
    ) -> None:
        self.inventory = inventory
        self.nodes = inventory.nodes
        self.clock = clock
        # Credentials this process has verified: id -> (secret digest, principal). It only says
        # which node a presented secret belongs to; whether the credential is still valid is read
        # from the node's folded state under its stream lock by every report
        # (domain.report_decisions.decide_report), so a revocation by any server is honoured at
        # once. Saves a query and a pool round per report.
        self._verified: dict[str, tuple[str, Principal]] = {}

    @property
    def pool(self) -> asyncpg.Pool:
        return self.inventory.pool

    async def issue(
        self,
        node: OpenStream[NodeState],
        identity: NodeIdentity,
        hostname: str,
        enrollment_token_id: str,
        credential: MintedSecret,
        metadata: EventMetadata,
    ) -> EnrollResponse:
        """Append the new credential to the node's stream (its live credentials revoked as
        superseded, in the same append), under the enrollment's transaction: the agent's answer."""
        node_id = node.stream_id
        superseded = sorted(c.credential_id for c in node.state.credentials.values() if c.revoked_at is None)
        payloads: list[EventPayload] = [
            CredentialRevoked(credential_id=c, reason=f"superseded by credential {credential.ident}")
            for c in superseded
        ]
        payloads.append(
            CredentialIssued(
                credential_id=credential.ident,
                node_id=node_id,
                identity_key=identity.key,
                identity_source=identity.source,
                hostname=hostname,
                secret_sha256=credential.sha256,
                enrollment_token_id=enrollment_token_id,
            )
        )
        await node.append([NewEvent(payload=p, metadata=metadata) for p in payloads])
        streams = {
            r["stream"]: r["last_sequence"]
            for r in await node.conn.fetch(
                "SELECT stream, last_sequence FROM agent_stream_positions WHERE node_id = $1", node_id
            )
        }
        return EnrollResponse(
            node_id=node_id,
            identity_key=identity.key,
            credential_id=credential.ident,
            credential=credential.token,
            streams=streams,
            superseded_credentials=superseded,
        )

    async def authenticate(self, presented: str | None) -> Principal:
        parsed = parse(presented, CREDENTIAL_PREFIX)
        if parsed is None:
            raise unauthenticated("credential-invalid", "a node credential is required (Bearer mfc_...)")
        credential_id = parsed.ident
        known = self._verified.get(credential_id)
        if known is not None and matches(parsed.secret, known[0]):
            return known[1]
        row = await self._credential_row(credential_id)
        if row is None or not matches(parsed.secret, row["secret_sha256"]):
            raise unauthenticated("credential-invalid", "the node credential is not valid")
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
        raise unauthenticated("credential-revoked", "the node credential was revoked")

    async def reverify(self, principal: Principal) -> None:
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
                metadata = EventMetadata(received_at=self.clock(), source="operator", actor=actor)
                revoked = CredentialRevoked(credential_id=credential_id, reason=reason[:200])
                await node.append([NewEvent(payload=revoked, metadata=metadata)])
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
