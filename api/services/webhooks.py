"""Webhook subscriptions (docs/integrations.md, "Webhooks"): create, list, show, delete, resume,
and their recent delivery attempts. Delivery itself is api/services/webhook_delivery.py.

Every write is one transaction: the audit event on the stream `webhooks` (WEBHOOK_SUBSCRIBED,
WEBHOOK_UNSUBSCRIBED, WEBHOOK_RESUMED) and the subscription's row. The signing secret goes to
`webhook_secrets` only: never into an event, a listing or a log line.

A subscription starts at its own commit: the events committed after it (in the log's commit
order) that match it are delivered, the history before it is not.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Annotated

import asyncpg
import msgspec
import structlog

from api.services.clock import central_now
from api.services.errors import InvalidRequest, NotFound
from api.services.reads.cursors import decode_deliveries_cursor, encode_deliveries_cursor
from domain.webhooks import Destination, UrlRefusal, parse_url, refused_address, signing_key
from ledger.events import (
    EVENT_TYPES,
    WEBHOOKS_STREAM,
    EventClass,
    EventMetadata,
    NewEvent,
    WebhookResumed,
    WebhookSubscribed,
    WebhookUnsubscribed,
)
from ledger.store import EventStore

log = structlog.get_logger(__name__)

CONNECT_PROBE_SECONDS = 3.0
MAX_DELIVERIES_PAGE = 500
_BEYOND_EVERY_ID = 2**63 - 1  # bigint's largest: a first page starts below it


class WebhookCreateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    secret: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    # Absent: every lifecycle event (telemetry samples only when asked for by class or type).
    event_types: list[str] | None = None
    event_classes: list[EventClass] | None = None
    node_id: Annotated[str, msgspec.Meta(min_length=1, max_length=200)] | None = None
    description: Annotated[str, msgspec.Meta(max_length=200)] = ""


class WebhookBody(msgspec.Struct, frozen=True):
    """A subscription as listed: never its secret."""

    subscription_id: str
    url: str
    event_types: list[str]
    event_classes: list[str]
    node_id: str | None
    description: str
    state: str
    created_at: datetime
    deleted_at: datetime | None
    delivered: int
    rejected: int
    retried: int
    attempts: int
    next_attempt_at: datetime | None
    failing_since: datetime | None
    last_error: str | None
    last_delivered_at: datetime | None
    last_position: int | None


class DeliveryBody(msgspec.Struct, frozen=True):
    delivery_id: int
    global_position: int
    event_type: str
    attempt: int
    outcome: str
    status_code: int | None
    duration_ms: float
    response_body: str | None
    error: str | None
    attempted_at: datetime


class DeliveryPage(msgspec.Struct, frozen=True):
    """A page of a subscription's delivery attempts, newest first; `next_cursor` continues with the
    older ones (None: this page has the oldest kept)."""

    items: list[DeliveryBody]
    next_cursor: str | None


_COLUMNS = (
    "subscription_id, url, event_types, event_classes, node_id, description, state, created_at, "
    "deleted_at, delivered, rejected, retried, attempts, next_attempt_at, failing_since, last_error, "
    "last_delivered_at, last_position"
)


def webhook_body(row: asyncpg.Record) -> WebhookBody:
    return WebhookBody(**{k: row[k] for k in _COLUMNS.split(", ")})


def _invalid(field: str, detail: str) -> InvalidRequest:
    return InvalidRequest(
        "invalid-webhook", "Invalid webhook subscription", f"{field}: {detail}", field=field
    )


def _not_found(subscription_id: str) -> NotFound:
    return NotFound(
        "webhook-not-found", "Unknown webhook subscription", f"no webhook subscription {subscription_id!r}"
    )


async def resolve_destination(destination: Destination, *, allow_private: bool) -> list[str]:
    """The destination's addresses; UrlRefusal when its host does not resolve or any address is
    one the server must not send to (SSRF) unless `allow_private`. Every address is checked, so a
    name that also resolves to a private address is refused."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(CONNECT_PROBE_SECONDS):
            infos = await loop.getaddrinfo(destination.host, destination.port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError) as exc:
        raise UrlRefusal(f"host {destination.host!r} does not resolve ({exc})") from None
    addresses = sorted({str(info[4][0]) for info in infos})
    if not allow_private:
        for address in addresses:
            why = refused_address(address)
            if why is not None:
                raise UrlRefusal(
                    f"{destination.host} resolves to {address} ({why}); such destinations are "
                    "refused unless MODELFORGE_WEBHOOK_ALLOW_PRIVATE=1"
                )
    return addresses


