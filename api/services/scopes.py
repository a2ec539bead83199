"""Operator token scopes: the admin token may do everything; a `viewer` token may only read.

A viewer token (`mfv_<id>_<secret>`, minted by `modelforge-hw viewer-token create`) reads metrics,
the inventory (nodes, accelerators, leases), the audit log and the service discovery targets:
GET/HEAD on `/metrics`, `/api/v1/hardware/...` and `/api/v1/sd/...`. Every other operator route
(refresh, enrollment tokens, credentials, agent streams, leases and decommission writes) answers
403 problem+json `insufficient-scope` to it, so a Prometheus server or a dashboard holds a
credential that cannot change the fleet.

Only the SHA-256 of the secret is stored (table `operator_tokens`); revocation and expiry are
checked on every request, nothing is cached.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec

from runtime.secrets import matches, mint, parse

PREFIX = "mfv"
READ_METHODS = frozenset({"GET", "HEAD"})
READ_PATHS = ("/metrics", "/api/v1/hardware/", "/api/v1/sd/")


class ViewerToken(msgspec.Struct, frozen=True):
    token_id: str
    scope: str
    description: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    status: str


class ViewerTokenCreated(msgspec.Struct, frozen=True):
    token: str
    token_id: str
    scope: str
    expires_at: datetime | None


class UnknownToken(LookupError):
    pass


def viewer_may(method: str, path: str) -> bool:
    """What a viewer token may do: read metrics, the hardware inventory and audit log, and the
    service discovery targets (Prometheus' http_sd)."""
    return method.upper() in READ_METHODS and (path == "/metrics" or path.startswith(READ_PATHS[1:]))


def _status(revoked_at: datetime | None, expires_at: datetime | None, now: datetime) -> str:
    if revoked_at is not None:
        return "revoked"
    if expires_at is not None and expires_at <= now:
        return "expired"
    return "active"


class OperatorTokens:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def create(self, *, ttl_seconds: float | None, description: str = "") -> ViewerTokenCreated:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError("the lifetime must be positive")
        minted = mint(PREFIX)
        expires = None if ttl_seconds is None else datetime.now(UTC) + timedelta(seconds=ttl_seconds)
        async with self.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO operator_tokens (token_id, scope, secret_sha256, description, expires_at) "
                "VALUES ($1, 'viewer', $2, $3, $4)",
                minted.ident,
                minted.sha256,
                description,
                expires,
            )
        return ViewerTokenCreated(minted.token, minted.ident, "viewer", expires)

    async def scope_of(self, presented: str) -> str | None:
        """The scope of a live viewer token, or None (unknown, wrong secret, revoked, expired)."""
        parsed = parse(presented, PREFIX)
        if parsed is None:
            return None
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT scope, secret_sha256 FROM operator_tokens WHERE token_id = $1 "
                "AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())",
                parsed.ident,
            )
        if row is None or not matches(parsed.secret, row["secret_sha256"]):
            return None
        scope: str = row["scope"]
        return scope

    async def list(self) -> list[ViewerToken]:
        now = datetime.now(UTC)
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT token_id, scope, description, created_at, expires_at, revoked_at "
                "FROM operator_tokens ORDER BY created_at, token_id"
            )
        return [ViewerToken(**dict(r), status=_status(r["revoked_at"], r["expires_at"], now)) for r in rows]

    async def revoke(self, token_id: str) -> ViewerToken:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(
                "UPDATE operator_tokens SET revoked_at = coalesce(revoked_at, now()) WHERE token_id = $1 "
                "RETURNING token_id, scope, description, created_at, expires_at, revoked_at",
                token_id,
            )
        if row is None:
            raise UnknownToken(f"no viewer token with id {token_id}")
        return ViewerToken(**dict(row), status="revoked")
