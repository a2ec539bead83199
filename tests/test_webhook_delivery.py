"""Webhook delivery against a real HTTP receiver on 127.0.0.1: every matching event, in commit
order, signed so that the helper docs/integrations.md shows verifies it; across a receiver outage;
with two delivery workers on one database (one delivers); retries, failing, resume, rejection."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import msgspec
import pytest

from api.services.webhook_delivery import DeliverySettings, WebhookDispatcher
from api.services.webhooks import WebhookBody, WebhookCreateRequest, WebhookService
from ledger.store import EventStore
from tests.cancellation_support import cancel_as_it_wakes
from tests.webhook_support import SECRET, Receiver, append_tokens, docs_verifier

FAST = DeliverySettings(
    source="urn:modelforge:test",
    max_attempts=3,
    backoff_initial=0.05,
    backoff_max=0.3,
    timeout=2.0,
    allow_private=True,
    scan_interval=0.2,
    poll_interval=0.1,
)


@contextlib.asynccontextmanager
async def running(pool: asyncpg.Pool, settings: DeliverySettings = FAST) -> AsyncIterator[WebhookDispatcher]:
    dispatcher = WebhookDispatcher(pool, settings)
    task = asyncio.create_task(dispatcher.run())
    try:
        yield dispatcher
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
def receiver() -> Any:
    r = Receiver().start()
    yield r
    r.stop()


async def subscribe(store: EventStore, url: str, **selection: Any) -> WebhookBody:
    service = WebhookService(store, allow_private=True)
    selection.setdefault("event_types", ["ENROLLMENT_TOKEN_CREATED"])
    return await service.create(WebhookCreateRequest(url=url, secret=SECRET, **selection))


async def eventually(check: Callable[[], Any], within: float = 20.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


async def row(pool: asyncpg.Pool, sid: str) -> asyncpg.Record:
    async with pool.acquire() as conn:
        return await conn.fetchrow("SELECT * FROM webhook_subscriptions WHERE subscription_id = $1", sid)


async def test_200_events_are_delivered_in_commit_order_signed_as_cloudevents(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    sub = await subscribe(store, receiver.url)

    async def all_settled() -> asyncpg.Record | None:
        state = await row(pool, sub.subscription_id)
        return state if state["delivered"] == 200 else None

    async with running(pool):
        positions = await append_tokens(store, 200)
        got = await asyncio.to_thread(receiver.wait_for, 200)
        # The receiver has the last event before the deliverer, which records it once the answer
        # is back: the subscription's row is read once it has (and before the deliverer stops).
        state = await eventually(all_settled)
    assert got == positions, "each event once, in commit order"
    assert all(d.verified for d in receiver.deliveries)
    first = receiver.deliveries[0]
    event = first.event
    assert event["specversion"] == "1.0" and event["id"] == str(positions[0])
    assert event["source"] == "urn:modelforge:test"
    assert event["type"] == "dev.modelforge.hardware.ENROLLMENT_TOKEN_CREATED"
    assert event["subject"].startswith("enrollment-token-") and event["time"]
    assert event["data"]["event_type"] == "ENROLLMENT_TOKEN_CREATED"
    assert first.headers["content-type"] == "application/cloudevents+json"
    assert first.headers["webhook-id"] == event["id"]
    assert first.headers["webhook-signature"].startswith("v1,")
    assert state is not None, "the deliverer recorded every delivery"
    assert (
        state["delivered"] == 200 and state["last_position"] == positions[-1] and state["state"] == "active"
    )
    # At the last event delivered, or past it at a read's horizon once the log went quiet.
    assert state["cursor_position"] >= positions[-1]


async def test_the_docs_helper_refuses_a_wrong_secret_a_changed_body_and_an_old_timestamp(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    await subscribe(store, receiver.url)
    async with running(pool):
        await append_tokens(store, 1)
        await asyncio.to_thread(receiver.wait_for, 1)
    verify = docs_verifier()
    d = receiver.deliveries[0]
    verify(SECRET, d.headers, d.body)
    verify(SECRET, {k.upper(): v for k, v in d.headers.items()}, d.body)
    for secret, headers, body in (
        ("whsec_" + "d3Jvbmctc2VjcmV0LW9mLTMyLWJ5dGVzLi4uLi4uIQ==", d.headers, d.body),
        ("a-wrong-secret-of-enough-bytes", d.headers, d.body),
        (SECRET, d.headers, d.body.replace(b'"1.0"', b'"1.1"')),
        (SECRET, d.headers | {"webhook-timestamp": str(int(time.time()) - 3600)}, d.body),
        (SECRET, {k: v for k, v in d.headers.items() if k != "webhook-signature"}, d.body),
    ):
        with pytest.raises(ValueError):
            verify(secret, headers, body)


async def test_a_receiver_killed_mid_stream_gets_every_event_after_it_restarts(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    sub = await subscribe(store, receiver.url)
    async with running(pool):
        writer = asyncio.create_task(append_tokens(store, 150))
        await asyncio.to_thread(receiver.wait_for, 40)
        receiver.stop()
        before = len(receiver.positions())
        await asyncio.sleep(1.0)  # down long enough to exhaust the attempts: failing
        assert (await row(pool, sub.subscription_id))["state"] == "failing"
        receiver.start()  # the same port
        positions = await writer
        got = await asyncio.to_thread(receiver.wait_for, 150)
    assert sorted(set(got)) == positions, "every event delivered"
    unique = list(dict.fromkeys(got))
    assert unique == positions, "in commit order"
    repeats = [i for i in range(1, len(got)) if got[i] <= got[i - 1]]
    assert all(i == before for i in repeats), "a repeat only where the outage was"
    assert (await row(pool, sub.subscription_id))["state"] == "active"


async def test_two_workers_on_one_database_deliver_each_event_once(
    store: EventStore, pool: asyncpg.Pool, database_dsn: str
) -> None:
    from ledger.db import create_pool

    receivers = [Receiver().start() for _ in range(3)]
    other = await create_pool(database_dsn, min_size=1, max_size=6)
    try:
        subs = [await subscribe(store, r.url) for r in receivers]
        async with running(pool) as one, running(other) as two:
            positions = await append_tokens(store, 60)
            for r in receivers:
                await asyncio.to_thread(r.wait_for, 60)
            await asyncio.sleep(0.5)  # time for any second delivery to show
            owners = [one.owned, two.owned]
        for r in receivers:
            assert r.positions() == positions, "each event exactly once, in order"
        ids = {s.subscription_id for s in subs}
        assert owners[0] | owners[1] == ids and not owners[0] & owners[1], owners
    finally:
        for r in receivers:
            r.stop()
        await other.close()


async def test_a_worker_that_stops_is_taken_over_from_the_cursor(
    store: EventStore, pool: asyncpg.Pool, database_dsn: str, receiver: Receiver
) -> None:
    from ledger.db import create_pool

    other = await create_pool(database_dsn, min_size=1, max_size=6)
    try:
        await subscribe(store, receiver.url)
        async with running(pool):
            first = await append_tokens(store, 20)
            await asyncio.to_thread(receiver.wait_for, 20)
        async with running(other):
            second = await append_tokens(store, 20)
            await asyncio.to_thread(receiver.wait_for, 40)
        assert receiver.positions() == first + second
    finally:
        await other.close()


async def test_a_4xx_is_recorded_with_its_body_and_skipped_a_5xx_retried_until_failing_then_resumed(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    sub = await subscribe(store, receiver.url)
    service = WebhookService(store, allow_private=True)
    async with running(pool) as dispatcher:
        service.changed = dispatcher.wake
        receiver.status, receiver.answer = 422, b'{"error": "no such pager"}'
        (refused,) = await append_tokens(store, 1)

        async def rejected() -> bool:
            return (await row(pool, sub.subscription_id))["rejected"] == 1

        assert await eventually(rejected)
        receiver.status, receiver.answer = 503, b"busy"
        (later,) = await append_tokens(store, 1)

        async def failing() -> bool:
            return (await row(pool, sub.subscription_id))["state"] == "failing"

        assert await eventually(failing)
        listed = await service.get(sub.subscription_id)
        assert listed.state == "failing" and listed.attempts >= 3 and listed.last_error == "HTTP 503"
        receiver.status, receiver.answer = 200, b"ok"
        await service.resume(sub.subscription_id)
        await asyncio.to_thread(receiver.wait_for, 1)

        # The receiver has answered before the worker records its answer (the attempt and the
        # cursor move in one statement after the response): wait for that record, not the POST,
        # or the worker is stopped in between and the delivery is (rightly) not recorded.
        async def recorded() -> bool:
            return (await row(pool, sub.subscription_id))["cursor_position"] >= later

        assert await eventually(recorded)
    assert receiver.positions() == [later], "the refused event skipped, the retried one delivered once"
    attempts = (await service.deliveries(sub.subscription_id)).items
    outcomes = [(a.global_position, a.outcome, a.status_code) for a in reversed(attempts)]
    assert outcomes[0] == (refused, "rejected", 422)
    assert attempts[-1].response_body == '{"error": "no such pager"}'
    assert (later, "retrying", 503) in outcomes and (later, "failing", 503) in outcomes
    assert outcomes[-1] == (later, "delivered", 200)
    state = await row(pool, sub.subscription_id)
    assert state["state"] == "active" and state["attempts"] == 0 and state["failing_since"] is None


async def test_selection_by_node_and_class_and_deleted_subscriptions_stop(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    service = WebhookService(store, allow_private=True)
    sub = await service.create(
        WebhookCreateRequest(url=receiver.url, secret=SECRET, event_classes=["observation"])
    )
    async with running(pool) as dispatcher:
        service.changed = dispatcher.wake
        await append_tokens(store, 3)  # lifecycle: not selected
        await service.delete(sub.subscription_id)
        await asyncio.sleep(0.5)
        assert not dispatcher.owned
    assert receiver.positions() == []


async def test_a_worker_told_to_stop_while_it_stops_a_deleted_subscription_stops(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    """The server stops (its worker is cancelled) just as the worker is stopping the delivery of a
    subscription deleted a moment before: the worker stops too, rather than scanning on while the
    server's shutdown waits on it."""
    service = WebhookService(store, allow_private=True)
    sub = await subscribe(store, receiver.url)
    dispatcher = WebhookDispatcher(pool, FAST)
    service.changed = dispatcher.wake
    serve, stopping = dispatcher._serve, asyncio.Event()

    async def slow_to_stop(subscription_id: str) -> None:
        try:
            await serve(subscription_id)
        except asyncio.CancelledError:
            stopping.set()
            await asyncio.sleep(2.0)  # a delivery's clean-up that takes a while (a query's cancel)
            raise

    dispatcher._serve = slow_to_stop  # type: ignore[method-assign]
    worker = asyncio.create_task(dispatcher.run())
    try:

        async def owned() -> bool:
            return sub.subscription_id in dispatcher.owned

        assert await eventually(owned)
        await service.delete(sub.subscription_id)
        await asyncio.wait_for(stopping.wait(), 10)
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(worker, 10)
        assert worker.cancelled()
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(worker, 10)