async def _probe(destination: Destination, address: str) -> None:
    try:
        async with asyncio.timeout(CONNECT_PROBE_SECONDS):
            _, writer = await asyncio.open_connection(address, destination.port)
    except (OSError, TimeoutError) as exc:
        raise UrlRefusal(
            f"{destination.host}:{destination.port} is unreachable ({exc or 'timed out'})"
        ) from None
    writer.close()
    await writer.wait_closed()


class WebhookService:
    def __init__(
        self,
        store: EventStore,
        *,
        allow_private: bool = False,
        clock: Callable[[], datetime] = central_now,
    ) -> None:
        self.store = store
        self.pool: asyncpg.Pool = store.pool
        self.allow_private = allow_private
        self.clock = clock
        # Told of every change in this process (the delivery worker wakes at once; other servers
        # notice at their next scan).
        self.changed: Callable[[], None] = lambda: None

    async def _validated(
        self, request: WebhookCreateRequest
    ) -> tuple[Destination, list[str], list[EventClass]]:
        try:
            destination = parse_url(request.url)
        except UrlRefusal as exc:
            raise _invalid("url", str(exc)) from None
        try:
            signing_key(request.secret)
        except ValueError as exc:
            raise _invalid("secret", str(exc)) from None
        if request.node_id is not None:
            async with self.pool.acquire() as conn:
                known = await conn.fetchval("SELECT 1 FROM hw_nodes WHERE node_id = $1", request.node_id)
            if known is None:
                # A subscription to no node's stream would be accepted and never deliver anything.
                raise _invalid(
                    "node_id", f"no node {request.node_id!r}: give a node's id (GET /api/v1/hardware/nodes)"
                )
        types = list(dict.fromkeys(request.event_types or []))
        unknown = [t for t in types if t not in EVENT_TYPES]
        if unknown:
            raise _invalid("event_types", f"unknown event type {unknown[0]!r} (docs/event-catalog.md)")
        classes: list[EventClass] = list(dict.fromkeys(request.event_classes or []))
        if not types and not classes:
            classes = ["lifecycle"]
        try:
            addresses = await resolve_destination(destination, allow_private=self.allow_private)
            await _probe(destination, addresses[0])
        except UrlRefusal as exc:
            raise _invalid("url", str(exc)) from None
        return destination, types, classes

    def _metadata(self, actor: str) -> EventMetadata:
        return EventMetadata(received_at=self.clock(), source="operator", actor=actor)

    async def create(self, request: WebhookCreateRequest, *, actor: str = "operator") -> WebhookBody:
        """Validate everything first (nothing is stored for a refused request), then record the
        subscription and its event in one transaction."""
        destination, types, classes = await self._validated(request)
        subscription_id = "wh_" + uuid.uuid4().hex[:16]
        event = WebhookSubscribed(
            subscription_id=subscription_id,
            destination=f"{destination.scheme}://{destination.host}:{destination.port}",
            url_sha256=hashlib.sha256(request.url.encode("utf-8")).hexdigest(),
            event_types=types,
            event_classes=classes,
            node_id=request.node_id,
            description=request.description,
        )
        async with self.pool.acquire() as conn, conn.transaction():
            result = await self.store.append(
                WEBHOOKS_STREAM, None, [NewEvent(payload=event, metadata=self._metadata(actor))], conn=conn
            )
            # The cursor starts at the subscription's own event: what commits after it is delivered.
            row = await conn.fetchrow(
                "INSERT INTO webhook_subscriptions (subscription_id, url, event_types, event_classes, "
                "node_id, description, cursor_tx_id, cursor_position) "
                "VALUES ($1, $2, $3, $4, $5, $6, pg_current_xact_id(), $7) RETURNING " + _COLUMNS,
                subscription_id,
                request.url,
                types,
                classes,
                request.node_id,
                request.description,
                result.events[-1].global_position,
            )
            await conn.execute(
                "INSERT INTO webhook_secrets (subscription_id, secret) VALUES ($1, $2)",
                subscription_id,
                request.secret.encode("utf-8"),
            )
        log.info(
            "webhook.subscribed", subscription_id=subscription_id, destination=event.destination, actor=actor
        )
        self.changed()
        return webhook_body(row)

    async def list_all(self, *, include_deleted: bool = False) -> list[WebhookBody]:
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT " + _COLUMNS + " FROM webhook_subscriptions WHERE $1 OR state <> 'deleted' "
                "ORDER BY created_at, subscription_id",
                include_deleted,
            )
        return [webhook_body(r) for r in rows]

    async def get(self, subscription_id: str) -> WebhookBody:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT " + _COLUMNS + " FROM webhook_subscriptions WHERE subscription_id = $1",
                subscription_id,
            )
        if row is None:
            raise _not_found(subscription_id)
        return webhook_body(row)

    async def delete(self, subscription_id: str, *, reason: str = "", actor: str = "operator") -> WebhookBody:
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                "UPDATE webhook_subscriptions SET state = 'deleted', deleted_at = now(), "
                "next_attempt_at = NULL WHERE subscription_id = $1 AND state <> 'deleted' RETURNING "
                + _COLUMNS,
                subscription_id,
            )
            if row is None:
                raise _not_found(subscription_id)
            await conn.execute("DELETE FROM webhook_secrets WHERE subscription_id = $1", subscription_id)
            event = WebhookUnsubscribed(subscription_id=subscription_id, reason=reason)
            await self.store.append(
                WEBHOOKS_STREAM, None, [NewEvent(payload=event, metadata=self._metadata(actor))], conn=conn
            )
        log.info("webhook.unsubscribed", subscription_id=subscription_id, actor=actor)
        self.changed()
        return webhook_body(row)

    async def resume(self, subscription_id: str, *, actor: str = "operator") -> WebhookBody:
        """Deliver again now, from the cursor: the attempts and the wait are reset."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                "UPDATE webhook_subscriptions SET state = 'active', attempts = 0, next_attempt_at = NULL, "
                "failing_since = NULL WHERE subscription_id = $1 AND state <> 'deleted' "
                "RETURNING cursor_position, " + _COLUMNS,
                subscription_id,
            )
            if row is None:
                raise _not_found(subscription_id)
            event = WebhookResumed(subscription_id=subscription_id, at_position=row["cursor_position"])
            await self.store.append(
                WEBHOOKS_STREAM, None, [NewEvent(payload=event, metadata=self._metadata(actor))], conn=conn
            )
        log.info("webhook.resumed", subscription_id=subscription_id, actor=actor)
        self.changed()
        return webhook_body(row)

    async def deliveries(
        self, subscription_id: str, *, cursor: str | None = None, limit: int = 50
    ) -> DeliveryPage:
        """A page of `limit` delivery attempts, newest first, older than `cursor`'s."""
        below = decode_deliveries_cursor(cursor, subscription_id) if cursor else _BEYOND_EVERY_ID
        limit = min(max(limit, 1), MAX_DELIVERIES_PAGE)
        await self.get(subscription_id)
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT delivery_id, global_position, event_type, attempt, outcome, status_code, "
                "duration_ms, response_body, error, attempted_at FROM webhook_deliveries "
                "WHERE subscription_id = $1 AND delivery_id < $2 ORDER BY delivery_id DESC LIMIT $3",
                subscription_id,
                below,
                limit + 1,  # the extra row says whether older ones follow
            )
        items = [DeliveryBody(**dict(r)) for r in rows[:limit]]
        more = len(rows) > limit  # then this page is full: its last item is where the next starts
        return DeliveryPage(
            items, encode_deliveries_cursor(subscription_id, items[-1].delivery_id) if more else None
        )
