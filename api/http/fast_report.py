"""The fast path of the hot write: `POST /api/v1/agent/reports` in front of Litestar.

Every agent sends a report every few seconds; the route's own work (authenticate, read the body,
`ReportService.accept_report`) is the same here, what is spared is the stack around it: the
exception handler, the router, the app's middlewares, the request object, the dependency, the
signature model, the response object and its encoding (docs/profiles/steady-report.md).
`report_front` wraps the app's ASGI handler (create_app installs it, so every server and test
app has it) and answers the plain case itself:

  * POST to exactly the route's path, without a query string, one `Authorization` header, one
    `Content-Length` of at most the route's body limit, at most one send-time header;
  * then exactly what the guards and the route do, in their order: the credential first (an
    unauthenticated caller gets 401 whatever it sends), then the body, refused as the
    hostile-input guard refuses it (api/http/guards.py `check_body`), then the report service.
    The guard runs only on a body the report's decode refuses, before that refusal: it refuses
    nothing the decode accepts (no NUL, nesting bounded by the schema), so the answers are the
    route's.

A refusal (401, 400, 403, 409, 410, 503 ...) is handed to Litestar with the request, and the
route's middleware (`report_fast_path`) raises it there before the route reads anything, so
Litestar's one problem+json table answers it as it answers the route's own. Anything else goes to
Litestar unchanged: no or a duplicate header, a body over the limit (413), a query string (400,
unknown parameter). The answer's status, headers and bytes are the route's own:
`tests/test_fast_report.py` compares the two."""

from __future__ import annotations

import math

import msgspec
from litestar import Litestar
from litestar.enums import ScopeType
from litestar.exceptions import InternalServerException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.routes import HTTPRoute
from litestar.types import ASGIApp, Receive, ReceiveMessage, Scope, Send

from agent.protocol import REPORTS_PATH, SENT_AT_HEADER, sent_at_of
from api.http.context import AppContext, bearer_token
from api.http.guards import MAX_SCANNED_BODY, check_body

_SENT_AT = SENT_AT_HEADER.lower().encode("latin-1")
_encoder = msgspec.json.Encoder()


class _Plain(msgspec.Struct):
    """The headers of a request the fast path answers."""

    authorization: str
    length: int
    sent_at: str | None


def _plain(scope: Scope, limit: float) -> _Plain | None:
    """The request's headers, or None unless it is the plain case."""
    if scope["query_string"]:
        return None
    authorization: str | None = None
    length: str | None = None
    sent_at: str | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if authorization is not None:
                return None
            authorization = value.decode("latin-1")
        elif name == b"content-length":
            if length is not None:
                return None
            length = value.decode("latin-1")
        elif name == _SENT_AT:
            if sent_at is not None:
                return None
            sent_at = value.decode("latin-1")
    if authorization is None or length is None or not (length.isascii() and length.isdigit()):
        return None
    if int(length) > limit:
        return None
    return _Plain(authorization, int(length), sent_at)


async def _body(receive: Receive, limit: float) -> bytes:
    """The whole body, read and refused as Litestar's `Request.body` reads and refuses it."""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await receive()
        if event["type"] == "http.request":
            body = event.get("body", b"")
            if body:
                size += len(body)
                if size > limit:
                    raise RequestEntityTooLarge
                chunks.append(body)
            if not event.get("more_body", False):
                break
        elif event["type"] == "http.disconnect":
            raise InternalServerException("client disconnected prematurely")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# The request's scope key under which the front hands a refusal to the route's middleware.
_REFUSAL = "modelforge.report_refusal"


def _limit(app: Litestar) -> float:
    """The route's body limit, as Litestar resolves it for the route."""
    for route in app.routes:
        if route.path == REPORTS_PATH and isinstance(route, HTTPRoute):
            handler, _model = route.route_handler_map["POST"]
            return handler.resolve_request_max_body_size() or math.inf
    raise RuntimeError(f"no POST route at {REPORTS_PATH}")


def report_front(handler: ASGIApp, app: Litestar) -> ASGIApp:
    """`app`'s ASGI handler with the report's fast path in front of it."""
    limit: float | None = None

    async def front(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal limit
        if scope["type"] != ScopeType.HTTP or scope["path"] != REPORTS_PATH or scope.get("method") != "POST":
            await handler(scope, receive, send)
            return
        if limit is None:
            limit = _limit(app)
        plain = _plain(scope, limit)
        context: AppContext | None = getattr(app.state, "ctx", None)
        if plain is None or context is None:
            await handler(scope, receive, send)
            return
        services = context.services
        try:
            principal = await services.credentials.authenticate(bearer_token(plain.authorization))
            raw = await _body(receive, limit)
            # The guard runs where the decode refuses the body (ReportService.report_item): it
            # refuses no body the decode accepts, and answers first where both refuse.
            guard = check_body if len(raw) <= MAX_SCANNED_BODY else None
            ack = await services.reports.accept_report(principal, raw, sent_at_of(plain.sent_at), guard)
        except Exception as exc:  # answered by Litestar's handlers, as the route's own are
            scope[_REFUSAL] = exc  # type: ignore[literal-required]
            await handler(scope, _nothing_more, send)
            return
        body = _encoder.encode(ack)
        # The headers and their order are those the route's response sends.
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return front


async def _nothing_more() -> ReceiveMessage:
    """The receive of a request whose body the front read: the route never reads it."""
    return {"type": "http.disconnect"}


def report_fast_path(app: ASGIApp) -> ASGIApp:
    """Route middleware of `report` (api/http/agent.py registers it): raises the refusal the front
    met, inside Litestar's exception handling."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        refusal = scope.pop(_REFUSAL, None)  # type: ignore[misc]
        if isinstance(refusal, Exception):
            raise refusal
        await app(scope, receive, send)

    return middleware
