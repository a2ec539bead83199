"""The Litestar application: routes, bearer-token auth, RFC 9457 problem+json errors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any

import asyncpg
import structlog
from litestar import Litestar, Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotAuthorizedException, ValidationException
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath, FromQuery, QueryParameter

from api import guards, observability, openapi_contract, problems, readiness
from api.config import tokens_match
from api.repository import AuditRepository, BadCursor, HardwareRepository, ObservabilityRepository
from api.schemas import (
    AcceleratorBody,
    AcceleratorPage,
    EventPage,
    HealthBody,
    NodeBody,
    NodePage,
    RefreshBody,
)
from api.service import HardwareInventoryService, NodeTombstoned, RefreshOutcome

log = structlog.get_logger(__name__)

VERSION = "0.1.0"
MAX_LIMIT = 1000
Limit = Annotated[int, QueryParameter(ge=1, le=MAX_LIMIT)]


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
        enrollment: Any = None,
    ) -> None:
        self.pool = pool
        self.service = service
        self.repository = repository
        self.audit = AuditRepository(pool, repository)
        self.observability = ObservabilityRepository(pool)
        self.admin_token_hash = admin_token_hash
        self.local_refresh_enabled = local_refresh_enabled
        # api.enrollment.EnrollmentService (agent routes); made on first use when None.
        self.enrollment = enrollment


def ctx(request: Request[Any, Any, Any] | ASGIConnection[Any, Any, Any, Any]) -> AppContext:
    context: AppContext = request.app.state.ctx
    return context


def bearer(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    header = connection.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def operator_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    # async: a sync guard would be run in a worker thread on every request, for no I/O at all.
    token = bearer(connection)
    if token is None:
        raise NotAuthorizedException("an operator bearer token is required (Authorization: Bearer ...)")
    if not tokens_match(token, ctx(connection).admin_token_hash):
        raise NotAuthorizedException("the bearer token is not a valid operator token")


# --- health ------------------------------------------------------------------------------------


@get("/health", summary="Process and inventory health (no auth); 503 while the database is unreachable")
async def health(request: Request[Any, Any, Any]) -> Response[HealthBody]:
    c = ctx(request)
    try:
        inventory = await c.repository.inventory_health()
        database = "ok"
    except (asyncpg.PostgresError, *readiness.DATABASE_UNAVAILABLE) as exc:
        log.warning("health.database_unavailable", error=str(exc))
        from api.schemas import InventoryHealth

        inventory = InventoryHealth(status="pending", reasons=["database unavailable"], nodes=0)
        database = "unavailable"
    body = HealthBody(
        status="ok" if database == "ok" else "degraded",
        database=database,  # type: ignore[arg-type]
        inventory=inventory,
        version=VERSION,
    )
    # Not ready without its database: 503, so a health check (compose, a load balancer) acts.
    return Response(body, status_code=200 if database == "ok" else 503)


# --- hardware ----------------------------------------------------------------------------------


def refresh_body(outcome: RefreshOutcome) -> RefreshBody:
    return RefreshBody(
        node_id=outcome.node_id,
        outcome=outcome.outcome,
        inventory_status=outcome.inventory_status,
        reasons=outcome.reasons,
        nvml_status=outcome.nvml_status,
        duration_seconds=outcome.duration_seconds,
        events=outcome.events,
    )


@post("/hardware/refresh", status_code=200, summary="Refresh the local host's inventory once")
async def refresh(request: Request[Any, Any, Any]) -> RefreshBody:
    c = ctx(request)
    if not c.local_refresh_enabled:
        raise problems.ProblemError(
            409,
            "local-refresh-disabled",
            "Local refresh is not configured",
            "this server has no local collectors (it is not a compute node)",
        )
    try:
        outcome = await c.service.refresh()
    except NodeTombstoned as exc:
        raise problems.ProblemError(410, "node-decommissioned", "Node is decommissioned", str(exc)) from exc
    if outcome.outcome == "failed":
        raise problems.ProblemError(
            503,
            "inventory-collection-failed",
            "Hardware inventory collection failed",
            "; ".join(outcome.reasons) + " (the last successful inventory is kept)",
        )
    return refresh_body(outcome)


@get("/hardware/nodes", summary="Compute nodes")
async def list_nodes(
    request: Request[Any, Any, Any],
    cursor: FromQuery[str | None] = None,
    limit: Limit = 100,
    as_of: FromQuery[datetime | None] = None,
) -> NodePage:
    if as_of is not None:
        nodes, position = await ctx(request).audit.nodes_as_of(_aware(as_of))
        return NodePage(items=nodes, next_cursor=None, as_of_position=position)
    items, next_cursor = await ctx(request).repository.list_nodes(cursor=cursor, limit=limit)
    return NodePage(items=items, next_cursor=next_cursor)


@get("/hardware/nodes/{node_id:str}", summary="One compute node")
async def get_node(
    request: Request[Any, Any, Any], node_id: FromPath[str], as_of: FromQuery[datetime | None] = None
) -> NodeBody:
    if as_of is not None:
        nodes, _ = await ctx(request).audit.nodes_as_of(_aware(as_of), node_id=node_id)
        if not nodes:
            raise problems.not_found("node", f"{node_id} (as of {as_of.isoformat()})")
        return nodes[0]
    node = await ctx(request).repository.get_node(node_id)
    if node is None:
        raise problems.not_found("node", node_id)
    return node


@get("/hardware/accelerators", summary="Accelerators (filters: node_id, status)")
async def list_accelerators(
    request: Request[Any, Any, Any],
    node_id: FromQuery[str | None] = None,
    status: FromQuery[str | None] = None,
    cursor: FromQuery[str | None] = None,
    limit: Limit = 100,
    as_of: FromQuery[datetime | None] = None,
) -> AcceleratorPage:
    if status is not None and status not in ("active", "missing", "decommissioned"):
        raise problems.ProblemError(
            400,
            "invalid-parameter",
            "Invalid parameter",
            "status must be one of active, missing, decommissioned",
        )
    if as_of is not None:
        accs, position = await ctx(request).audit.accelerators_as_of(
            _aware(as_of), node_id=node_id, status=status
        )
        return AcceleratorPage(items=accs, next_cursor=None, as_of_position=position)
    items, next_cursor = await ctx(request).repository.list_accelerators(
        node_id=node_id, status=status, cursor=cursor, limit=limit
    )
    return AcceleratorPage(items=items, next_cursor=next_cursor)


@get("/hardware/accelerators/{accelerator_id:str}", summary="One accelerator")
async def get_accelerator(request: Request[Any, Any, Any], accelerator_id: FromPath[str]) -> AcceleratorBody:
    acc = await ctx(request).repository.get_accelerator(accelerator_id)
    if acc is None:
        raise problems.not_found("accelerator", accelerator_id)
    return acc


@get(
    "/hardware/events",
    summary="The audit log (filters: node_id, type, class, accelerator_uuid, since, until)",
)
async def list_events(
    request: Request[Any, Any, Any],
    node_id: FromQuery[str | None] = None,
    event_type: Annotated[list[str] | None, QueryParameter(name="type")] = None,
    event_class: Annotated[str | None, QueryParameter(name="class")] = None,
    accelerator_uuid: FromQuery[str | None] = None,
    since: FromQuery[datetime | None] = None,
    until: FromQuery[datetime | None] = None,
    cursor: FromQuery[str | None] = None,
    limit: Limit = 100,
) -> EventPage:
    if event_class is not None and event_class not in ("lifecycle", "observation"):
        raise problems.ProblemError(
            400, "invalid-parameter", "Invalid parameter", "class must be lifecycle or observation"
        )
    types = [t for v in (event_type or []) for t in v.split(",") if t] or None
    return await ctx(request).repository.list_events(
        node_id=node_id,
        types=types,
        event_class=event_class,  # type: ignore[arg-type]  # checked just above
        accelerator_uuid=accelerator_uuid,
        since=since,
        until=until,
        cursor=cursor,
        limit=limit,
    )


@get(
    "/metrics",
    summary="Latest telemetry in the Prometheus text format (known values only)",
    media_type=observability.CONTENT_TYPE,
    guards=[operator_guard],
    security=[{"bearer": []}],
)
async def metrics(request: Request[Any, Any, Any]) -> str:
    c = ctx(request)
    return observability.render(await c.observability.samples(), c.service.counters)


def _aware(moment: datetime) -> datetime:
    """A moment without an offset is taken as UTC (the ledger's clock), never as server-local."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


HARDWARE_ROUTES: list[Any] = [refresh, list_nodes, get_node, list_accelerators, get_accelerator, list_events]


def create_app(
    context: AppContext | None = None,
    *,
    lifespan: Callable[[Litestar], contextlib.AbstractAsyncContextManager[None]] | None = None,
    extra_routers: list[Router] | None = None,
) -> Litestar:
    """Build the app around a ready context (tests) or a lifespan that makes one (serve)."""
    operator = Router(
        path="/api/v1", route_handlers=HARDWARE_ROUTES, guards=[operator_guard], security=[{"bearer": []}]
    )
    public = Router(path="/api/v1", route_handlers=[health, readiness.live])
    from api.agent_routes import agent_routers  # here: agent_routes imports this module
    from api.decommission_routes import decommission_routers  # likewise

    app = Litestar(
        route_handlers=[
            public,
            operator,
            metrics,
            *agent_routers(),
            *decommission_routers(),
            *(extra_routers or []),
        ],
        exception_handlers={
            problems.ProblemError: problems.handle_problem,
            BadCursor: problems.handle_bad_cursor,
            ValidationException: problems.handle_validation,
            HTTPException: problems.handle_http,
            **readiness.exception_handlers(),
            Exception: problems.handle_unexpected,
        },
        middleware=[guards.refuse_hostile_input],
        plugins=[openapi_contract.IntegerIsANumber()],
        openapi_config=OpenAPIConfig(
            title="ModelForge hardware plane",
            version=VERSION,
            path="/schema",
            components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
        ),
        lifespan=[lifespan] if lifespan else [],
        request_max_body_size=1024 * 1024,
        debug=False,
    )
    if context is not None:
        app.state.ctx = context
    return app
