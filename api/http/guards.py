"""Input the database or the parser would choke on, refused at the door with 400 problem+json.

One ASGI middleware, before any route sees the request:
- a NUL character (raw or %00) in the path or the query string: PostgreSQL cannot store it in text;
- a date-time query parameter (`as_of`, `since`, `until`) that is not an RFC 3339 date-time, or
  outside what both PostgreSQL and Python hold once converted to UTC (years 1..9998): asyncpg
  cannot encode it;
- a request body with a NUL (raw, or `\\u0000` inside a JSON string), or nested deeper than
  `MAX_DEPTH`: the JSON parser recurses per level, and PostgreSQL refuses `\\u0000` in jsonb and text.

The body is checked when the route reads it, not when the request arrives, so a route's guard (its
token check) runs first: an unauthenticated caller gets 401 whatever it sends. The checks are scans
in C (`bytes.translate`, `replace`), tens of microseconds for a report.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote_to_bytes

from litestar import Litestar, Request
from litestar.enums import ScopeType
from litestar.routes import HTTPRoute
from litestar.types import ASGIApp, Message, Receive, ReceiveMessage, Scope, Send

from api.services.errors import InvalidRequest

MAX_DEPTH = 64
# The years a moment may have once converted to UTC: Python stops at 9999 and an offset can push
# a 9999 moment past it; PostgreSQL has no year 0.
MIN_YEAR, MAX_YEAR = 1, 9998
DATETIME_PARAMETERS = frozenset({"as_of", "since", "until"})
# Bodies larger than this are left to the framework's own size limit (413).
MAX_SCANNED_BODY = 1024 * 1024

# `\u0000` is an escape only after an even number of backslashes (`\\u0000` is text).
_ESCAPED_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
# What decides the nesting once escapes are gone: quotes (string bounds) and brackets.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')


def bad_request(type_: str, title: str, detail: str) -> InvalidRequest:
    return InvalidRequest(type_, title, detail)


def check_url(path: str, query_string: bytes) -> None:
    """Refuse a NUL in the path or query, and a date-time parameter out of range."""
    if "\x00" in path:
        raise bad_request(
            "nul-character", "NUL character in the request", "the path contains a NUL character"
        )
    if not query_string:
        return
    if b"\x00" in unquote_to_bytes(query_string):
        raise bad_request(
            "nul-character", "NUL character in the request", "the query string contains a NUL character"
        )
    # The console answers a malformed moment with a page of its own; the API with a problem.
    api = path.startswith("/api/")
    for name, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=True):
        if name in DATETIME_PARAMETERS:
            check_moment(name, value, strict=api)


# RFC 3339's shape (the OpenAPI `date-time` format): a date, a time, an optional offset (a moment
# without one is UTC). Litestar alone would also take a bare number as a Unix time.
_MOMENT = re.compile(r"\A\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?([Zz]|[+-]\d{2}:\d{2})?\Z")


def check_moment(name: str, value: str, *, strict: bool = True) -> None:
    try:
        if not _MOMENT.match(value):
            raise ValueError(value)
        moment = datetime.fromisoformat(value)
    except ValueError:
        if not strict:
            return  # not ours to judge: the console's own validation answers
        raise bad_request(
            "invalid-datetime",
            "Invalid date-time",
            f"{name} must be an RFC 3339 date-time such as 2026-12-01T09:30:00Z",
        ) from None
    try:
        utc = moment.astimezone(UTC) if moment.tzinfo is not None else moment
    except OverflowError:
        utc = None
    if utc is None or not MIN_YEAR <= utc.year <= MAX_YEAR:
        raise bad_request(
            "datetime-out-of-range",
            "Date-time out of range",
            f"{name} must lie between years {MIN_YEAR} and {MAX_YEAR} once converted to UTC",
        )


def check_body(body: bytes) -> None:
    """Refuse a NUL anywhere in a JSON body and nesting deeper than MAX_DEPTH, before parsing."""
    if not body:
        return
    # The substring tests (C speed) spare most bodies the regex, which only judges the backslashes;
    # a body without a backslash (most) is spared the search for an escape too.
    escapes = b"\\" in body
    if b"\x00" in body or (escapes and b"\\u0000" in body and _ESCAPED_NUL.search(body)):
        raise bad_request(
            "nul-character",
            "NUL character in the request",
            "the body contains a NUL character (\\u0000), which no field accepts",
        )
    # Escapes pair up left to right: drop escaped backslashes, then escaped quotes; every quote
    # left bounds a string. Keeping only quotes and brackets shrinks the body a hundredfold.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"") if escapes else body
    structure = unescaped.translate(None, _NOT_STRUCTURE)
    # Strings go (brackets inside them are text). Most hold no bracket and are left as `""`: if
    # removing every `""` would leave no quote, the pairs removed are the strings themselves (the
    # first quote can only pair with the second, and so on), else split on the quotes. `count`
    # finds the pairs `replace` would remove, without building what is left.
    if structure.count(b'""') * 2 == structure.count(b'"'):
        brackets = structure.translate(None, b'"')
    else:
        parts = structure.split(b'"')
        brackets = b"".join(parts[::2])
        if len(parts) % 2 == 0:  # an unterminated string: its quote stays, and fails the peel
            brackets += b'"' + parts[-1]
    # Peel innermost pairs off, one level per round: MAX_DEPTH rounds at most. A pair is marked
    # before the other kind is looked for, so a round never peels two levels (`{[]}`).
    for _ in range(MAX_DEPTH):
        if not brackets:
            return
        peeled = brackets.replace(b"[]", b"\x01\x01").replace(b"{}", b"\x01\x01").translate(None, b"\x01")
        if peeled == brackets:
            raise bad_request("malformed-json", "Malformed JSON", "the body's brackets do not balance")
        brackets = peeled
    if brackets:
        raise bad_request(
            "nesting-too-deep", "Body nested too deeply", f"the body is nested deeper than {MAX_DEPTH} levels"
        )


def _checked_receive(receive: Receive) -> Receive:
    """A `receive` that reads the whole body on first use, checks it, and hands it on unchanged."""
    pending: list[ReceiveMessage] = []
    read = False

    async def checked() -> ReceiveMessage:
        nonlocal read
        if not read:
            read = True
            size = 0
            while True:
                message = await receive()
                pending.append(message)
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if not message.get("more_body", False) or size > MAX_SCANNED_BODY:
                    break
            if size <= MAX_SCANNED_BODY and pending[-1]["type"] == "http.request":
                check_body(b"".join(m.get("body", b"") for m in pending if m["type"] == "http.request"))
        if pending:
            return pending.pop(0)
        return await receive()

    return checked


def refuse_hostile_input(app: ASGIApp) -> ASGIApp:
    """Litestar middleware factory (create_app registers it)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP:
            check_url(scope["path"], scope.get("query_string", b""))
            receive = _checked_receive(receive)
        await app(scope, receive, send)

    return middleware


