"""The change feed. `GET /events?cursor=...&wait=N` holds an empty page until an
event commits (LISTEN/NOTIFY wakes it; the gap-safe read decides what it gets)."""

from __future__ import annotations

import asyncio
import contextlib

from tests.cancellation_support import cancel_as_it_wakes
from tests.fixtures_nvml import multi_gpu_scenario


async def end_cursor(api) -> str:  # type: ignore[no-untyped-def]
    cursor = None
    while True:
        params = {"limit": 1000} | ({"cursor": cursor} if cursor else {})
        body = (await api.get("/api/v1/hardware/events", params=params)).json()
        cursor = body["next_cursor"]
        if not body["has_more"]:
            return cursor


async def append_as_the_oldest(pool, store, stream: str, version: int, events: list):  # type: ignore[no-untyped-def]
    """Append in a transaction that commits once it is the oldest one running on the server: the
    moment it commits, the gap-safe read delivers its events, so a waiter its notification wakes
    finds them even while other sessions on a shared server hold transactions open (their end
    notifies nobody: a wake-up that finds nothing would wait for the next notification)."""
    async with pool.acquire() as conn, pool.acquire() as probe:
        async with conn.transaction():
            appended = await store.append(stream, version, events, conn=conn)
            xid = await conn.fetchval("SELECT pg_current_xact_id()::text::bigint")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while await probe.fetchval("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint") < xid:
                assert loop.time() < deadline, "older transactions on the server never ended"
                await asyncio.sleep(0.01)
    return appended


