"""Routes of the agent plane (docs/NODE_AGENT_PROTOCOL.md), all under /api/v1:

Agent (bearer: an enrollment token, then the node's own credential):
    POST /agent/enroll                          enrollment token -> node credential (201)
    POST /agent/reports                         one report (200 accepted | 200 duplicate)
Operator (bearer: the operator token):
    POST /enrollment-tokens                     create a token (201; the token is shown once)
    GET  /enrollment-tokens                     list tokens (never their secrets)
    POST /enrollment-tokens/{token_id}/revoke
    GET  /agent-credentials?node_id=            list node credentials (never their secrets)
    POST /agent-credentials/{credential_id}/revoke
    GET  /agent-streams?node_id=                last accepted sequence per (node, stream)

Routes do no SQL: they call the EnrollmentService.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

from litestar import Request, Router, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath, FromQuery, JSONBody

from agent.protocol import SENT_AT_HEADER, EnrollRequest, EnrollResponse, ReportAck
from api.app import bearer, ctx, operator_guard
from api.enrollment import (
    AgentPlaneError,
    AgentStreamBody,
    CredentialBody,
    EnrollmentService,
    RevokeRequest,
    TokenBody,
    TokenCreated,
    TokenCreateRequest,
)
from api.problems import handle_domain_problem


def enrollment_service(request: Request[Any, Any, Any]) -> EnrollmentService:
    """The context's EnrollmentService (made on first use when the context was built without)."""
    context = ctx(request)
    service: EnrollmentService | None = getattr(context, "enrollment", None)
    if service is None:
        service = EnrollmentService(context.service)
        context.enrollment = service
    return service


def _sent_at(request: Request[Any, Any, Any]) -> datetime | None:
    value = request.headers.get(SENT_AT_HEADER)
    if not value:
        return None
    with contextlib.suppress(ValueError):
        parsed = datetime.fromisoformat(value)
        if parsed.tzinfo is not None:
            return parsed
    return None  # advisory only: a malformed clock reading does not cost the report


# --- agent -----------------------------------------------------------------------------------------


async def enrollment_token_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    # A guard runs before the body is read: no token, no parsing.
    await enrollment_service(connection).check_enrollment_token(bearer(connection))  # type: ignore[arg-type]


@post(
    "/agent/enroll",
    status_code=201,
    summary="Exchange an enrollment token for a node credential",
    guards=[enrollment_token_guard],
)
async def enroll(request: Request[Any, Any, Any], data: JSONBody[EnrollRequest]) -> EnrollResponse:
    return await enrollment_service(request).enroll(bearer(request), data)


@post("/agent/reports", status_code=200, summary="Publish one report (the node credential as bearer)")
async def report(request: Request[Any, Any, Any]) -> ReportAck:
    service = enrollment_service(request)
    principal = await service.authenticate(bearer(request))
    raw = await request.body()  # over the size limit: 413 problem+json (api.problems.handle_http)
    return await service.accept_report(principal, raw, _sent_at(request))


# --- operator --------------------------------------------------------------------------------------


@post("/enrollment-tokens", status_code=201, summary="Create an enrollment token (shown once)")
async def create_token(request: Request[Any, Any, Any], data: JSONBody[TokenCreateRequest]) -> TokenCreated:
    return await enrollment_service(request).create_token(data.ttl_seconds, data.uses, data.description)


@get("/enrollment-tokens", summary="Enrollment tokens (never their secrets)")
async def list_tokens(request: Request[Any, Any, Any]) -> dict[str, list[TokenBody]]:
    return {"items": await enrollment_service(request).list_tokens()}


@post("/enrollment-tokens/{token_id:str}/revoke", status_code=200, summary="Revoke an enrollment token")
async def revoke_token(
    request: Request[Any, Any, Any], token_id: FromPath[str], data: JSONBody[RevokeRequest | None] = None
) -> TokenBody:
    reason = (data or RevokeRequest()).reason
    return await enrollment_service(request).revoke_token(token_id, reason)


@get("/agent-credentials", summary="Node credentials (never their secrets)")
async def list_credentials(
    request: Request[Any, Any, Any], node_id: FromQuery[str | None] = None
) -> dict[str, list[CredentialBody]]:
    return {"items": await enrollment_service(request).list_credentials(node_id)}


@post("/agent-credentials/{credential_id:str}/revoke", status_code=200, summary="Revoke a node credential")
async def revoke_credential(
    request: Request[Any, Any, Any], credential_id: FromPath[str], data: JSONBody[RevokeRequest | None] = None
) -> CredentialBody:
    reason = (data or RevokeRequest()).reason
    return await enrollment_service(request).revoke_credential(credential_id, reason)


@get("/agent-streams", summary="Last accepted sequence per (node, agent stream)")
async def list_streams(
    request: Request[Any, Any, Any], node_id: FromQuery[str | None] = None
) -> dict[str, list[AgentStreamBody]]:
    return {"items": await enrollment_service(request).list_streams(node_id)}


def agent_routers() -> list[Router]:
    """Fresh routers for one app (create_app registers them)."""
    handlers: dict[int | type[Exception], Any] = {AgentPlaneError: handle_domain_problem}
    return [
        Router(path="/api/v1", route_handlers=[enroll, report], exception_handlers=handlers),
        Router(
            path="/api/v1",
            route_handlers=[
                create_token,
                list_tokens,
                revoke_token,
                list_credentials,
                revoke_credential,
                list_streams,
            ],
            guards=[operator_guard],
            security=[{"bearer": []}],
            exception_handlers=handlers,
        ),
    ]
