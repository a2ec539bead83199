"""Read models of the agent plane (docs/NODE_AGENT_PROTOCOL.md).

- `hw_node_credentials` holds rows of the node's folded state (`domain.node.NodeState.credentials`);
  the inventory projection writes them (see `agent_rows`), so no second state is loaded per append.
- `hw_enrollment_tokens` is its own projection over the enrollment-token streams (one stream per
  token), which the inventory projection does not handle.

Both hold SHA-256 digests of 256-bit random secrets, never a secret. (The last accepted sequence
per agent stream is not a read model: see `agent_stream_positions` in schema.sql.)
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import msgspec

from domain.node import NodeState
from ledger.events import (
    EnrollmentTokenCreated,
    EnrollmentTokenRevoked,
    EnrollmentTokenUsed,
    RecordedEvent,
    is_enrollment_token_stream,
)
from projections.framework import Projection, Row, Rows, TableSpec

CREDENTIALS = TableSpec(
    name="hw_node_credentials",
    columns=(
        "credential_id",
        "node_id",
        "identity_key",
        "hostname",
        "secret_sha256",
        "enrollment_token_id",
        "issued_at",
        "revoked_at",
        "revoked_reason",
        "position",
    ),
    key=("credential_id",),
)
ENROLLMENT_TOKENS = TableSpec(
    name="hw_enrollment_tokens",
    columns=(
        "token_id",
        "secret_sha256",
        "description",
        "uses",
        "uses_left",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
        "revoked_reason",
        "stream_version",
        "position",
    ),
    key=("token_id",),
)


def agent_rows(state: NodeState) -> dict[str, Sequence[Row]]:
    """The node's credential rows (written by the inventory projection)."""
    s = state
    return {
        CREDENTIALS.name: [
            (
                c.credential_id,
                s.node_id,
                c.identity_key,
                c.hostname,
                c.secret_sha256,
                c.enrollment_token_id,
                c.issued_at,
                c.revoked_at,
                c.revoked_reason,
                c.position,
            )
            for c in s.credentials.values()
        ],
    }


class TokenState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    token_id: str
    stream_version: int = 0
    position: int = 0
    created: bool = False
    secret_sha256: str = ""
    description: str = ""
    uses: int = 0
    used: int = 0
    created_at: datetime | None = None
    expires_at: datetime | None = None
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None
    revoked_reason: str | None = None


class EnrollmentTokenProjection(Projection[TokenState]):
    name = "enrollment_tokens"
    tables = (ENROLLMENT_TOKENS,)
    state_type = TokenState

    def handles(self, stream_id: str) -> bool:
        return is_enrollment_token_stream(stream_id)

    def initial(self, stream_id: str) -> TokenState:
        return TokenState(token_id="")

    def checkpoint_of(self, state: TokenState) -> tuple[int, int]:
        return state.stream_version, state.position

    def fold(self, state: TokenState, event: RecordedEvent) -> TokenState:
        p = event.payload
        at = event.metadata.received_at
        s = msgspec.structs.replace(
            state, stream_version=event.stream_version, position=event.global_position
        )
        match p:
            case EnrollmentTokenCreated():
                s = msgspec.structs.replace(
                    s,
                    token_id=p.token_id,
                    created=True,
                    secret_sha256=p.secret_sha256,
                    description=p.description,
                    uses=p.uses,
                    created_at=at,
                    expires_at=p.expires_at,
                )
            case EnrollmentTokenUsed():
                s = msgspec.structs.replace(s, used=s.used + 1, last_used_at=at)
            case EnrollmentTokenRevoked():
                if s.revoked_at is None:
                    s = msgspec.structs.replace(s, revoked_at=at, revoked_reason=p.reason)
            case _:
                pass
        return s

    def rows(self, state: TokenState) -> Rows:
        s = state
        if not s.created:
            return {}
        return {
            ENROLLMENT_TOKENS.name: [
                (
                    s.token_id,
                    s.secret_sha256,
                    s.description,
                    s.uses,
                    max(0, s.uses - s.used),
                    s.created_at,
                    s.expires_at,
                    s.last_used_at,
                    s.revoked_at,
                    s.revoked_reason,
                    s.stream_version,
                    s.position,
                )
            ]
        }


ENROLLMENT_TOKEN_PROJECTION = EnrollmentTokenProjection()
