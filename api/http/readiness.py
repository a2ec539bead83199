"""Liveness vs readiness, and the one mapping of 'the database is gone' to 503.

- `GET /api/v1/health/live` (no auth): 200 while the process runs; it touches nothing.
- `GET /api/v1/health` answers 503 while the database is unreachable (api.app.health).
- Any request that needs the database while it is unreachable (refused, reset, shutting down, in
  crash recovery, pool or connect timeout, no host of a multi-host URL accepting writes during a
  failover) answers 503 problem+json with `Retry-After`, and logs one
  warning line, no traceback: it is an outage, not a bug.
- A value the database refuses (class 22: out-of-range date, NUL, a number too large for its
  column) is the caller's input: 400 problem+json, never 500.
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import msgspec
import structlog
from litestar import Request, Response, get
from litestar.types import ExceptionHandlersMap

from api.http.problems import PROBLEM_BASE, Problem, respond

log = structlog.get_logger(__name__)

RETRY_AFTER_SECONDS = 5

# OSError covers refused and reset connections, a missing Unix socket and TimeoutError (pool
# acquire, connect); the asyncpg classes are a server shutting down, starting up or in recovery.
DATABASE_UNAVAILABLE: tuple[type[Exception], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
    asyncpg.InterfaceError,
    # What asyncpg raises on a pooled connection whose server vanished in the middle of an operation,
    # and (its subclass TargetServerAttributeNotMatched) when every host of a multi-host URL answers
    # but none accepts writes: a failover in progress.
    asyncpg.InternalClientError,
    # A connection that reached a server turned read-only (a demoted primary): the switch-over.
    asyncpg.ReadOnlySQLTransactionError,
)


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None  # the warning line says enough; an outage is not a bug
        record.exc_text = None
        return True


def quiet_reconnect_tracebacks() -> None:
    """asyncpg's pool logs a traceback each time it fails to reconnect during an outage; keep
    its one-line warning only (idempotent)."""
    pool_log = logging.getLogger("asyncpg.pool")
    if not any(isinstance(f, _NoTraceback) for f in pool_log.filters):
        pool_log.addFilter(_NoTraceback())


class Liveness(msgspec.Struct, frozen=True):
    status: str


@get("/health/live", summary="Liveness: 200 while the process runs (no auth, no database)")
async def live() -> Liveness:
    return Liveness(status="alive")


def database_unavailable(request: Request[Any, Any, Any], exc: Exception) -> Response[Problem]:
    if isinstance(exc, asyncpg.InterfaceError) and "connection" not in str(exc):
        # An InterfaceError that is not about a lost connection is a misuse of asyncpg: a bug.
        from api.http.problems import handle_unexpected

        return handle_unexpected(request, exc)
    log.warning("http.database_unavailable", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
    return respond(
        Problem(
            type=PROBLEM_BASE + "database-unavailable",
            title="Database unavailable",
            status=503,
            detail="the database cannot be reached right now; retry later",
        ),
        {"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def value_refused(request: Request[Any, Any, Any], exc: Exception) -> Response[Problem]:
    log.info("http.value_refused", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
    return respond(
        Problem(
            type=PROBLEM_BASE + "value-out-of-range",
            title="A value cannot be stored",
            status=400,
            detail=f"a value of the request cannot be stored: {str(exc).splitlines()[0][:200]}",
        )
    )


def exception_handlers() -> ExceptionHandlersMap:
    handlers: ExceptionHandlersMap = {t: database_unavailable for t in DATABASE_UNAVAILABLE}
    handlers[asyncpg.DataError] = value_refused
    return handlers
