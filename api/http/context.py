"""What every route shares: the process's `AppContext` (its services, built by `api.wiring`), the
routes' Litestar dependencies (`Provide`), and the bearer-token guards."""

from __future__ import annotations

from typing import Any

import asyncpg
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler

from api.services.audit import AuditRepository
from api.services.credentials import CredentialService
from api.services.decommission import DecommissionService
from api.services.enrollment import EnrollmentService
from api.services.errors import Forbidden
from api.services.health_policy import HealthPolicies
from api.services.inventory import HardwareInventoryService
from api.services.reads.repository import HardwareRepository
from api.services.reports import ReportService
from api.services.scopes import OperatorTokens, viewer_may
from api.services.webhooks import WebhookService
from api.wiring import Services
from ledger.telemetry_hours import HoursPass
from runtime.secrets import matches


class AppContext:
    """What the routes need, built once per process (by `serve` or by a test)."""

    def __init__(
        self,
        *,
        pool: asyncpg.Pool,
        service: HardwareInventoryService,
        repository: HardwareRepository,
        admin_token_hash: str,
        local_refresh_enabled: bool = True,
        services: Services | None = None,
    ) -> None:
        self.pool = pool
        self.services = services or Services(service, repository)
        self.service = self.services.inventory
        self.repository = self.services.repository
        self.admin_token_hash = admin_token_hash
        self.local_refresh_enabled = local_refresh_enabled
        self.fast_reads = 0  # reads api.http.fast_reads answered (the server's /metrics)
        # The server's telemetry-hours passes (api/http/server.py), their counts for /metrics.
        self.telemetry_hours = HoursPass()


def ctx(request: Request[Any, Any, Any] | ASGIConnection[Any, Any, Any, Any]) -> AppContext:
    context: AppContext = request.app.state.ctx
    return context


# Every provider reads the process's context from the app state itself: a dependency of a
# dependency is one more round of Litestar's resolution per request, and two dependencies at one
# level are resolved in an anyio task group, a task each (a tenth of a read's server CPU, profiled
# under bench.api). So every route takes exactly one of these; one that needs several services
# takes `services`, the bundle (tests/test_api_conventions.py holds every route to that).


def _context(state: State) -> AppContext:
    context: AppContext = state.ctx
    return context


def _services(state: State) -> Services:
    return _context(state).services


def _inventory(state: State) -> HardwareInventoryService:
    return _context(state).services.inventory


def _enrollment(state: State) -> EnrollmentService:
    return _context(state).services.enrollment


def _credentials(state: State) -> CredentialService:
    return _context(state).services.credentials


def _reports(state: State) -> ReportService:
    return _context(state).services.reports


def _decommission(state: State) -> DecommissionService:
    return _context(state).services.decommission


def _health_policies(state: State) -> HealthPolicies:
    return _context(state).services.inventory.health_policies


def _repository(state: State) -> HardwareRepository:
    return _context(state).services.repository


def _audit(state: State) -> AuditRepository:
    return _context(state).services.audit


def _webhooks(state: State) -> WebhookService:
    return _context(state).services.webhooks


# The routes' dependencies: each names the process's context, its services, or one service.
DEPENDENCIES = {
    "context": Provide(_context, sync_to_thread=False),
    "services": Provide(_services, sync_to_thread=False),
    "inventory": Provide(_inventory, sync_to_thread=False),
    "enrollment": Provide(_enrollment, sync_to_thread=False),
    "credentials": Provide(_credentials, sync_to_thread=False),
    "reports": Provide(_reports, sync_to_thread=False),
    "decommission": Provide(_decommission, sync_to_thread=False),
    "health_policies": Provide(_health_policies, sync_to_thread=False),
    "repository": Provide(_repository, sync_to_thread=False),
    "audit": Provide(_audit, sync_to_thread=False),
    "webhooks": Provide(_webhooks, sync_to_thread=False),
}


def bearer(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    return bearer_token(connection.headers.get("authorization", ""))


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header's value; None for anything else."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def operator_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    # async: a sync guard would be run in a worker thread on every request, for no I/O at all.
    token = bearer(connection)
    if token is None:
        raise NotAuthorizedException("an operator bearer token is required (Authorization: Bearer ...)")
    if matches(token, ctx(connection).admin_token_hash):
        return
    # A read-only (viewer) token: reads pass, anything else is refused as out of its scope.
    if await OperatorTokens(ctx(connection).pool).scope_of(token) == "viewer":
        method = connection.scope.get("method", "GET")  # a websocket has none: treat as a read
        if viewer_may(str(method), connection.scope["path"]):
            return
        raise Forbidden(
            "insufficient-scope",
            "Insufficient scope",
            "a viewer token may only read metrics, the inventory, the audit log and service discovery",
        )
    raise NotAuthorizedException("the bearer token is not a valid operator token")
