"""Every error is `application/problem+json` (RFC 9457) with a stable `type`, a `title` and a
`detail`; validation errors add `errors`."""

from __future__ import annotations

from typing import Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from api.schemas import Problem

log = structlog.get_logger(__name__)

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


class ProblemError(Exception):
    def __init__(
        self,
        status: int,
        type_: str,
        title: str,
        detail: str,
        *,
        errors: list[str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.problem = Problem(
            type=PROBLEM_BASE + type_, title=title, status=status, detail=detail, errors=errors
        )
        self.headers = headers or {}


class DomainProblem(Exception):
    """A service's RFC 9457 problem: status, stable type, title, detail, and extension members
    (e.g. the sequence a 409 conflicts with). Services raise subclasses; one handler renders them."""

    def __init__(self, status: int, type_: str, title: str, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.type = type_
        self.title = title
        self.detail = detail
        self.extensions = extensions


def handle_domain_problem(_: Request[Any, Any, Any], exc: DomainProblem) -> Response[Any]:
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + exc.type,
        "title": exc.title,
        "status": exc.status,
        "detail": exc.detail,
        **exc.extensions,
    }
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return Response(content=body, status_code=exc.status, media_type=MEDIA_TYPE, headers=headers)


def not_found(what: str, ident: str) -> ProblemError:
    return ProblemError(404, f"{what}-not-found", f"Unknown {what}", f"no {what} with id {ident!r}")


def respond(problem: Problem, headers: dict[str, str] | None = None) -> Response[Problem]:
    return Response(content=problem, status_code=problem.status, media_type=MEDIA_TYPE, headers=headers)


def handle_problem(_: Request[Any, Any, Any], exc: ProblemError) -> Response[Problem]:
    return respond(exc.problem, exc.headers)


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