async def test_a_waiting_reader_wakes_with_the_events_of_a_refresh(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    cursor = await end_cursor(api)

    waiting = asyncio.create_task(
        api.get("/api/v1/hardware/events", params={"cursor": cursor, "wait": 30, "limit": 1000})
    )
    await asyncio.sleep(1.0)
    assert not waiting.done(), "nothing committed yet: the page is held"
    api.scenario.driver_version = "580.95.05"
    refresh = await api.refresh()
    # Woken by the commit's notification, far inside the 30 s it would otherwise hold.
    r = await asyncio.wait_for(waiting, 15)
    assert r.status_code == 200, r.text
    body = r.json()
    got = [e["global_position"] for e in body["items"]]
    assert got, "the waiter returned the refresh's events"
    assert set(got) <= {e["global_position"] for e in refresh["events"]}
    # Whatever the first page did not carry, the resumed cursor delivers, once.
    rest = await api.get("/api/v1/hardware/events", params={"cursor": body["next_cursor"], "limit": 1000})
    more = [e["global_position"] for e in rest.json()["items"]]
    assert sorted(got + more) == sorted(e["global_position"] for e in refresh["events"])


async def test_a_wait_that_sees_nothing_returns_an_empty_page_at_the_same_cursor(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(1))
    await api.refresh()
    cursor = await end_cursor(api)
    r = await api.get("/api/v1/hardware/events", params={"cursor": cursor, "wait": 1})
    assert r.status_code == 200
    assert r.json() == {"items": [], "next_cursor": cursor, "has_more": False}


async def test_filters_apply_to_the_feed_and_bad_waits_are_refused(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(1))
    await api.refresh()
    cursor = await end_cursor(api)
    waiting = asyncio.create_task(
        api.get(
            "/api/v1/hardware/events",
            params={"cursor": cursor, "wait": 30, "class": "lifecycle"},
        )
    )
    await api.refresh()  # observation events only: the lifecycle waiter keeps waiting
    await asyncio.sleep(1.5)
    assert not waiting.done()
    api.scenario.driver_version = "580.95.05"
    await api.refresh()
    body = (await asyncio.wait_for(waiting, 15)).json()
    assert body["items"] and all(e["class"] == "lifecycle" for e in body["items"])

    for bad in ("-1", "61", "soon"):
        r = await api.get("/api/v1/hardware/events", params={"wait": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")


async def test_the_commit_notification_wakes_the_feed_without_polling(pool) -> None:  # type: ignore[no-untyped-def]
    """With the fallback poll pushed past the test's bound, only NOTIFY can wake the waiter."""
    from ledger.feed import LogFeed
    from ledger.reading import Checkpoint
    from ledger.store import EventStore
    from tests.test_ledger import telemetry

    store = EventStore(pool)
    await store.append("feed-stream", 0, [telemetry(1)])
    # Held until the horizon passes it: another session on this server may hold it back a while,
    # and its end notifies nobody, so this wait re-reads on the feed's usual short interval.
    first = await LogFeed(pool).wait(Checkpoint(), limit=10, wait_seconds=60)
    assert len(first.entries) == 1
    feed = LogFeed(pool, fallback_poll=120)
    waiting = asyncio.create_task(feed.wait(first.resume, limit=10, wait_seconds=120))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    appended = await append_as_the_oldest(pool, store, "feed-stream", 1, [telemetry(2), telemetry(3)])
    page = await asyncio.wait_for(waiting, 20)
    assert [e.event_id for e in page.entries] == [e.event_id for e in appended.events]
    # No waiter left: the feed holds no connection, so the pool closes without waiting on it.
    assert feed._listener is None


async def test_replay_follow_prints_new_events_as_they_commit(make_api, database_dsn: str) -> None:  # type: ignore[no-untyped-def]
    import os
    import queue
    import subprocess
    import sys
    import threading

    import msgspec

    api = make_api(multi_gpu_scenario(1))
    first = await api.refresh()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    proc = subprocess.Popen(  # noqa: ASYNC220  (a thread drains it; nothing here blocks the loop)
        [
            sys.executable,
            "-m",
            "api.cli",
            "replay",
            "--database-url",
            database_dsn,
            "--format",
            "jsonl",
            "--follow",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]

    async def positions(n: int) -> list[int]:
        got = []
        for _ in range(n):
            line = await asyncio.to_thread(lines.get, True, 30)
            got.append(msgspec.json.decode(line)["global_position"])
        return got

    try:
        assert await positions(len(first["events"])) == [e["global_position"] for e in first["events"]]
        api.scenario.driver_version = "580.95.05"
        second = await api.refresh()
        assert sorted(await positions(len(second["events"]))) == sorted(
            e["global_position"] for e in second["events"]
        )
        assert proc.poll() is None, "following keeps running"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_appends_notify_only_while_a_feed_listens(database_dsn: str, pool) -> None:  # type: ignore[no-untyped-def]
    """A notifying transaction takes a cluster-wide lock at commit (appenders then commit one at a
    time), so appends notify only while a LogFeed waits: nothing before it listens, a wake-up while
    it does, nothing again once it stopped."""
    import asyncpg

    from collectors.facts import Known
    from ledger.events import HostTelemetryObserved
    from ledger.feed import LogFeed
    from ledger.reading import Checkpoint
    from ledger.store import EventStore
    from tests.builders import new

    def sample(i: int):  # type: ignore[no-untyped-def]
        return [new(HostTelemetryObserved(telemetry={"memory_available_bytes": Known(i)}, storage=[]))]

    heard: list[object] = []
    bystander = await asyncpg.connect(database_dsn)  # listens without registering as a feed
    try:
        await bystander.add_listener("mf_log", lambda *args: heard.append(args))
        store = EventStore(pool)
        await store.append("s", 0, sample(1))
        await asyncio.sleep(0.5)
        assert heard == [], "nobody waits on the feed: the append did not notify"

        # Past the first event once the horizon passes it (short re-reads: see append_as_the_oldest).
        after = (await LogFeed(pool).wait(Checkpoint(), limit=10, wait_seconds=60)).resume
        feed = LogFeed(pool, fallback_poll=30.0)  # a wake-up within the test is the notification's
        waiting = asyncio.create_task(feed.wait(after, limit=10, wait_seconds=30))
        await asyncio.sleep(0.5)
        await append_as_the_oldest(pool, store, "s", 1, sample(2))
        page = await asyncio.wait_for(waiting, 10)
        assert [e.stream_version for e in page.entries] == [2]
        assert heard, "a feed waited: the append notified"

        heard.clear()
        await store.append("s", 2, sample(3))
        await asyncio.sleep(0.5)
        assert heard == [], "the feed stopped waiting and deregistered: no notification"
    finally:
        await bystander.close()


async def test_a_waiter_cancelled_while_it_registers_or_deregisters_leaves_the_pool_closable(
    database_dsn: str,
) -> None:
    """A waiter is cancelled (its webhook subscription deleted, the server stopping) at any await,
    also while it registers as a listener or deregisters. Its connection still goes back: closing
    the pool, the last step of a server's shutdown, waits for every connection handed out. And
    none stays registered, or appends would go on notifying with nobody waiting."""
    import asyncpg

    from ledger.db import create_pool
    from ledger.feed import LogFeed
    from ledger.reading import Checkpoint, read_log

    live_registrations = (
        "SELECT count(*) FROM mf_feed_listeners l JOIN pg_stat_activity a "
        "ON a.pid = l.pid AND a.backend_start = l.backend_start"
    )

    async def blocked_on(admin: asyncpg.Connection, statement: str) -> None:
        """Until a backend of this test's database waits for the table lock in `statement` (the
        waiter is inside it; the same test of another session on the server is not)."""
        for _ in range(200):
            if await admin.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1 "
                "AND datname = current_database()",
                statement + "%",
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"nothing waited in {statement!r}")

    admin = await asyncpg.connect(database_dsn)
    try:
        for step, statement in (
            ("register", "DELETE FROM mf_feed_listeners l"),
            ("deregister", "DELETE FROM mf_feed_listeners WHERE"),
        ):
            pool = await create_pool(database_dsn, min_size=1, max_size=4)
            feed = LogFeed(pool, fallback_poll=30.0)
            async with pool.acquire() as conn:
                after = (await read_log(conn, Checkpoint(), limit=1000)).resume
            blocker = await asyncpg.connect(database_dsn)
            try:
                if step == "register":
                    await blocker.execute("BEGIN; LOCK TABLE mf_feed_listeners IN ACCESS EXCLUSIVE MODE")
                    waiting = asyncio.create_task(feed.wait(after, limit=10, wait_seconds=60))
                else:
                    waiting = asyncio.create_task(feed.wait(after, limit=10, wait_seconds=2))
                    for _ in range(200):
                        if feed._listener is not None:
                            break
                        await asyncio.sleep(0.01)
                    assert feed._listener is not None, "the waiter registered"
                    # Its wait runs out while the table is locked: it deregisters into the lock.
                    await blocker.execute("BEGIN; LOCK TABLE mf_feed_listeners IN ACCESS EXCLUSIVE MODE")
                await blocked_on(admin, statement)
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(waiting, 10)
                assert waiting.cancelled(), step
            finally:
                await blocker.close()
            try:
                await asyncio.wait_for(pool.close(), 10)
            except TimeoutError:
                pool.terminate()
                raise AssertionError(
                    f"cancelled while it would {step}: a connection was never handed back"
                ) from None
            # The closed connection's backend may still be finishing the statement it was blocked
            # in (its own deregistration, once the lock is released): gone once it ends.
            for _ in range(200):
                if await admin.fetchval(live_registrations) == 0:
                    break
                await asyncio.sleep(0.05)
            assert await admin.fetchval(live_registrations) == 0, step
    finally:
        await admin.close()


async def test_a_waiter_cancelled_as_a_notification_wakes_it_stops(pool) -> None:  # type: ignore[no-untyped-def]
    """A waiter is cancelled (the server stopping, its webhook subscription deleted) in the moment
    a commit's notification wakes it. It stops: the cancellation is not lost to the wake-up, which
    would leave it waiting, its listening connection held, until its wait runs out."""
    from ledger.feed import LogFeed
    from ledger.reading import Checkpoint, read_log

    async with pool.acquire() as conn:
        after = (await read_log(conn, Checkpoint(), limit=1000)).resume
    feed = LogFeed(pool, fallback_poll=60)
    waiting = asyncio.create_task(feed.wait(after, limit=10, wait_seconds=60))
    try:
        # a notification arrives as the waiter is cancelled
        await cancel_as_it_wakes(waiting, lambda: bool(feed._changed._waiters), feed._notified)  # type: ignore[attr-defined]
        assert feed._listener is None, "the cancelled waiter still holds its listening connection"
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
