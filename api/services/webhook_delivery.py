"""Webhook delivery (docs/integrations.md, "Webhooks"): the server's background worker.

Each subscription is delivered by one server at a time: the worker holds a session-level
advisory lock per subscription (`pg_try_advisory_lock`) on one connection of its own, taken at
each scan; a server that stops or loses that connection releases its locks with it, and another
server's next scan takes them over. No transaction stays open while a receiver is waited for, so
the log's xmin horizon never waits on a receiver.

A subscription's task reads the log with the one gap-safe read (`read_log`) after the
subscription's cursor (polling while the log moves, waiting on the change feed while it is
quiet), and POSTs each matching event as a CloudEvent signed per Standard
Webhooks. The cursor moves past an event only once its receiver answered 2xx (or refused it with
a 4xx that is not 408/429: recorded with the answer's body and skipped), so every matching event
is delivered at least once, in commit order, and in steady state exactly once. Delivery never
runs on the report path: ingest only appends to the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import asyncpg
import httpx
import msgspec
import structlog

from api.services.clock import central_now
from api.services.webhooks import resolve_destination
from domain.webhooks import Destination, UrlRefusal, backoff, parse_url, signature, signing_key, verdict
from ledger.events import EVENT_TYPES, OBSERVATION_TYPES, EventClass, RecordedEvent
from ledger.feed import LogFeed
from ledger.reading import MAX_POSITION, Checkpoint, LogEntry, LogFilter, LogPage, read_log
from runtime.version import VERSION

log = structlog.get_logger(__name__)

# The advisory locks' first key: the subscriptions' namespace ("mfwh"); the second is the
# subscription id's hashtext (two subscriptions sharing a hash are merely owned together).
LOCK_NAMESPACE = 0x6D667768
TYPE_PREFIX = "dev.modelforge.hardware."
BODY_KEPT = 1000  # characters of a receiver's answer kept with a failed attempt
DELIVERIES_KEPT = 500  # attempts kept per subscription
TRIM_EVERY = 200
DESTINATION_RECHECK_SECONDS = 30.0
SKIP_SAVE_SECONDS = 5.0  # how often a cursor moved past skipped events is written down
QUIET_POLLS = 3  # reads that saw the log's head stand still before waiting on the change feed
QUIET_WAIT_SECONDS = 30.0


class DeliverySettings(msgspec.Struct, frozen=True, kw_only=True):
    source: str
    max_attempts: int
    backoff_initial: float
    backoff_max: float
    timeout: float
    allow_private: bool = False
    scan_interval: float = 1.0
    poll_interval: float = 0.5
    page: int = 100


class CloudEvent(msgspec.Struct, frozen=True):
    """CloudEvents 1.0, structured mode (application/cloudevents+json)."""

    specversion: str
    id: str
    source: str
    type: str
    subject: str
    time: datetime
    datacontenttype: str
    data: Any


def subject_of(entry: LogEntry) -> str:
    """The GPU's UUID for an event about one accelerator, else the stream (the node's id)."""
    if isinstance(entry, RecordedEvent):
        payload = entry.payload
        for name in ("uuid", "accelerator_uuid"):
            value = getattr(payload, name, None)
            if isinstance(value, str) and value:
                return value
    return entry.stream_id


def cloud_event(entry: LogEntry, source: str) -> bytes:
    data = entry.payload if isinstance(entry, RecordedEvent) else entry.raw_data()
    return msgspec.json.encode(
        CloudEvent(
            specversion="1.0",
            id=str(entry.global_position),
            source=source,
            type=TYPE_PREFIX + entry.event_type,
            subject=subject_of(entry),
            time=entry.recorded_at,
            datacontenttype="application/json",
            data=data,
        )
    )


def log_filter(event_types: list[str], event_classes: list[str], node_id: str | None) -> LogFilter:
    """A subscription's selection as the log read's filter: its types, and every type of its
    classes (an event matches either)."""
    classes = set(event_classes)
    if classes >= {"lifecycle", "observation"}:
        return LogFilter(stream_id=node_id)
    if not event_types and len(classes) == 1:
        (only,) = classes
        event_class: EventClass = "lifecycle" if only == "lifecycle" else "observation"
        return LogFilter(stream_id=node_id, event_class=event_class)
    by_class = {name for name, cls in EVENT_TYPES.items() if _class_of(cls) in classes}
    return LogFilter(stream_id=node_id, event_types=tuple(sorted(set(event_types) | by_class)))


def _class_of(cls: type) -> str:
    return "observation" if cls in OBSERVATION_TYPES else "lifecycle"


class Subscription(msgspec.Struct, frozen=True):
    subscription_id: str
    url: str
    destination: Destination
    where: LogFilter
    cursor: Checkpoint
    attempts: int
    next_attempt_at: datetime | None
    key: bytes


class Attempt(msgspec.Struct, frozen=True):
    outcome: str  # delivered | rejected | retry
    status_code: int | None
    duration_ms: float
    response_body: str | None
    error: str | None


_ANY = "SELECT EXISTS (SELECT 1 FROM webhook_subscriptions WHERE state <> 'deleted')"
_LOAD = (
    "SELECT s.subscription_id, s.url, s.event_types, s.event_classes, s.node_id, s.cursor_tx_id, "
    "s.cursor_position, s.attempts, s.next_attempt_at, k.secret FROM webhook_subscriptions s "
    "JOIN webhook_secrets k USING (subscription_id) WHERE s.subscription_id = $1 AND s.state <> 'deleted'"
)

# One attempt's record and its effect on the subscription, in one statement. Settled (delivered
# or rejected): the cursor moves to the event (its transaction id looked up by position; an event
# pruned meanwhile leaves the cursor to the page's end) and the retry state is cleared.
_SETTLED = (
    "WITH attempt AS (INSERT INTO webhook_deliveries (subscription_id, global_position, event_type, "
    "attempt, outcome, status_code, duration_ms, response_body, error) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)), "
    "ev AS (SELECT events.tx_id FROM events WHERE events.global_position = $2 LIMIT 1) "
    "UPDATE webhook_subscriptions s SET cursor_tx_id = ev.tx_id, cursor_position = $2, attempts = 0, "
    "next_attempt_at = NULL, failing_since = NULL, state = 'active', "
    "delivered = s.delivered + ($5 = 'delivered')::int, rejected = s.rejected + ($5 = 'rejected')::int, "
    "last_delivered_at = CASE WHEN $5 = 'delivered' THEN now() ELSE s.last_delivered_at END, "
    "last_position = $2, last_error = CASE WHEN $5 = 'rejected' THEN $9 ELSE s.last_error END "
    "FROM ev WHERE s.subscription_id = $1 AND s.state <> 'deleted'"
)
_UNSETTLED = (
    "WITH attempt AS (INSERT INTO webhook_deliveries (subscription_id, global_position, event_type, "
    "attempt, outcome, status_code, duration_ms, response_body, error) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)) "
    "UPDATE webhook_subscriptions SET attempts = $4, retried = retried + 1, last_error = $9, "
    "next_attempt_at = now() + make_interval(secs => $10), "
    "state = CASE WHEN $5 = 'failing' THEN 'failing' ELSE state END, "
    "failing_since = CASE WHEN $5 = 'failing' THEN coalesce(failing_since, now()) ELSE failing_since END "
    "WHERE subscription_id = $1 AND state <> 'deleted'"
)
# The read's horizon and the log's head, in the snapshot the page is read in.
_HORIZON = (
    "SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin, "
    "(SELECT coalesce(max(events.global_position), 0) FROM events) AS head"
)
_PAGE_END = (
    "UPDATE webhook_subscriptions SET cursor_tx_id = $2::xid8, cursor_position = $3 "
    "WHERE subscription_id = $1 AND state <> 'deleted' "
    "AND (cursor_tx_id, cursor_position) < ($2::xid8, $3::bigint)"
)
_TRIM = (
    "DELETE FROM webhook_deliveries WHERE subscription_id = $1 AND delivery_id <= "
    "(SELECT d.delivery_id FROM webhook_deliveries d WHERE d.subscription_id = $1 "
    "ORDER BY d.delivery_id DESC OFFSET $2 LIMIT 1)"
)


class WebhookDispatcher:
    """The delivery worker of one server process: `run()` until cancelled (the app's lifespan)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        settings: DeliverySettings,
        *,
        clock: Callable[[], datetime] = central_now,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.clock = clock
        self.jitter = jitter
        self.feed = LogFeed(pool, fallback_poll=settings.scan_interval)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._checked: dict[str, float] = {}

    def wake(self) -> None:
        """A subscription changed in this process: scan now rather than at the next interval."""
        self._wake.set()

    @property
    def owned(self) -> frozenset[str]:
        return frozenset(self.tasks)

    async def run(self) -> None:
        while True:
            try:
                if await self._any_subscription():
                    await self._hold_locks()
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("webhook.scan_failed", error=str(exc))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.scan_interval):
                    await self._wake.wait()

    async def _any_subscription(self) -> bool:
        async with self.pool.acquire() as conn:
            return bool(await conn.fetchval(_ANY))

    async def _hold_locks(self) -> None:
        """The lock connection, held while there are subscriptions (none: no connection held)."""
        async with self.pool.acquire() as conn:
            try:
                await self._own(conn)
            finally:
                await self._stop_all()
                with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    await conn.execute("SELECT pg_advisory_unlock_all()")

    async def _stop_all(self) -> None:
        tasks, self.tasks = list(self.tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _own(self, conn: asyncpg.Connection) -> None:
        """Scan the subscriptions on the lock connection: start a task for each one this server can
        lock, stop the tasks of deleted ones. A query failing here means the locks may be gone too:
        every task stops (run() starts over)."""
        while True:
            self._wake.clear()
            rows = await conn.fetch(
                "SELECT subscription_id FROM webhook_subscriptions WHERE state <> 'deleted'"
            )
            live = {r["subscription_id"] for r in rows}
            if not live and not self.tasks:
                return
            for sid, task in list(self.tasks.items()):
                if sid in live and not task.done():
                    continue
                task.cancel()
                # The task's own cancellation comes back as its result; a CancelledError raised
                # here is this worker's (the server stopping), and must stop it.
                (outcome,) = await asyncio.gather(task, return_exceptions=True)
                if isinstance(outcome, Exception):
                    log.warning("webhook.task_failed", subscription_id=sid, error=repr(outcome))
                del self.tasks[sid]
                await conn.execute("SELECT pg_advisory_unlock($1, hashtext($2))", LOCK_NAMESPACE, sid)
            for sid in sorted(live - set(self.tasks)):
                if await conn.fetchval("SELECT pg_try_advisory_lock($1, hashtext($2))", LOCK_NAMESPACE, sid):
                    log.info("webhook.owned", subscription_id=sid)
                    self.tasks[sid] = asyncio.create_task(self._serve(sid), name=f"webhook-{sid}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.scan_interval):
                    await self._wake.wait()

    async def _load(self, subscription_id: str) -> Subscription | None:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(_LOAD, subscription_id)
        if row is None:
            return None
        return Subscription(
            subscription_id=subscription_id,
            url=row["url"],
            destination=parse_url(row["url"]),
            where=log_filter(list(row["event_types"]), list(row["event_classes"]), row["node_id"]),
            cursor=Checkpoint(row["cursor_tx_id"], row["cursor_position"]),
            attempts=row["attempts"],
            next_attempt_at=row["next_attempt_at"],
            key=signing_key(bytes(row["secret"]).decode("utf-8")),
        )

    async def _serve(self, subscription_id: str) -> None:
        timeout = httpx.Timeout(self.settings.timeout)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            await _Delivery(self, client, subscription_id).run()

    async def _settle(
        self, client: httpx.AsyncClient, sub: Subscription, entry: LogEntry, attempts: int
    ) -> bool:
        """Send one event until its receiver settles it (True) or the subscription is failing
        (False: the cursor stays before the event)."""
        body = cloud_event(entry, self.settings.source)
        while True:
            attempt = await self._attempt(client, sub, entry, body)
            attempts += 1
            args = (
                sub.subscription_id,
                entry.global_position,
                entry.event_type,
                attempts,
            )
            details = (attempt.status_code, attempt.duration_ms, attempt.response_body, attempt.error)
            if attempt.outcome in ("delivered", "rejected"):
                async with self.pool.acquire() as conn:
                    await conn.execute(_SETTLED, *args, attempt.outcome, *details)
                if attempt.outcome == "rejected":
                    log.warning(
                        "webhook.rejected",
                        subscription_id=sub.subscription_id,
                        position=entry.global_position,
                        status=attempt.status_code,
                    )
                return True
            failing = attempts >= self.settings.max_attempts
            wait = (
                self.settings.backoff_max
                if failing
                else backoff(
                    attempts,
                    initial=self.settings.backoff_initial,
                    ceiling=self.settings.backoff_max,
                    jitter=self.jitter(),
                )
            )
            async with self.pool.acquire() as conn:
                await conn.execute(_UNSETTLED, *args, "failing" if failing else "retrying", *details, wait)
            if failing:
                await self._trim(sub.subscription_id)
                log.warning(
                    "webhook.failing",
                    subscription_id=sub.subscription_id,
                    position=entry.global_position,
                    attempts=attempts,
                    error=attempt.error,
                )
                return False
            await asyncio.sleep(wait)

    async def _attempt(
        self, client: httpx.AsyncClient, sub: Subscription, entry: LogEntry, body: bytes
    ) -> Attempt:
        started = time.perf_counter()

        def took() -> float:
            return (time.perf_counter() - started) * 1000

        checked = self._checked.get(sub.subscription_id, 0.0)
        if time.monotonic() - checked > DESTINATION_RECHECK_SECONDS:
            try:
                await resolve_destination(sub.destination, allow_private=self.settings.allow_private)
            except UrlRefusal as exc:
                return Attempt("retry", None, took(), None, f"destination refused: {exc}")
            self._checked[sub.subscription_id] = time.monotonic()
        message_id = str(entry.global_position)
        timestamp = int(time.time())
        headers = {
            "content-type": "application/cloudevents+json",
            "user-agent": f"modelforge-hardware/{VERSION}",
            "webhook-id": message_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(sub.key, message_id, timestamp, body),
        }
        try:
            response = await client.post(sub.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return Attempt("retry", None, took(), None, f"{type(exc).__name__}: {exc}"[:BODY_KEPT])
        outcome = verdict(response.status_code)
        text = None if outcome == "delivered" else response.text[:BODY_KEPT]
        error = None if outcome == "delivered" else f"HTTP {response.status_code}"
        return Attempt(outcome, response.status_code, took(), text, error)

    async def _page_end(self, subscription_id: str, resume: Checkpoint) -> None:
        async with self.pool.acquire() as conn:
            await conn.execute(_PAGE_END, subscription_id, resume.tx_id, resume.position)

    async def _trim(self, subscription_id: str) -> None:
        async with self.pool.acquire() as conn:
            await conn.execute(_TRIM, subscription_id, DELIVERIES_KEPT)


class _Delivery:
    """One subscription's delivery loop, on the server that holds its lock.

    Its cursor is kept here and in the subscription's row: an event settled moves both (the row in
    the statement that records the attempt); events the selection skips move the cursor here to
    the read's horizon, written to the row now and then. While the log moves it reads every
    `poll_interval`; once the log's head stands still it waits on the change feed for the next
    commit, so appends notify (which serializes their commits, ledger/feed.py) only while the log
    is quiet, never under ingest."""

    def __init__(
        self, dispatcher: WebhookDispatcher, client: httpx.AsyncClient, subscription_id: str
    ) -> None:
        self.d = dispatcher
        self.client = client
        self.subscription_id = subscription_id
        self.cursor: Checkpoint | None = None
        self.saved: Checkpoint | None = None
        self.saved_at = 0.0
        self.head: int | None = None
        self.still = 0
        self.delivered = 0

    async def run(self) -> None:
        settings = self.d.settings
        while True:
            sub = await self.d._load(self.subscription_id)
            if sub is None:
                return
            if self.cursor is None or sub.cursor > self.cursor:
                self.cursor = self.saved = sub.cursor
            now = self.d.clock()
            if sub.next_attempt_at is not None and sub.next_attempt_at > now:
                # Failing (or between retries): wait, looking again now and then for a resume.
                wait = (sub.next_attempt_at - now).total_seconds()
                await asyncio.sleep(min(wait, settings.scan_interval))
                continue
            page, horizon, head = await self._read(sub)
            attempts = sub.attempts
            for entry in page.entries:
                if not await self.d._settle(self.client, sub, entry, attempts):
                    self.cursor = None  # the row's cursor is the truth again
                    break
                attempts = 0
                self.delivered += 1
                if self.delivered % TRIM_EVERY == 0:
                    await self.d._trim(self.subscription_id)
            else:
                await self._advance(page, horizon)
                if page.more:
                    continue
                await self._idle(head, horizon)

    async def _read(self, sub: Subscription) -> tuple[LogPage, Checkpoint, int]:
        """A page after the cursor, the horizon of the same snapshot (every transaction below it
        has ended, so no event can ever commit before it) and the log's head."""
        assert self.cursor is not None
        async with (
            self.d.pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            row = await conn.fetchrow(_HORIZON)
            page = await read_log(conn, self.cursor, limit=self.d.settings.page, where=sub.where)
        horizon = Checkpoint(max(int(row["xmin"]) - 1, 0), MAX_POSITION)
        return page, horizon, int(row["head"])

    async def _advance(self, page: LogPage, horizon: Checkpoint) -> None:
        assert self.cursor is not None
        # A page not cut by its limit holds every matching event below the horizon.
        self.cursor = max(self.cursor, page.resume if page.more else max(page.resume, horizon))
        if time.monotonic() - self.saved_at > SKIP_SAVE_SECONDS:
            await self._save()

    async def _save(self) -> None:
        if self.cursor is not None and self.cursor != self.saved:
            await self.d._page_end(self.subscription_id, self.cursor)
            self.saved, self.saved_at = self.cursor, time.monotonic()

    async def _idle(self, head: int, horizon: Checkpoint) -> None:
        settings = self.d.settings
        self.still = self.still + 1 if head == self.head else 0
        self.head = head
        if self.still < QUIET_POLLS:
            await asyncio.sleep(settings.poll_interval)
            return
        # The log is quiet: sleep until anything at all commits (or a while). The first commit ends
        # the wait even while another session holds the horizon below it, so the log moving again
        # stops the listening at once rather than once that session ends.
        await self._save()
        await self.d.feed.wait(horizon, limit=1, wait_seconds=QUIET_WAIT_SECONDS, any_commit=True)
        self.still = 0
