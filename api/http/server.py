"""The server process: database, migrations, the app around the services `api.wiring` builds,
uvicorn, retention, telemetry hours, webhook delivery; used by `serve`."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import structlog
import uvicorn
import uvloop
from litestar import Litestar

from api.config import ServerConfig, load_or_create_admin_token
from api.http import readiness
from api.http.app import create_app
from api.http.context import AppContext
from api.http.one_write import OneWriteHttpProtocol
from api.services.webhook_delivery import DeliverySettings, WebhookDispatcher
from api.wiring import build_services, prepare_database
from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
from ledger.db import Database, close_pool, create_pool
from ledger.retention import prune_observations
from ledger.telemetry_hours import HoursPass, store_due
from runtime.process import settle_garbage_collector
from runtime.supervisor import EmbeddedSupervisor, run_with_supervisor

log = structlog.get_logger(__name__)


def build_context(
    pool: asyncpg.Pool, config: ServerConfig, admin_token_hash: str, read_pool: asyncpg.Pool | None = None
) -> AppContext:
    services = build_services(pool, config, read_pool=read_pool)
    return AppContext(
        pool=pool,
        service=services.inventory,
        repository=services.repository,
        admin_token_hash=admin_token_hash,
        services=services,
    )


async def retention_loop(pool: asyncpg.Pool, config: ServerConfig) -> None:
    """Bounded telemetry, applied continuously: small batches in short transactions, so ingest
    never waits on it (and the day segments whose day is over sealed: ledger/sealing.py). A
    failed pass is logged and retried at the next interval."""
    if config.retention_interval <= 0:
        return
    keep = timedelta(hours=config.retention_hours)
    while True:
        await asyncio.sleep(config.retention_interval)
        try:
            report = await prune_observations(pool, keep=keep)
            if report.deleted:
                log.info("retention.pruned", deleted=report.deleted, cutoff=report.cutoff.isoformat())
        except (asyncpg.PostgresError, OSError) as exc:
            log.warning("retention.failed", error=str(exc))


async def telemetry_hours_loop(pool: asyncpg.Pool, config: ServerConfig, memory: HoursPass) -> None:
    """Each node's closed hours stored as columns for the history reads, the newest first, at
    most a tenth of one core's time between two passes (ledger/telemetry_hours.py). Kept as long
    as retention keeps the log's day segments."""
    if config.telemetry_hours_interval <= 0:
        return
    keep = timedelta(hours=config.retention_hours) + timedelta(days=1)
    while True:
        await asyncio.sleep(config.telemetry_hours_interval)
        try:
            stored = await store_due(
                pool,
                memory,
                keep=keep,
                gpu_metrics=ACCELERATOR_METRICS,
                host_metrics=HOST_METRICS,
                budget=config.telemetry_hours_interval / 10,
            )
            if stored:
                log.info("telemetry_hours.stored", node_hours=stored)
        except (asyncpg.PostgresError, OSError) as exc:
            log.warning("telemetry_hours.failed", error=str(exc))


def delivery_settings(config: ServerConfig) -> DeliverySettings:
    return DeliverySettings(
        source=config.webhook_source,
        max_attempts=config.webhook_max_attempts,
        backoff_initial=config.webhook_backoff_initial,
        backoff_max=config.webhook_backoff_max,
        timeout=config.webhook_timeout,
        allow_private=config.webhook_allow_private,
    )


def make_app(config: ServerConfig, dsn: str, admin_token_hash: str) -> Litestar:
    readiness.quiet_reconnect_tracebacks()

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        # The report transactions' connections, and as many again for reads, retention and the feed.
        pool = await create_pool(dsn, min_size=2, max_size=max(10, 2 * config.report_transactions + 4))
        read_pool: asyncpg.Pool | None = None
        try:
            version = await prepare_database(pool)
            log.info("server.migrated", schema_version=version)
            if config.read_database_url:
                # No connection at start (min_size 0): a standby that is down only fails the reads.
                read_pool = await create_pool(config.read_database_url, min_size=0, max_size=10)
                log.info("server.read_standby", configured=True)
            context = build_context(pool, config, admin_token_hash, read_pool)
            app.state.ctx = context
            retention = asyncio.create_task(retention_loop(pool, config))
            app.state.retention_task = retention
            hours = asyncio.create_task(telemetry_hours_loop(pool, config, context.telemetry_hours))
            # Webhook delivery: a task of its own, never on the report path.
            dispatcher = WebhookDispatcher(pool, delivery_settings(config))
            context.services.webhooks.changed = dispatcher.wake
            delivery = asyncio.create_task(dispatcher.run())
            if config.startup_refresh:
                outcome = await context.service.refresh()
                log.info(
                    "server.startup_refresh",
                    outcome=outcome.outcome,
                    node_id=outcome.node_id,
                    inventory_status=outcome.inventory_status,
                )
            settle_garbage_collector()
            yield
            for task in (retention, hours, delivery):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            if read_pool is not None:
                await close_pool(read_pool)
            await close_pool(pool)

    return create_app(lifespan=lifespan)


class Server(uvicorn.Server):
    """uvicorn's server, whose graceful shutdown first releases the change feed's held pages: it
    waits for every request in flight, and a long poll would hold it for up to its `wait`."""

    def __init__(self, config: uvicorn.Config, app: Litestar) -> None:
        super().__init__(config)
        self.litestar = app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        context: AppContext | None = getattr(self.litestar.state, "ctx", None)
        if context is not None:
            context.repository.events.feed.release()
        await super().shutdown(sockets)


def _exit_normally(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def serve(config: ServerConfig) -> int:
    token_hash, token_path = load_or_create_admin_token(config)
    if token_path is not None:
        print(f"operator token: {token_path} (send it as 'Authorization: Bearer <token>')", flush=True)
    database = Database(config.database_url, config.state_dir)
    dsn = database.dsn()
    try:
        app = make_app(config, dsn, token_hash)
        server = Server(
            uvicorn.Config(
                app,
                host=config.host,
                port=config.port,
                log_config=None,
                access_log=False,
                lifespan="on",
                # httptools parses HTTP in C (h11, pure Python, costs a tenth of a report's CPU);
                # each response leaves in one write (api/http/one_write.py).
                http=OneWriteHttpProtocol,
            ),
            app,
        )
        log.info(
            "server.starting",
            host=config.host,
            port=config.port,
            database="configured" if config.database_url else "embedded",
        )
        # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal; turn that into a
        # normal exit so the embedded PostgreSQL below is stopped too.
        signal.signal(signal.SIGTERM, _exit_normally)
        supervisor = None
        if database.embedded is not None and database.embedded.server is not None:
            supervisor = EmbeddedSupervisor(
                database.embedded.server, dsn, on_give_up=lambda: setattr(server, "should_exit", True)
            )
        # uvloop: the event loop and its socket I/O in C (libuv). The loop's own bookkeeping and
        # socket writes to PostgreSQL were about a quarter of a report's server CPU on asyncio's.
        uvloop.run(run_with_supervisor(server.serve(), supervisor))
        if supervisor is not None and supervisor.gave_up:
            return 1  # the embedded PostgreSQL is gone for good: let systemd/compose restart us
        return 0 if server.started else 1
    finally:
        database.close()


async def open_pool(config: ServerConfig, database: Database) -> asyncpg.Pool:
    dsn = await asyncio.to_thread(database.dsn)
    pool = await create_pool(dsn, min_size=1, max_size=4)
    await prepare_database(pool)
    return pool
