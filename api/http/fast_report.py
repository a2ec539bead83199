"""The fast path of the hot write: `POST /api/v1/agent/reports` without Litestar's handler around it.

Every agent sends a report every few seconds; the route's own work (authenticate, read the body,
`ReportService.accept_report`) is the same here, what is spared is the stack around it: the
request object, the dependency, the signature model, the response object and its encoding
(docs/profiles/steady-report.md). This middleware sits on that one route, after Litestar's
routing and the app's own middlewares (the hostile-input refusal among them, which checks the
body as it is read here), and answers the plain case itself:

  * POST without a query string, one `Authorization` header, one `Content-Length` of at most the
    app's body limit, at most one send-time header;
  * then exactly what the route does, in its order: the credential first (an unauthenticated
    caller gets 401 whatever it sends), then the body, then the report service.

A refusal (401, 400, 403, 409, 410, 503 ...) is raised as the route raises it, so Litestar's one
problem+json table answers it. Anything else goes on to the route unchanged: no or a duplicate
header, a body over the limit (413), a query string (400, unknown parameter). The answer's status,
headers and bytes are the route's own: `tests/test_fast_report.py` compares the two."""

from __future__ import annotations

import math
from typing import cast

import msgspec
from litestar.enums import ScopeType
from litestar.exceptions import InternalServerException
from litestar.exceptions.http_exceptions import RequestEntityTooLarge
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp, Receive, Scope, Send

from agent.protocol import SENT_AT_HEADER, sent_at_of
from api.http.context import AppContext, bearer_token

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


def report_fast_path(app: ASGIApp) -> ASGIApp:
    """Route middleware of `report` (api/http/agent.py registers it)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP or scope.get("method") != "POST":
            await app(scope, receive, send)
            return
        handler = cast("HTTPRouteHandler", scope["route_handler"])
        limit = handler.resolve_request_max_body_size() or math.inf
        plain = _plain(scope, limit)
        if plain is None:
            await app(scope, receive, send)
            return
        context: AppContext = scope["litestar_app"].state.ctx
        services = context.services
        principal = await services.credentials.authenticate(bearer_token(plain.authorization))
        raw = await _body(receive, limit)
        ack = await services.reports.accept_report(principal, raw, sent_at_of(plain.sent_at))
        body = _encoder.encode(ack)
        # The headers and their order are those the route's response sends.
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return middleware
