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

Routes do no SQL: they call the agent plane's services (enrollment, credentials, reports), given
to them as dependencies.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec
from litestar import Request, Router, get, post
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath, FromQuery, JSONBody

from agent.protocol import SENT_AT_HEADER, EnrollRequest, EnrollResponse, ReportAck, sent_at_of
from api.http.context import bearer, ctx, operator_guard
from api.http.fast_report import report_fast_path
from api.services.credentials import AgentStreamBody, CredentialBody, CredentialService
from api.services.enrollment import EnrollmentService, TokenBody, TokenCreated, TokenCreateRequest
from api.wiring import Services


class RevokeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    reason: str = "revoked by an operator"


def _sent_at(request: Request[Any, Any, Any]) -> datetime | None:
    return sent_at_of(request.headers.get(SENT_AT_HEADER))


# --- agent -----------------------------------------------------------------------------------------


async def enrollment_token_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    # A guard runs before the body is read: no token, no parsing.
    await ctx(connection).services.enrollment.check_enrollment_token(bearer(connection))


@post(
    "/agent/enroll",
    status_code=201,
    summary="Exchange an enrollment token for a node credential",
    guards=[enrollment_token_guard],
)
async def enroll(
    request: Request[Any, Any, Any],
    enrollment: NamedDependency[EnrollmentService],
    data: JSONBody[EnrollRequest],
) -> EnrollResponse:
    return await enrollment.enroll(bearer(request), data)


@post(
    "/agent/reports",
    status_code=200,
    summary="Publish one report (the node credential as bearer)",
    middleware=[report_fast_path],
)
async def report(request: Request[Any, Any, Any], services: NamedDependency[Services]) -> ReportAck:
    principal = await services.credentials.authenticate(bearer(request))
    raw = await request.body()  # over the size limit: 413 problem+json (api.http.problems.handle_http)
    return await services.reports.accept_report(principal, raw, _sent_at(request))


# --- operator --------------------------------------------------------------------------------------


@post("/enrollment-tokens", status_code=201, summary="Create an enrollment token (shown once)")
async def create_token(
    enrollment: NamedDependency[EnrollmentService], data: JSONBody[TokenCreateRequest]
) -> TokenCreated:
    return await enrollment.create_token(data.ttl_seconds, data.uses, data.description)


@get("/enrollment-tokens", summary="Enrollment tokens (never their secrets)")
async def list_tokens(enrollment: NamedDependency[EnrollmentService]) -> dict[str, list[TokenBody]]:
    return {"items": await enrollment.list_tokens()}


@post("/enrollment-tokens/{token_id:str}/revoke", status_code=200, summary="Revoke an enrollment token")
async def revoke_token(
    enrollment: NamedDependency[EnrollmentService],
    token_id: FromPath[str],
    data: JSONBody[RevokeRequest | None] = None,
) -> TokenBody:
    reason = (data or RevokeRequest()).reason
    return await enrollment.revoke_token(token_id, reason)


@get("/agent-credentials", summary="Node credentials (never their secrets)")
async def list_credentials(
    credentials: NamedDependency[CredentialService], node_id: FromQuery[str | None] = None
) -> dict[str, list[CredentialBody]]:
    return {"items": await credentials.list_credentials(node_id)}


@post("/agent-credentials/{credential_id:str}/revoke", status_code=200, summary="Revoke a node credential")
async def revoke_credential(
    credentials: NamedDependency[CredentialService],
    credential_id: FromPath[str],
    data: JSONBody[RevokeRequest | None] = None,
) -> CredentialBody:
    reason = (data or RevokeRequest()).reason
    return await credentials.revoke_credential(credential_id, reason)


@get("/agent-streams", summary="Last accepted sequence per (node, agent stream)")
async def list_streams(
    credentials: NamedDependency[CredentialService], node_id: FromQuery[str | None] = None
) -> dict[str, list[AgentStreamBody]]:
    return {"items": await credentials.list_streams(node_id)}


def agent_routers() -> list[Router]:
    """Fresh routers for one app (create_app registers them)."""
    return [
        Router(path="/api/v1", route_handlers=[enroll, report]),
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
        ),
    ]
