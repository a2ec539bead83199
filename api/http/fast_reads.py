"""The fast path of the two hot reads: a kept rendering sent without Litestar's handler around it.

`GET /api/v1/hardware/nodes/{node_id}` and `GET /api/v1/hardware/accelerators` are what a console
and an exporter poll. With their renderings kept (`api.services.reads.rendered`), a read costs little
more than the probe it joins, and what is left is the stack around the handler: the guard (Litestar
copies the handler for every guard call), the dependency, the parameter parsing, the response
object (docs/performance.md measured these at most of a kept read's server CPU). This middleware
sits on those two routes, after Litestar's routing and the app's own middlewares (the hostile-input
refusal among them), and answers the plain case itself:

  * GET with the admin token in `Authorization: Bearer ...` (the same hash comparison as the
    operator guard);
  * for a page, query parameters that are the route's own names, each once, with values the route
    takes as they are (a status or health verdict of the route's literals, a limit of 1..1000
    written as Litestar reads an integer);
    for a node, none (`as_of` is the audit's replay, not a kept rendering);
  * a rendering found or made by `HardwareReads`, the same call the route makes.

Everything else goes on to the route unchanged, which answers it exactly as before: another
token (a viewer's is looked up in the database), a missing node (404 problem), a bad cursor or
limit (400 problem), an unknown parameter, a failure of the database (503 problem; the read is
then tried once more by the route). The answer's status, headers and bytes are the route's own:
`tests/test_fast_reads.py` compares the two for every shape of request."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import cast, get_args
from urllib.parse import parse_qsl

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Receive, Scope, Send

from api.http.context import AppContext, bearer_token
from api.services.reads.bodies import MAX_LIMIT
from api.services.reads.hot import AcceleratorQuery, AcceleratorStatus, HardwareReads, HealthStatus
from api.services.reads.rendering import Rendered, not_modified
from runtime.secrets import matches

_STATUSES: frozenset[str] = frozenset(get_args(AcceleratorStatus))
_VERDICTS: frozenset[str] = frozenset(get_args(HealthStatus))
_PAGE_FIELDS = frozenset({"node_id", "status", "model", "health", "cursor", "limit"})


def _context(scope: Scope) -> AppContext:
    context: AppContext = scope["litestar_app"].state.ctx
    return context


def _admin(scope: Scope, context: AppContext) -> tuple[bool, str | None]:
    """Whether the request carries the admin token, and its If-None-Match header."""
    authorization: str | None = None
    if_none_match: str | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if authorization is not None:
                return False, None  # two of them: the route decides
            authorization = value.decode("latin-1")
        elif name == b"if-none-match":
            if if_none_match is not None:
                return False, None
            if_none_match = value.decode("latin-1")
    token = bearer_token(authorization or "")
    return token is not None and matches(token, context.admin_token_hash), if_none_match


def accelerator_query(query_string: bytes) -> AcceleratorQuery | None:
    """The page a query string asks for, parsed as Litestar parses it; None unless every
    parameter is the route's own, given once, with a value the route takes unchanged."""
    if not query_string:
        return AcceleratorQuery()
    # Litestar's own parse (litestar._parsers.parse_qsl): latin-1, blank values kept.
    fields: dict[str, str] = {}
    for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True, separator="&"):
        if name not in _PAGE_FIELDS or name in fields:
            return None
        fields[name] = value
    limit = 100
    if "limit" in fields:
        given = fields.pop("limit")
        # Litestar refuses a leading zero ("05") as not an integer: so must this.
        if not (given.isascii() and given.isdigit() and str(int(given)) == given):
            return None
        if not 1 <= int(given) <= MAX_LIMIT:
            return None
        limit = int(given)
    if fields.get("status", "active") not in _STATUSES or fields.get("health", "healthy") not in _VERDICTS:
        return None
    # String casts: `AcceleratorStatus | None` built a typing union on every request.
    return AcceleratorQuery(
        node_id=fields.get("node_id"),
        status=cast("AcceleratorStatus | None", fields.get("status")),
        model=fields.get("model"),
        health=cast("HealthStatus | None", fields.get("health")),
        cursor=fields.get("cursor"),
        limit=limit,
    )


async def _send(send: Send, rendered: Rendered, *, etag: bool, if_none_match: str | None) -> None:
    # The headers, their order and the 304's empty body are those the route's Response sends.
    if etag and not_modified(rendered, if_none_match):
        headers = [(b"etag", rendered.etag.encode())]
        await send({"type": "http.response.start", "status": 304, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    headers = [(b"etag", rendered.etag.encode())] if etag else []
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(rendered.body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": rendered.body, "more_body": False})


# The read a request asks of `HardwareReads`; a lookup finds it, or None when the request is not
# the plain case.
Read = Callable[[HardwareReads], Awaitable[Rendered | None]]
Lookup = Callable[[Scope], Read | None]


def _fast_path(app: ASGIApp, lookup: Lookup, *, etag: bool) -> ASGIApp:
    """A route middleware that answers a GET `lookup` understands from its rendering, for the
    admin token; everything else, and any failure, goes on to the route."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP and scope.get("method") == "GET":
            read = lookup(scope)
            if read is not None:
                context = _context(scope)
                admin, if_none_match = _admin(scope, context)
                if admin:
                    try:
                        rendered = await read(context.services.reads)
                    except Exception:  # a bad cursor, the database: the route's problem+json, tried once more
                        rendered = None
                    if rendered is not None:
                        context.fast_reads += 1
                        await _send(send, rendered, etag=etag, if_none_match=if_none_match)
                        return
        await app(scope, receive, send)

    return middleware


def _node_read(scope: Scope) -> Read | None:
    if scope["query_string"]:
        return None
    node_id: str = scope["path_params"]["node_id"]
    return lambda reads: reads.node(node_id)


def _page_read(scope: Scope) -> Read | None:
    query = accelerator_query(scope["query_string"])
    return None if query is None else lambda reads: reads.accelerator_page(query)


def node_fast_path(app: ASGIApp) -> ASGIApp:
    """Route middleware of `get_node` (create_app registers it)."""
    return _fast_path(app, _node_read, etag=True)


def page_fast_path(app: ASGIApp) -> ASGIApp:
    """Route middleware of `list_accelerators` (create_app registers it)."""
    return _fast_path(app, _page_read, etag=False)
