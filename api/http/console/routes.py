"""The console's routes: server-rendered pages over the API's read side (docs/console.md).

Every page but the login form needs the console cookie, which holds a bearer token accepted by the
same check as the API's operator routes; it is HttpOnly and SameSite=Strict, so page scripts cannot
read it and other sites cannot send it. Pages only read; nothing here appends an event.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, cast
from urllib.parse import urlencode

import msgspec
import structlog
from litestar import Request, Response, Router, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.enums import RequestEncodingType
from litestar.exceptions import NotAuthorizedException, NotFoundException
from litestar.handlers.base import BaseRouteHandler
from litestar.params import Body, FromPath, FromQuery, QueryParameter
from litestar.response import Redirect, Template

from api.http.console import views
from api.http.console.charts import CHART_BUCKETS, GPU_CHARTS, HOST_CHARTS, WINDOWS, Chart, charts_of
from api.http.console.lemons import lemons_page
from api.http.context import AppContext
from api.services.reads.bodies import AcceleratorBody, EventBody, NodeBody
from api.services.reads.cursors import BadCursor
from api.services.reads.fleet import FleetQuery
from api.services.reads.gpu_health import gpu_health_overview
from api.services.reads.telemetry import checked_window
from api.services.scopes import OperatorTokens
from api.services.wording import fact_label
from domain.lemons import SinceRefused
from ledger.events import EventClass
from runtime.secrets import matches

log = structlog.get_logger(__name__)

COOKIE = "mf_console_token"
PAGE_SIZE = 50
EVENT_PAGE_SIZE = 100
TIMELINE_LIMIT = 200
LIVENESS = ("online", "stale", "offline", "local")
INVENTORY = ("pending", "ok", "degraded", "failed")
STATUSES = ("active", "decommissioned")
HEALTH = ("healthy", "degraded", "failed")


class BadInput(ValueError):
    """A query parameter the console cannot use; shown on the page as a 400."""


def _ctx(connection: ASGIConnection[Any, Any, Any, Any]) -> AppContext:
    context: AppContext = connection.app.state.ctx
    return context


async def token_accepted(connection: ASGIConnection[Any, Any, Any, Any], token: str) -> bool:
    """The API's read check, applied to the cookie's token: the operator token, or a live viewer
    token (every console page is a read)."""
    if not token:
        return False
    if matches(token, _ctx(connection).admin_token_hash):
        return True
    return await OperatorTokens(_ctx(connection).pool).scope_of(token) == "viewer"


async def console_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    token = connection.cookies.get(COOKIE, "")
    if not await token_accepted(connection, token):
        raise NotAuthorizedException("sign in to the console")


def _to_login(request: Request[Any, Any, Any], _: NotAuthorizedException) -> Response[Any]:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    login = "/console/login?" + urlencode({"next": target})
    if request.headers.get("hx-request"):
        # An HTMX poll after the cookie expired: have htmx load the login page, not swap it in.
        return Response(content="", status_code=401, headers={"HX-Redirect": login})
    return Redirect(login, status_code=303)


def _error_page(request: Request[Any, Any, Any], status: int, title: str, detail: str) -> Template:
    return Template(
        template_name="error.html.j2",
        context={"title": title, "detail": detail, "as_of": None, "as_of_q": "", "supports_as_of": False},
        status_code=status,
    )


def _bad_input(request: Request[Any, Any, Any], exc: Exception) -> Template:
    return _error_page(request, 400, "Invalid input", str(exc))


def _not_found(request: Request[Any, Any, Any], exc: NotFoundException) -> Template:
    return _error_page(request, 404, "Not found", exc.detail)


def _safe_next(target: str | None) -> str:
    """Only a console path: the login form never redirects off this server."""
    if target and target.startswith("/console") and not target.startswith("/console/login"):
        return target
    return "/console"


def _as_of(text: str | None) -> datetime | None:
    try:
        return views.parse_moment(text)
    except ValueError as exc:
        raise BadInput(str(exc)) from exc


def _choice(value: str | None, allowed: tuple[str, ...], name: str) -> str:
    if not value:
        return ""
    if value not in allowed:
        raise BadInput(f"{name} must be one of {', '.join(allowed)}")
    return value


_AS_OF_PAGES = ("fleet.html.j2", "node.html.j2", "gpu.html.j2")


class ChartWindow(msgspec.Struct, frozen=True):
    name: str  # "1h" | "6h" | "24h"
    since: datetime
    until: datetime

    @property
    def step_seconds(self) -> int:
        return int((self.until - self.since).total_seconds()) // CHART_BUCKETS


def _chart_window(request: Request[Any, Any, Any], value: str | None, moment: datetime | None) -> ChartWindow:
    """The charts' window, ending at the page's moment (now, or its as-of moment)."""
    name = _choice(value, tuple(WINDOWS), "window") or "1h"
    until = moment or _ctx(request).repository.clock()
    return ChartWindow(name=name, since=until - WINDOWS[name], until=until)


def _page(template: str, as_of: datetime | None, **context: Any) -> Template:
    as_of_q = ("?" + urlencode({"as_of": views.form_moment(as_of)})) if as_of else ""
    return Template(
        template_name=template,
        context={"as_of": as_of, "as_of_q": as_of_q, "supports_as_of": template in _AS_OF_PAGES, **context},
    )


# --- login ---------------------------------------------------------------------------------------


class LoginForm(msgspec.Struct):
    token: str = ""
    next: str = "/console"


@get("/login", name="console-login-form")
async def login_form(next: FromQuery[str | None] = None) -> Template:
    return _page("login.html.j2", None, next=_safe_next(next), error="")


@post("/login", status_code=303)
async def login(
    request: Request[Any, Any, Any],
    data: Annotated[LoginForm, Body(media_type=RequestEncodingType.URL_ENCODED)],
) -> Response[Any]:
    token = data.token.strip()
    if not await token_accepted(request, token):
        log.info("console.login_refused")
        return Template(
            template_name="login.html.j2",
            context={
                "as_of": None,
                "as_of_q": "",
                "supports_as_of": False,
                "next": _safe_next(data.next),
                "error": "That token is not accepted.",
            },
            status_code=401,
        )
    log.info("console.login")
    return Redirect(
        _safe_next(data.next),
        status_code=303,
        cookies=[
            Cookie(
                key=COOKIE,
                value=token,
                path="/console",
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        ],
    )


@post("/logout", status_code=303)
async def logout() -> Response[Any]:
    response: Response[Any] = Redirect("/console/login", status_code=303)
    response.delete_cookie(COOKIE, path="/console")
    return response


# --- fleet ---------------------------------------------------------------------------------------


@get("/", name="console-fleet")
async def fleet(
    request: Request[Any, Any, Any],
    q: FromQuery[str | None] = None,
    liveness: FromQuery[str | None] = None,
    # Named apart from the app's `inventory` dependency, which a same-named parameter would shadow.
    inventory_filter: Annotated[str | None, QueryParameter(name="inventory")] = None,
    status: FromQuery[str | None] = None,
    health: FromQuery[str | None] = None,
    cursor: FromQuery[str | None] = None,
    as_of: FromQuery[str | None] = None,
) -> Template:
    moment = _as_of(as_of)
    query = FleetQuery(
        search=(q or "").strip(),
        liveness=_choice(liveness, LIVENESS, "liveness"),
        inventory_status=_choice(inventory_filter, INVENTORY, "inventory"),
        status=_choice(status, STATUSES, "status"),
        health=_choice(health, HEALTH, "health"),
    )
    c = _ctx(request)
    position = None
    overview = None
    if moment is None:
        rows, counts, next_cursor = await c.repository.fleet.page(query, cursor=cursor, limit=PAGE_SIZE)
        overview = await gpu_health_overview(c.repository.pool)
    else:
        # A past fleet is one fold of the log: one page.
        rows, counts, position = await c.services.audit.fleet_as_of(moment, query)
        next_cursor = None
    filters = {
        k: v
        for k, v in (
            ("q", query.search),
            ("liveness", query.liveness),
            ("inventory", query.inventory_status),
            ("status", query.status),
            ("health", query.health),
            ("as_of", views.form_moment(moment)),
        )
        if v
    }
    return _page(
        "fleet.html.j2",
        moment,
        rows=rows,
        counts=counts,
        overview=overview,
        query=query,
        position=position,
        liveness_states=LIVENESS,
        inventory_states=INVENTORY,
        statuses=STATUSES,
        health_states=HEALTH,
        next_url="/console/?" + urlencode({**filters, "cursor": next_cursor}) if next_cursor else None,
        first_url=("/console/?" + urlencode(filters)) if cursor else None,
    )


# --- node and GPU ----------------------------------------------------------------------------------


async def _node(request: Request[Any, Any, Any], node_id: str, moment: datetime | None) -> NodeBody:
    c = _ctx(request)
    if moment is None:
        node = await c.repository.nodes.get(node_id)
    else:
        node = await c.services.audit.node_as_of(moment, node_id)
    if node is None:
        when = f" as of {views.moment(moment)}" if moment else ""
        raise NotFoundException(f"no node {node_id}{when}")
    return node


async def _accelerators(
    request: Request[Any, Any, Any], node_id: str, moment: datetime | None
) -> list[AcceleratorBody]:
    c = _ctx(request)
    if moment is not None:
        past = await c.services.audit.accelerators_as_of(moment, node_id=node_id)
        return past.items
    out: list[AcceleratorBody] = []
    cursor = None
    while True:
        page, cursor = await c.repository.accelerators.page(
            node_id=node_id, status=None, cursor=cursor, limit=1000
        )
        out += page
        if cursor is None:
            return out


def _gpu_order(a: AcceleratorBody) -> tuple[int, int, str]:
    # Present GPUs first, by index; missing and retired ones after them.
    rank = {"active": 0, "missing": 1, "decommissioned": 2}[a.status]
    return (rank, a.index if a.index is not None else 1 << 30, a.uuid)


@get("/nodes/{node_id:str}", name="console-node")
async def node_page(
    request: Request[Any, Any, Any],
    node_id: FromPath[str],
    as_of: FromQuery[str | None] = None,
    window: FromQuery[str | None] = None,
) -> Template:
    moment = _as_of(as_of)
    chart_window = _chart_window(request, window, moment)
    node = await _node(request, node_id, moment)
    accelerators = sorted(await _accelerators(request, node_id, moment), key=_gpu_order)
    page = await _ctx(request).repository.events.page(
        node_id=node_id, event_class="lifecycle", until=_after(moment), limit=TIMELINE_LIMIT
    )
    timeline = page.items
    changed = next((e for e in timeline if e.global_position == node.fingerprint_position), None)
    metric_names = sorted({m for a in accelerators for m in a.telemetry})
    host_history = await _ctx(request).repository.telemetry.node(
        node_id, checked_window(chart_window.since, chart_window.until, chart_window.step_seconds)
    )
    return _page(
        "node.html.j2",
        moment,
        node=node,
        chart_window=chart_window,
        charts=charts_of(host_history, HOST_CHARTS, fact_label),
        accelerators=accelerators,
        metric_names=metric_names,
        timeline=timeline,
        timeline_truncated=page.has_more,
        fingerprint_changed=changed,
    )


def _after(moment: datetime | None) -> datetime | None:
    """`until` is exclusive and the point-in-time read includes `moment`: one microsecond more."""
    from datetime import timedelta

    return None if moment is None else moment + timedelta(microseconds=1)


@get("/gpus/{accelerator_id:str}", name="console-gpu")
async def gpu_page(
    request: Request[Any, Any, Any],
    accelerator_id: FromPath[str],
    as_of: FromQuery[str | None] = None,
    window: FromQuery[str | None] = None,
) -> Template:
    moment = _as_of(as_of)
    chart_window = _chart_window(request, window, moment)
    c = _ctx(request)
    current = await c.repository.accelerators.get(accelerator_id)
    if current is None:
        raise NotFoundException(f"no GPU {accelerator_id}")
    acc: AcceleratorBody | None = current
    if moment is not None:
        acc = await c.services.audit.accelerator_as_of(moment, accelerator_id)
        if acc is None:
            raise NotFoundException(f"GPU {accelerator_id} was not known as of {views.moment(moment)}")
    assert acc is not None
    node = await c.repository.nodes.get(acc.node_id)
    history_page = await c.repository.events.page(
        node_id=acc.node_id,
        accelerator_uuid=acc.uuid,
        until=_after(moment),
        limit=TIMELINE_LIMIT,
        event_class="lifecycle",
    )
    history = history_page.items
    gpu_history = await c.repository.telemetry.accelerator(
        accelerator_id, checked_window(chart_window.since, chart_window.until, chart_window.step_seconds)
    )
    charts: list[Chart] = charts_of(gpu_history, GPU_CHARTS, fact_label)
    return _page(
        "gpu.html.j2",
        moment,
        gpu=acc,
        chart_window=chart_window,
        charts=charts,
        node=node,
        metric_names=sorted(acc.telemetry),
        history=history,
        history_truncated=history_page.has_more,
    )


@get("/nodes/{node_id:str}/decommission", name="console-decommission")
async def decommission_preview(request: Request[Any, Any, Any], node_id: FromPath[str]) -> Template:
    from api.services.errors import DomainError

    c = _ctx(request)
    service = c.services.decommission
    node = await c.repository.nodes.get(node_id)
    if node is None:
        raise NotFoundException(f"no node {node_id}")
    try:
        preview = await service.preview(node_id)
        problem = None
    except DomainError as exc:
        preview, problem = None, exc
    return _page("decommission.html.j2", None, node=node, preview=preview, problem=problem)


# --- events --------------------------------------------------------------------------------------


class EventFilters(msgspec.Struct, frozen=True):
    node: str = ""
    type: str = ""
    event_class: str = ""
    since: datetime | None = None
    until: datetime | None = None

    def params(self) -> dict[str, str]:
        out = {
            "node": self.node,
            "type": self.type,
            "class": self.event_class,
            "since": views.form_moment(self.since),
            "until": views.form_moment(self.until),
        }
        return {k: v for k, v in out.items() if v}


def _event_filters(
    node: str | None, type: str | None, event_class: str | None, since: str | None, until: str | None
) -> EventFilters:
    return EventFilters(
        node=(node or "").strip(),
        type=(type or "").strip().upper(),
        event_class=_choice(event_class, ("lifecycle", "observation"), "class"),
        since=_as_of(since),
        until=_as_of(until),
    )


async def _read_events(
    request: Request[Any, Any, Any], f: EventFilters, cursor: str | None
) -> tuple[list[EventBody], str | None, str | None]:
    """A page of the gap-safe audit read: its events, the next page's cursor (None at the end of
    the log) and the cursor just after the page, from which a live follow continues."""
    repo = _ctx(request).repository
    types = [t for t in f.type.split(",") if t] or None
    try:
        page = await repo.events.page(
            node_id=f.node or None,
            types=types,
            event_class=cast("EventClass | None", f.event_class or None),  # one of them (`_choice`)
            since=f.since,
            until=f.until,
            cursor=cursor,
            limit=EVENT_PAGE_SIZE,
        )
    except BadCursor as exc:
        raise BadInput(str(exc)) from exc
    # Every page of the log carries the cursor to resume from: the next page's while it was cut
    # by its limit, and, at the end, where a live follow continues.
    return page.items, page.next_cursor if page.has_more else None, page.next_cursor


def _feed_url(f: EventFilters, follow: str | None) -> str:
    """The poller of new rows for these filters, continuing after `follow` (from the start of the
    log without it)."""
    return "/console/events/feed?" + urlencode({**f.params(), **({"cursor": follow} if follow else {})})


@get("/events", name="console-events")
async def events_page(
    request: Request[Any, Any, Any],
    node: FromQuery[str | None] = None,
    type: FromQuery[str | None] = None,
    event_class: Annotated[str | None, QueryParameter(name="class")] = None,
    since: FromQuery[str | None] = None,
    until: FromQuery[str | None] = None,
    cursor: FromQuery[str | None] = None,
) -> Template:
    f = _event_filters(node, type, event_class, since, until)
    items, next_cursor, follow = await _read_events(request, f, cursor)
    return _page(
        "events.html.j2",
        None,
        events=items,
        filters=f,
        next_url="/console/events?" + urlencode({**f.params(), "cursor": next_cursor})
        if next_cursor
        else None,
        # At the end of the log (and with no end time) the page follows new events as they commit.
        feed_url=None if next_cursor or f.until else _feed_url(f, follow),
    )


@get("/events/feed", name="console-events-feed")
async def events_feed(
    request: Request[Any, Any, Any],
    node: FromQuery[str | None] = None,
    type: FromQuery[str | None] = None,
    event_class: Annotated[str | None, QueryParameter(name="class")] = None,
    since: FromQuery[str | None] = None,
    cursor: FromQuery[str | None] = None,
) -> Template:
    """New rows for the events table, and the poller again with the cursor after them."""
    f = _event_filters(node, type, event_class, since, None)
    items, _, follow = await _read_events(request, f, cursor)
    return _page("events_feed.html.j2", None, events=items, feed_url=_feed_url(f, follow))


@get("/webhooks", name="console-webhooks")
async def webhooks_page(request: Request[Any, Any, Any]) -> Template:
    """Every webhook subscription and its delivery state; the destination's origin only (a
    receiver's URL may hold its token, and viewers may read this page)."""
    items = await _ctx(request).services.webhooks.list_all()
    return _page("webhooks.html.j2", None, webhooks=items, destination=views.destination)


def _security_headers(response: Response[Any]) -> Response[Any]:
    # Everything the pages load comes from this server; nothing frames them; nothing is cached.
    response.headers.update(
        {
            "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        }
    )
    return response


def console_routers() -> list[Router]:
    from litestar.static_files import create_static_files_router

    from api.http.console import STATIC_DIR

    handlers = {
        NotAuthorizedException: _to_login,
        NotFoundException: _not_found,
        BadInput: _bad_input,
        SinceRefused: _bad_input,
    }
    public = Router(
        path="/console",
        route_handlers=[login_form, login, logout],
        exception_handlers=handlers,  # type: ignore[arg-type]
        after_request=_security_headers,
        include_in_schema=False,
    )
    pages = Router(
        path="/console",
        route_handlers=[
            fleet,
            node_page,
            gpu_page,
            decommission_preview,
            events_page,
            events_feed,
            lemons_page,
            webhooks_page,
        ],
        guards=[console_guard],
        exception_handlers=handlers,  # type: ignore[arg-type]
        after_request=_security_headers,
        include_in_schema=False,
    )
    static = create_static_files_router(
        path="/console/static", directories=[STATIC_DIR], name="console-static", include_in_schema=False
    )
    return [public, pages, static]
