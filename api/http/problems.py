"""Every error is `application/problem+json` (RFC 9457) with a stable `type`, a `title` and a
`detail`; validation errors add `errors`.

`STATUS_OF` is the one table from the services' error kinds (`api.services.errors`) to HTTP
statuses; nothing else in the code base knows that a `Gone` is a 410."""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from api.services.errors import (
    Conflict,
    DomainError,
    Forbidden,
    Gone,
    InvalidRequest,
    NotFound,
    Unauthenticated,
    Unavailable,
)

log = structlog.get_logger(__name__)


class Problem(msgspec.Struct, omit_defaults=True):
    """RFC 9457 problem details."""

    type: str
    title: str
    status: int
    detail: str
    errors: list[str] | None = None
    instance: str | None = None


PROBLEM_BASE = "https://modelforge.dev/problems/"
MEDIA_TYPE = "application/problem+json"

_TITLES = {
    400: ("bad-request", "Bad request"),
    401: ("unauthorized", "Authentication required"),
    403: ("forbidden", "Forbidden"),
    404: ("not-found", "Not found"),
    405: ("method-not-allowed", "Method not allowed"),
    409: ("conflict", "Conflict"),
    410: ("gone", "Gone"),
    413: ("payload-too-large", "Request body too large"),
    415: ("unsupported-media-type", "Unsupported media type"),
    429: ("too-many-requests", "Too many requests"),
    500: ("internal-error", "Internal server error"),
    503: ("unavailable", "Service unavailable"),
}


STATUS_OF: dict[type[DomainError], int] = {
    InvalidRequest: 400,
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    Gone: 410,
    Unavailable: 503,
}


def status_of(exc: DomainError) -> int:
    for kind in type(exc).__mro__:
        if kind in STATUS_OF:
            return STATUS_OF[kind]
    return 500


def problem_of(exc: DomainError) -> dict[str, object]:
    """The RFC 9457 document of a service's error (the CLI prints the same one with `--json`)."""
    return {
        "type": PROBLEM_BASE + exc.type,
        "title": exc.title,
        "status": status_of(exc),
        "detail": exc.detail,
        **{k: v for k, v in exc.extensions.items() if k not in ("type", "title", "status", "detail")},
    }


def handle_domain_error(_: Request[Any, Any, Any], exc: DomainError) -> Response[Any]:
    status = status_of(exc)
    body = problem_of(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(content=body, status_code=status, media_type=MEDIA_TYPE, headers=headers)


def not_found(what: str, ident: str) -> NotFound:
    return NotFound(f"{what}-not-found", f"Unknown {what}", f"no {what} with id {ident!r}")


def respond(problem: Problem, headers: dict[str, str] | None = None) -> Response[Problem]:
    return Response(content=problem, status_code=problem.status, media_type=MEDIA_TYPE, headers=headers)


def handle_bad_cursor(_: Request[Any, Any, Any], exc: Exception) -> Response[Problem]:
    return respond(
        Problem(type=PROBLEM_BASE + "invalid-cursor", title="Invalid cursor", status=400, detail=str(exc))
    )


def handle_validation(_: Request[Any, Any, Any], exc: ValidationException) -> Response[Problem]:
    errors: list[str] = []
    extra = exc.extra
    if isinstance(extra, list):
        for item in extra:
            if isinstance(item, dict):
                key = item.get("key") or item.get("source") or ""
                errors.append(f"{key}: {item.get('message', '')}".strip(": "))
            else:
                errors.append(str(item))
    return respond(
        Problem(
            type=PROBLEM_BASE + "validation-failed",
            title="Request validation failed",
            status=400,
            detail=str(exc.detail) or "the request does not match the schema",
            errors=errors or None,
        )
    )


def handle_http(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Problem]:
    status = exc.status_code
    type_, title = _TITLES.get(status, ("error", "Error"))
    headers = dict(exc.headers or {})
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return respond(
        Problem(type=PROBLEM_BASE + type_, title=title, status=status, detail=str(exc.detail)), headers
    )


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[Problem]:
    log.error("http.unexpected_error", path=request.url.path, error=repr(exc), exc_info=exc)
    return respond(
        Problem(
            type=PROBLEM_BASE + "internal-error",
            title="Internal server error",
            status=500,
            detail="an unexpected error occurred; see the server log",
        )
    )
