"""The server stops promptly: a held change-feed page does not hold up its graceful shutdown, and a
database connection never handed back does not hold up its pool's close."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import asyncpg
import httpx
import pytest
import structlog

from tests.agent_support import OPERATOR_TOKEN, ServerProcess

AUTH = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


async def feed_listeners(admin: asyncpg.Connection) -> int:
    return int(
        await admin.fetchval(
            "SELECT count(*) FROM mf_feed_listeners l JOIN pg_stat_activity a "
            "ON a.pid = l.pid AND a.backend_start = l.backend_start"
        )
    )


async def test_a_held_change_feed_page_is_answered_at_once_when_the_server_stops(
    database_dsn: str, tmp_path: Path
) -> None:
    """SIGTERM while `GET /events?wait=60` holds an empty page: the page is answered at once (empty,
    at the cursor it was asked for, so the follower resumes there) and the process exits, instead of
    the shutdown waiting out the 60 s."""
    server = ServerProcess(database_dsn, tmp_path).start()
    admin = await asyncpg.connect(database_dsn)
    try:
        await server.wait_healthy()
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=90) as http:
            body = (await http.get("/api/v1/hardware/events", params={"limit": 1000})).json()
            assert not body["has_more"]
            cursor = body["next_cursor"]
            held = asyncio.create_task(
                http.get("/api/v1/hardware/events", params={"cursor": cursor, "wait": 60})
            )
            for _ in range(200):  # until the server's feed listens for the next commit
                if await feed_listeners(admin):
                    break
                await asyncio.sleep(0.05)
            assert await feed_listeners(admin) == 1, "the page was never held"
            assert not held.done()

            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            done, _ = await asyncio.wait({held}, timeout=20)
            assert held in done, "the held page was not answered when the server stopped"
            r = held.result()
            assert r.status_code == 200, r.text
            assert r.json() == {"items": [], "next_cursor": cursor, "has_more": False}
        assert await asyncio.to_thread(server.proc.wait, 20) == 0, server.log_text()
        assert await feed_listeners(admin) == 0
    finally:
        await admin.close()
        if server.proc is not None and server.proc.poll() is None:
            server.stop()


async def test_the_servers_shutdown_cuts_a_connection_never_handed_back(
    database_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task took a pool connection (in a transaction) and never handed it back: the server's
    lifespan still ends, the connection is terminated after POOL_CLOSE_SECONDS, and the log says
    so. asyncpg's own close would wait for that connection for ever."""
    import ledger.db
    from api.config import ServerConfig
    from api.http.server import make_app
    from runtime.secrets import digest

    monkeypatch.setattr(ledger.db, "POOL_CLOSE_SECONDS", 1.0)
    config = ServerConfig(state_dir=tmp_path / "state", startup_refresh=False)
    app = make_app(config, database_dsn, digest(OPERATOR_TOKEN))
    with structlog.testing.capture_logs() as logs:
        try:
            async with asyncio.timeout(30), app.lifespan():
                leaked = await app.state.ctx.pool.acquire()
                await leaked.execute("BEGIN")
                backend = leaked.get_server_pid()
        except TimeoutError:
            raise AssertionError("the server's shutdown waited on the connection for ever") from None
    closed = [e for e in logs if e["event"] == "pool.close_terminated"]
    assert closed and closed[0]["in_use_when_closing"] == 1, logs
    admin = await asyncpg.connect(database_dsn)
    try:
        for _ in range(200):  # its backend ends once it sees the connection gone
            if not await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", backend):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the connection never handed back is still open")
    finally:
        await admin.close()