async def test_a_worker_told_to_stop_as_it_is_woken_stops(pool: asyncpg.Pool) -> None:
    """The server stops (its worker is cancelled) in the moment a subscription change wakes the
    worker: it stops, rather than losing the cancellation to the wake-up and scanning on while the
    server's shutdown waits on it."""
    dispatcher = WebhookDispatcher(pool, msgspec.structs.replace(FAST, scan_interval=60.0))
    worker = asyncio.create_task(dispatcher.run())
    try:
        # a subscription changes as the worker is cancelled
        await cancel_as_it_wakes(worker, lambda: bool(dispatcher._wake._waiters), dispatcher.wake)  # type: ignore[attr-defined]
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)


async def listening(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM mf_feed_listeners l JOIN pg_stat_activity a "
                "ON a.pid = l.pid AND a.backend_start = l.backend_start"
            )
        )


async def test_the_worker_listens_only_while_the_log_is_quiet_and_skips_what_it_does_not_select(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    sub = await subscribe(store, receiver.url, event_types=["ACCELERATOR_MISSING"])

    async def quiet_and_listening() -> bool:
        return await listening(pool) == 1

    async with running(pool):
        assert await eventually(quiet_and_listening), "a quiet log: the worker waits on the change feed"
        seen = []
        last = 0
        for _ in range(30):  # a busy log: an append every 50 ms, none selected
            (last,) = await append_tokens(store, 1)
            seen.append(await listening(pool))
            await asyncio.sleep(0.05)
        assert sum(seen[5:]) <= 2, f"no listening (so no notifying appends) while the log moves: {seen}"

        async def skipped() -> bool:
            # Compared as (transaction, position): a cursor at a read's horizon has the largest
            # position of all, whatever transaction it stands at.
            async with pool.acquire() as conn:
                return bool(
                    await conn.fetchval(
                        "SELECT (s.cursor_tx_id, s.cursor_position) >= (e.tx_id, e.global_position) "
                        "FROM webhook_subscriptions s, events e "
                        "WHERE s.subscription_id = $1 AND e.global_position = $2",
                        sub.subscription_id,
                        last,
                    )
                )

        assert await eventually(skipped), "the cursor moves past what the subscription does not select"
        assert await eventually(quiet_and_listening)
    assert receiver.positions() == []


async def test_the_log_moving_behind_a_held_horizon_ends_the_listening_and_its_events_follow(
    store: EventStore, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    """Another session holds a transaction open, so the read's horizon stays below every event the
    log gains meanwhile: the worker still stops listening at the log's first commit (rather than
    once that session ends, its appends notifying until then), and delivers the events, in commit
    order, once the session ends."""
    sub = await subscribe(store, receiver.url)

    async def quiet_and_listening() -> bool:
        return await listening(pool) == 1

    async def listening_past_every_event() -> bool:
        # Its cursor (the horizon it waits at) is past every event so far, so no event that an
        # older transaction of another session held back can wake it: only a new commit.
        async with pool.acquire() as conn:
            past = await conn.fetchval(
                "SELECT s.cursor_tx_id >= (SELECT max(e.tx_id) FROM events e) "
                "FROM webhook_subscriptions s WHERE s.subscription_id = $1",
                sub.subscription_id,
            )
        return bool(past) and await quiet_and_listening()

    async with running(pool):
        assert await eventually(listening_past_every_event), "a quiet log: the worker waits on the feed"
        async with pool.acquire() as holder:
            held = holder.transaction()
            await held.start()
            try:
                await holder.fetchval("SELECT pg_current_xact_id()")
                appended, seen = [], []
                for _ in range(30):
                    appended += await append_tokens(store, 1)
                    seen.append(await listening(pool))
                    await asyncio.sleep(0.05)
                assert sum(seen[5:]) <= 2, f"no listening while the log moves: {seen}"
                assert receiver.positions() == [], "the horizon is held: nothing is delivered yet"
            finally:
                await held.rollback()
        got = await asyncio.to_thread(receiver.wait_for, len(appended))
        assert got == appended
        assert await eventually(quiet_and_listening)