# --- unknown query parameters ---------------------------------------------------------------------
# A misspelt filter (`/nodes?status=active` where the filter is `inventory_status`) must not
# silently answer the unfiltered list. Each handler's accepted names come from the same kwargs
# model Litestar parses the request with, so the check cannot drift from the signatures.


def _accepted_names(app: Litestar) -> dict[int, frozenset[str]]:
    """Per app, built once: handler -> the query names its signature (and its dependencies) take."""
    accepted: dict[int, frozenset[str]] | None = app.state.get("accepted_query_parameters")
    if accepted is None:
        accepted = {}
        for route in app.routes:
            if isinstance(route, HTTPRoute):
                for handler, kwargs_model in route.route_handler_map.values():
                    accepted[id(handler)] = frozenset(
                        p.field_alias for p in kwargs_model.expected_query_params
                    )
        app.state["accepted_query_parameters"] = accepted
    return accepted


async def refuse_unknown_query_parameters(request: Request[Any, Any, Any]) -> None:
    """Litestar `before_request` hook (create_app registers it): runs after the guards, so an
    unauthenticated caller still gets 401, and before the parameters are parsed."""
    if not request.scope.get("query_string"):
        return
    accepted = _accepted_names(request.app).get(id(request.scope["route_handler"]), frozenset())
    unknown = sorted(set(request.query_params.keys()) - accepted)
    if unknown:
        known = ", ".join(sorted(accepted)) or "none"
        raise bad_request(
            "unknown-parameter",
            "Unknown query parameter",
            f"unknown query parameter(s): {', '.join(unknown)} (this route accepts: {known})",
        )


# --- OPTIONS: the Allow header names every method of the path ---------------------------------------
# Litestar builds its automatic OPTIONS answer when a path's first handlers are registered; a
# method registered later on the same path (GET and POST of one path in one router) is left out
# of `Allow`. The route itself knows all its methods, so the header is rewritten from it.


def _methods_by_path(app: Litestar) -> dict[str, bytes]:
    methods: dict[str, bytes] | None = app.state.get("allow_by_path")
    if methods is None:
        methods = {}
        for route in app.routes:
            if isinstance(route, HTTPRoute):
                allow = ", ".join(sorted(route.methods)).encode()
                methods[route.path] = methods[route.path_format] = allow
        app.state["allow_by_path"] = methods
    return methods


def complete_allow_header(app: ASGIApp) -> ASGIApp:
    """Litestar middleware factory (create_app registers it)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != ScopeType.HTTP or scope.get("method") != "OPTIONS":
            await app(scope, receive, send)
            return
        allow = _methods_by_path(scope["litestar_app"]).get(scope.get("path_template", ""))

        async def send_with_allow(message: Message) -> None:
            if allow is not None and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", allow)]}
            await send(message)

        await app(scope, receive, send_with_allow)

    return middleware
