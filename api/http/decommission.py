"""Operator routes for work leases and permanent decommission (docs/NODE_DECOMMISSION.md), all
under /api/v1 and the operator bearer token:

    GET  /hardware/nodes/{node_id}/leases                       unreleased leases (active | expired)
    POST /hardware/nodes/{node_id}/leases                       acquire (201)  {owner, reason, ttl_seconds?}
    POST /hardware/nodes/{node_id}/leases/{lease_id}/release    release        {reason?}
    POST /hardware/nodes/{node_id}/decommission/preview         generation, dependencies, blockers, digest
    POST /hardware/nodes/{node_id}/decommission                 execute        {generation, digest, reason}

Routes do no SQL: they call the DecommissionService, given to them as a dependency.
"""

from __future__ import annotations

from litestar import Router, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from api.http.context import operator_guard
from api.services.decommission import (
    DecommissionBody,
    DecommissionService,
    ExecuteRequest,
    LeaseReleaseRequest,
    LeaseRequest,
)
from domain.decommission import LeaseBody, PreviewBody


def _actor(given: str | None) -> str:
    """Who, as the request says (the operator token is shared; the name is the caller's word)."""
    name = (given or "").strip()[:100]
    return f"operator:{name}" if name else "operator"


@get("/hardware/nodes/{node_id:str}/leases", summary="A node's unreleased work leases")
async def list_leases(
    decommission: NamedDependency[DecommissionService], node_id: FromPath[str]
) -> dict[str, list[LeaseBody]]:
    return {"items": await decommission.list_leases(node_id)}


@post("/hardware/nodes/{node_id:str}/leases", status_code=201, summary="Acquire a work lease on a node")
async def acquire_lease(
    decommission: NamedDependency[DecommissionService], node_id: FromPath[str], data: JSONBody[LeaseRequest]
) -> LeaseBody:
    return await decommission.acquire_lease(
        node_id, data.owner, data.reason, data.ttl_seconds, actor=_actor(data.actor)
    )


@post(
    "/hardware/nodes/{node_id:str}/leases/{lease_id:str}/release",
    status_code=200,
    summary="Release a work lease",
)
async def release_lease(
    decommission: NamedDependency[DecommissionService],
    node_id: FromPath[str],
    lease_id: FromPath[str],
    data: JSONBody[LeaseReleaseRequest | None] = None,
) -> LeaseBody:
    body = data or LeaseReleaseRequest()
    return await decommission.release_lease(node_id, lease_id, body.reason, actor=_actor(body.actor))


@post(
    "/hardware/nodes/{node_id:str}/decommission/preview",
    status_code=200,
    summary="Preview a node's decommission: generation, dependencies, blockers, digest",
)
async def preview(decommission: NamedDependency[DecommissionService], node_id: FromPath[str]) -> PreviewBody:
    return await decommission.preview(node_id)


@post(
    "/hardware/nodes/{node_id:str}/decommission",
    status_code=200,
    summary="Decommission a node for good (the preview's generation and digest)",
)
async def execute(
    decommission: NamedDependency[DecommissionService], node_id: FromPath[str], data: JSONBody[ExecuteRequest]
) -> DecommissionBody:
    return await decommission.execute(
        node_id, data.generation, data.digest, data.reason, actor=_actor(data.actor)
    )


def decommission_routers() -> list[Router]:
    """A fresh router for one app (create_app registers it)."""
    return [
        Router(
            path="/api/v1",
            route_handlers=[list_leases, acquire_lease, release_lease, preview, execute],
            guards=[operator_guard],
            security=[{"bearer": []}],
        )
    ]
