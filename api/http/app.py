"""The Litestar application: the hardware routes, bearer-token auth, RFC 9457 problem+json errors.

Routes get their services as Litestar dependencies (`Provide`) from the process's `AppContext`,
whose services `api.wiring` builds; routes never construct a service."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import asyncpg
import msgspec
import structlog
from litestar import Litestar, MediaType, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import Components, SecurityScheme
from litestar.params import FromPath, FromQuery, HeaderParameter, QueryParameter
from litestar.response import Stream

from api.http import api_docs, fast_reads, guards, openapi_contract, problems, readiness
from api.http.agent import agent_routers
from api.http.console import ConsolePlugin
from api.http.context import DEPENDENCIES, AppContext, operator_guard
from api.http.decommission import decommission_routers
from api.http.discovery import DISCOVERY_ROUTES
from api.http.fast_report import report_front
from api.http.gpu_history import GPU_HISTORY_ROUTES
from api.http.health_policy import health_policy_routers
from api.http.telemetry import TELEMETRY_ROUTES
from api.http.webhooks import webhook_routers
from api.services.errors import Conflict, DomainError, Unavailable
from api.services.inventory import EventSummary, RefreshOutcome
from api.services.metrics import exposition
from api.services.metrics.snapshot import Snapshot, read_snapshot, released
from api.services.reads.bodies import (
    MAX_LIMIT,
    AcceleratorBody,
    AcceleratorPage,
    EventPage,
    HealthBody,
    InventoryHealth,
    NodeBody,
    NodePage,
    ReplicaHealth,
)
from api.services.reads.cursors import BadCursor
from api.services.reads.health import inventory_health, replay_lag
from api.services.reads.hot import AcceleratorQuery, AcceleratorStatus, HealthStatus
from api.services.reads.liveness import Liveness
from api.services.reads.rendering import Rendered, not_modified, render
from api.services.reads.repository import HardwareRepository
from api.wiring import Services
from runtime.process import DeferredCollections
from runtime.version import VERSION

log = structlog.get_logger(__name__)

Limit = Annotated[int, QueryParameter(ge=1, le=MAX_LIMIT)]
# A long poll longer than common proxy idle timeouts (60 s) would be cut by them.
MAX_WAIT_SECONDS = 60


# --- health ------------------------------------------------------------------------------------


@get("/health", summary="Process and inventory health (no auth); 503 while the database is unreachable")
async def health(context: NamedDependency[AppContext]) -> Response[HealthBody]:
    try:
        inventory = await inventory_health(context.pool)
        database = "ok"
    except (asyncpg.PostgresError, *readiness.DATABASE_UNAVAILABLE) as exc:
        log.warning("health.database_unavailable", error=str(exc))
        inventory = InventoryHealth(status="pending", reasons=["database unavailable"], nodes=0)
        database = "unavailable"
    replica = await _replica_health(context)
    body = HealthBody(
        status="ok" if database == "ok" and (replica is None or replica.status == "ok") else "degraded",
        database=database,  # type: ignore[arg-type]
        inventory=inventory,
        version=VERSION,
        replica=replica,
    )
    # Not ready without its database: 503, so a health check (compose, a load balancer) acts.
    return Response(body, status_code=200 if database == "ok" else 503)


async def _replica_health(context: AppContext) -> ReplicaHealth | None:
    """The read standby's state, where reads are served from one. Its absence degrades the health
    but is no 503: writes (agent reports) are still taken."""
    read_pool = context.repository.pool
    if read_pool is context.pool:
        return None
    try:
        return ReplicaHealth(status="ok", replay_lag_seconds=await replay_lag(read_pool))
    except (asyncpg.PostgresError, *readiness.DATABASE_UNAVAILABLE) as exc:
        log.warning("health.replica_unavailable", error=str(exc))
        return ReplicaHealth(status="unavailable", replay_lag_seconds=None)


# --- hardware ----------------------------------------------------------------------------------


class RefreshBody(msgspec.Struct):
    node_id: str
    outcome: Literal["succeeded", "failed"]
    inventory_status: str
    reasons: list[str]
    nvml_status: str | None
    duration_seconds: float
    events: list[EventSummary]


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
async def refresh(context: NamedDependency[AppContext]) -> RefreshBody:
    if not context.local_refresh_enabled:
        raise Conflict(
            "local-refresh-disabled",
            "Local refresh is not configured",
            "this server has no local collectors (it is not a compute node)",
        )
    outcome = await context.services.inventory.refresh()
    if outcome.outcome == "failed":
        raise Unavailable(
            "inventory-collection-failed",
            "Hardware inventory collection failed",
            "; ".join(outcome.reasons) + " (the last successful inventory is kept)",
        )
    return refresh_body(outcome)


InventoryStatus = Literal["pending", "ok", "degraded", "failed"]


@get("/hardware/nodes", summary="Compute nodes (filters: hostname, liveness, inventory_status, health)")
async def list_nodes(
    services: NamedDependency[Services],
    hostname: Annotated[str | None, QueryParameter(description="exact, case-insensitive")] = None,
    liveness: FromQuery[Liveness | None] = None,
    inventory_status: FromQuery[InventoryStatus | None] = None,
    health: Annotated[
        HealthStatus | None,
        QueryParameter(description="the node's worst GPU verdict (health.status; healthy without GPUs)"),
    ] = None,
    cursor: FromQuery[str | None] = None,
    limit: Limit = 100,
    as_of: FromQuery[datetime | None] = None,
) -> NodePage:
    if as_of is not None:
        # The inventory folded at that moment is one page; the filters narrow it the same way.
        return await services.audit.nodes_as_of(
            _aware(as_of),
            hostname=hostname,
            liveness=liveness,
            inventory_status=inventory_status,
            health=health,
        )
    items, next_cursor = await services.repository.nodes.page(
        cursor=cursor,
        limit=limit,
        hostname=hostname,
        liveness=liveness,
        inventory_status=inventory_status,
        health=health,
    )
    return NodePage(items=items, next_cursor=next_cursor)


NOT_MODIFIED = {304: ResponseSpec(None, description="Not modified: the If-None-Match tag is current")}
IfNoneMatch = Annotated[
    str | None, HeaderParameter(name="If-None-Match", description="an ETag from an earlier answer")
]


def _tagged(body: Any, if_none_match: str | None) -> Response[Any]:
    """The body with a strong ETag over its JSON; 304 without a body when the caller has it."""
    return _answer(render(body), if_none_match)


def _answer(rendered: Rendered, if_none_match: str | None) -> Response[Any]:
    if not_modified(rendered, if_none_match):
        return Response(None, status_code=304, headers={"ETag": rendered.etag})
    return Response(rendered.body, media_type=MediaType.JSON, headers={"ETag": rendered.etag})


@get(
    "/hardware/nodes/{node_id:str}",
    summary="One compute node (ETag, If-None-Match)",
    responses=NOT_MODIFIED,
    middleware=[fast_reads.node_fast_path],
)
async def get_node(
    services: NamedDependency[Services],
    node_id: FromPath[str],
    as_of: FromQuery[datetime | None] = None,
    if_none_match: IfNoneMatch = None,
) -> Response[NodeBody]:
    if as_of is not None:
        node = await services.audit.node_as_of(_aware(as_of), node_id)
        if node is None:
            raise problems.not_found("node", f"{node_id} (as of {as_of.isoformat()})")
        return _tagged(node, if_none_match)
    rendered = await services.reads.node(node_id)
    if rendered is None:
        raise problems.not_found("node", node_id)
    return _answer(rendered, if_none_match)


@get(
    "/hardware/accelerators",
    summary="Accelerators (filters: node_id, status, model, health)",
    middleware=[fast_reads.page_fast_path],
)
async def list_accelerators(
    services: NamedDependency[Services],
    node_id: FromQuery[str | None] = None,
    status: FromQuery[AcceleratorStatus | None] = None,
    model: Annotated[str | None, QueryParameter(description="the model name, e.g. NVIDIA H200")] = None,
    health: Annotated[
        HealthStatus | None, QueryParameter(description="the GPU's health verdict (health.status)")
    ] = None,
    cursor: FromQuery[str | None] = None,
    limit: Limit = 100,
    as_of: FromQuery[datetime | None] = None,
) -> Response[AcceleratorPage]:
    if as_of is not None:
        page = await services.audit.accelerators_as_of(
            _aware(as_of), node_id=node_id, status=status, model=model, health=health
        )
        return Response(page)

    rendered = await services.reads.accelerator_page(
        AcceleratorQuery(
            node_id=node_id, status=status, model=model, health=health, cursor=cursor, limit=limit
        )
    )
    answer: Response[Any] = Response(rendered.body, media_type=MediaType.JSON)
    return answer


@get(
    "/hardware/accelerators/{accelerator_id:str}",
    summary="One accelerator (ETag, If-None-Match)",
    responses=NOT_MODIFIED,
)
async def get_accelerator(
    repository: NamedDependency[HardwareRepository],
    accelerator_id: FromPath[str],
    if_none_match: IfNoneMatch = None,
) -> Response[AcceleratorBody]:
    acc = await repository.accelerators.get(accelerator_id)
    if acc is None:
        raise problems.not_found("accelerator", accelerator_id)
    return _tagged(acc, if_none_match)


@get(
    "/hardware/events",
    summary="The audit log (filters: node_id, type, class, accelerator_uuid, since, until)",
)
async def list_events(
    repository: NamedDependency[HardwareRepository],
    node_id: FromQuery[str | None] = None,
    event_type: Annotated[list[str] | None, QueryParameter(name="type")] = None,
    event_class: Annotated[Literal["lifecycle", "observation"] | None, QueryParameter(name="class")] = None,
    accelerator_uuid: FromQuery[str | None] = None,
    since: FromQuery[datetime | None] = None,
    until: FromQuery[datetime | None] = None,
    cursor: FromQuery[str | None] = None,
    limit: Limit = 100,
    wait: Annotated[
        int,
        QueryParameter(
            ge=0,
            le=MAX_WAIT_SECONDS,
            description="seconds to hold an empty page until an event commits (the change feed)",
        ),
    ] = 0,
) -> EventPage:
    types = [t for v in (event_type or []) for t in v.split(",") if t] or None
    return await repository.events.page(
        node_id=node_id,
        types=types,
        event_class=event_class,
        accelerator_uuid=accelerator_uuid,
        since=since,
        until=until,
        cursor=cursor,
        limit=limit,
        wait_seconds=wait,
    )


@get(
    "/metrics",
    summary="Latest telemetry in the Prometheus text format (known values only); see docs/metrics.md",
    media_type=exposition.CONTENT_TYPE,
    guards=[operator_guard],
    security=[{"bearer": []}],
)
async def metrics(context: NamedDependency[AppContext]) -> Stream:
    # The older collections wait from the read until the scrape's rows are released, in one
    # deferral: ended between the read and the text, or with the rows still alive, the first
    # older pass after it would go over every row with the event loop held.
    deferred = DeferredCollections()
    try:
        snapshot = await _scrape_snapshot(context)
    except BaseException:
        deferred.end()
        raise
    held = [snapshot]  # the text's own: the rows die when it releases them, not with this frame
    del snapshot

    async def text() -> AsyncIterator[bytes]:
        # A fleet's text is hundreds of MB made in seconds of Python: sent in pieces as they are
        # made, with the event loop free between them for the agents' reports.
        try:
            scrape = held.pop()
            for chunk in exposition.render_chunks(scrape):
                if chunk:  # an empty piece is rows without a line: nothing to send, the loop still runs
                    yield chunk
                await asyncio.sleep(0)
            await released(scrape)
        finally:
            deferred.end()

    # Set here: Litestar would append a second `charset` to a text/ media type.
    return Stream(
        text(), media_type=exposition.CONTENT_TYPE, headers={"content-type": exposition.CONTENT_TYPE}
    )


async def _scrape_snapshot(context: AppContext) -> Snapshot:
    counters = context.service.counters
    snapshot = await read_snapshot(
        context.pool,
        context.repository.liveness,
        {
            "refreshes": counters.refreshes,
            "failures": counters.failures,
            "events": counters.events,
            "report_transactions": context.services.reports.group_commit.batches,
            "reports_committed": context.services.reports.group_commit.units,
            "rendered_hits": context.services.rendered.hits,
            "rendered_misses": context.services.rendered.misses,
            "rendered_probes": context.services.rendered.probes,
            "state_cache_hits": context.service.store.states.hits,
            "state_cache_misses": context.service.store.states.misses,
            "kept_appends": context.service.store.states.kept_appends,
            "kept_appends_stale": context.service.store.states.stale,
            "kept_positions_stale": context.services.reports.positions.stale,
            "folded_appends": context.service.store.states.folded_appends,
            "folded_appends_refused": context.service.store.states.folded_refused,
            "positions_reserved": context.service.store.reserved.reservations,
            "fast_reads": context.fast_reads,
            "telemetry_hours_stored": context.telemetry_hours.stored_total,
            "telemetry_hours_short_passes": context.telemetry_hours.short_passes,
        },
        context.repository.clock(),  # the read side's one clock judges liveness here too
    )
    replica = await _replica_health(context)
    if replica is not None and replica.replay_lag_seconds is not None:
        snapshot = msgspec.structs.replace(snapshot, replay_lag=replica.replay_lag_seconds)
    return snapshot


def _aware(moment: datetime) -> datetime:
    """A moment without an offset is taken as UTC (the ledger's clock), never as server-local."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


HARDWARE_ROUTES: list[Any] = [
    refresh,
    list_nodes,
    get_node,
    list_accelerators,
    get_accelerator,
    list_events,
    *TELEMETRY_ROUTES,
    *DISCOVERY_ROUTES,
    *GPU_HISTORY_ROUTES,
]


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

    app = Litestar(
        route_handlers=[
            public,
            operator,
            metrics,
            *agent_routers(),
            *decommission_routers(),
            *health_policy_routers(),
            *webhook_routers(),
            *(extra_routers or []),
            api_docs.assets_router(),
        ],
        exception_handlers={
            DomainError: problems.handle_domain_error,
            BadCursor: problems.handle_bad_cursor,
            ValidationException: problems.handle_validation,
            HTTPException: problems.handle_http,
            **readiness.exception_handlers(),
            Exception: problems.handle_unexpected,
        },
        middleware=[guards.refuse_hostile_input, guards.complete_allow_header],
        before_request=guards.refuse_unknown_query_parameters,
        plugins=[openapi_contract.IntegerIsANumber(), ConsolePlugin()],
        openapi_config=OpenAPIConfig(
            title="ModelForge hardware plane",
            version=VERSION,
            path="/schema",
            components=Components(security_schemes={"bearer": SecurityScheme(type="http", scheme="bearer")}),
            operation_id_creator=lambda handler, _method, _path: openapi_contract.operation_id(
                handler.handler_name
            ),
            render_plugins=[api_docs.swagger_ui()],
        ),
        dependencies=DEPENDENCIES,
        lifespan=[lifespan] if lifespan else [],
        # Logging is runtime.logs' (one structlog stream); Litestar's default would install a
        # plain-text root handler of its own.
        logging_config=None,
        request_max_body_size=1024 * 1024,
        debug=False,
    )
    if context is not None:
        app.state.ctx = context
    openapi_contract.install(app)
    # The agents' reports are answered in front of the router (api/http/fast_report.py).
    app.asgi_handler = report_front(app.asgi_handler, app)
    return app
