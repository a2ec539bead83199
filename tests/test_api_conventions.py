"""API conventions against the real app and a real PostgreSQL: filters that page
(every filter crosses page boundaries with the keyset cursor), unknown query parameters refused
with 400 problem+json, ETag / If-None-Match on single resources, readable OpenAPI, and a docs page
that loads nothing from outside this server."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import msgspec
import pytest

from api.services.inventory import HardwareInventoryService
from collectors.facts import Known
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from tests.builders import gpu, pending_remap, signals, uncorrected_ecc, with_health
from tests.conftest import OPERATOR_TOKEN
from tests.console_support import report

AUTH = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@pytest.fixture
async def client(pool: asyncpg.Pool, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.reads.repository import HardwareRepository
    from runtime.secrets import digest

    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    context = AppContext(
        pool=pool,
        service=service,
        repository=HardwareRepository(pool),
        admin_token_hash=digest(OPERATOR_TOKEN),
        local_refresh_enabled=False,
    )
    app = create_app(context)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


# GPU number -> health signals: three degraded GPUs on three nodes, two failed ones on two; the
# others send healthy signals or (the odd-numbered A100) none, as an older agent does.
HEALTH = {
    1: pending_remap(),
    21: pending_remap(),
    101: pending_remap(),
    12: uncorrected_ecc(),
    22: uncorrected_ecc(),
}


def observed(n: int, **changes: Any) -> Any:
    g = msgspec.structs.replace(gpu(n), **changes)
    return g if n == 100 else with_health(g, HEALTH.get(n, signals()))


async def seed(pool: asyncpg.Pool) -> None:
    """Seven nodes: online ones with H200s, stale ones with an A100, offline ones without GPUs."""
    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    a100 = Known("NVIDIA A100-SXM4-40GB")
    for i in range(3):
        await report(service, f"online-{i}", [observed(10 * i + 1), observed(10 * i + 2)], ago=1)
    for i in range(2):
        g = observed(100 + i, name=a100)
        await report(service, f"stale-{i}", [g], ago=120)
    for i in range(2):
        await report(service, f"offline-{i}", [], ago=900)


async def all_pages(client: httpx.AsyncClient, path: str, params: dict[str, Any], limit: int) -> list[Any]:
    items: list[Any] = []
    cursor = None
    for _ in range(100):
        q = {**params, "limit": limit, **({"cursor": cursor} if cursor else {})}
        r = await client.get(path, params=q, headers=AUTH)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["items"]) <= limit
        items += body["items"]
        cursor = body["next_cursor"]
        if cursor is None:
            return items
    raise AssertionError("paging never ended")


async def test_node_filters_page_across_boundaries(pool: asyncpg.Pool, client: httpx.AsyncClient) -> None:
    await seed(pool)
    everything = await all_pages(client, "/api/v1/hardware/nodes", {}, 100)
    assert len(everything) == 7
    cases = [
        ({"liveness": "online"}, lambda n: n["liveness"] == "online", 3),
        ({"liveness": "stale"}, lambda n: n["liveness"] == "stale", 2),
        ({"liveness": "offline"}, lambda n: n["liveness"] == "offline", 2),
        ({"inventory_status": "ok"}, lambda n: n["inventory_status"] == "ok", 7),
        ({"inventory_status": "degraded"}, lambda n: False, 0),
        ({"hostname": "STALE-1"}, lambda n: n["hostname"] == "stale-1", 1),
        ({"liveness": "online", "hostname": "online-2"}, lambda n: n["hostname"] == "online-2", 1),
        # By the node's worst GPU verdict; a node without GPUs is healthy.
        ({"health": "failed"}, lambda n: n["hostname"] in ("online-1", "online-2"), 2),
        ({"health": "degraded"}, lambda n: n["hostname"] in ("online-0", "stale-1"), 2),
        ({"health": "healthy"}, lambda n: n["hostname"] in ("stale-0", "offline-0", "offline-1"), 3),
        ({"health": "failed", "liveness": "stale"}, lambda n: False, 0),
    ]
    for params, keep, count in cases:
        expected = [n["id"] for n in everything if keep(n)]
        assert len(expected) == count, params
        for limit in (1, 2, 3, 100):
            got = await all_pages(client, "/api/v1/hardware/nodes", params, limit)
            # Every matching node once, in id order, whatever the page size.
            assert [n["id"] for n in got] == expected, (params, limit)


def uuids(*numbers: int) -> set[str]:
    return {gpu(n).uuid for n in numbers}


async def test_accelerator_filters_page_across_boundaries(
    pool: asyncpg.Pool, client: httpx.AsyncClient
) -> None:
    await seed(pool)
    everything = await all_pages(client, "/api/v1/hardware/accelerators", {}, 100)
    assert len(everything) == 8
    online_0 = next(
        n for n in await all_pages(client, "/api/v1/hardware/nodes", {}, 100) if n["hostname"] == "online-0"
    )
    other_model = next(a["name"] for a in everything if a["name"] != "NVIDIA A100-SXM4-40GB")
    cases = [
        ({"model": "NVIDIA A100-SXM4-40GB"}, lambda a: a["name"] == "NVIDIA A100-SXM4-40GB", 2),
        ({"model": other_model}, lambda a: a["name"] == other_model, 6),
        ({"node_id": online_0["id"]}, lambda a: a["node_id"] == online_0["id"], 2),
        ({"status": "active"}, lambda a: a["status"] == "active", 8),
        ({"status": "missing"}, lambda a: False, 0),
        ({"model": "NVIDIA A100-SXM4-40GB", "status": "active"}, lambda a: a["name"].endswith("40GB"), 2),
        ({"health": "degraded"}, lambda a: a["uuid"] in uuids(1, 21, 101), 3),
        ({"health": "failed"}, lambda a: a["uuid"] in uuids(12, 22), 2),
        ({"health": "healthy"}, lambda a: a["uuid"] in uuids(2, 11, 100), 3),
        ({"health": "failed", "node_id": online_0["id"]}, lambda a: False, 0),
        ({"health": "degraded", "model": other_model}, lambda a: a["uuid"] in uuids(1, 21), 2),
    ]
    for params, keep, count in cases:
        expected = [a["id"] for a in everything if keep(a)]
        assert len(expected) == count, params
        for limit in (1, 2, 3, 100):
            got = await all_pages(client, "/api/v1/hardware/accelerators", params, limit)
            assert [a["id"] for a in got] == expected, (params, limit)


@pytest.mark.parametrize(
    ("path", "query"),
    [
        ("/api/v1/hardware/nodes", "status=active"),
        ("/api/v1/hardware/nodes", "liveness=online&colour=blue"),
        ("/api/v1/hardware/accelerators", "state=active"),
        ("/api/v1/hardware/events", "node=x"),
        ("/api/v1/hardware/nodes/some-node", "verbose=1"),
        ("/api/v1/health", "x=1"),
        ("/api/v1/health/live", "x=1"),
        ("/metrics", "format=json"),
        ("/api/v1/enrollment-tokens", "all=1"),
    ],
)
async def test_unknown_query_parameters_are_refused(client: httpx.AsyncClient, path: str, query: str) -> None:
    r = await client.get(f"{path}?{query}", headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["type"].endswith("/unknown-parameter")
    assert query.split("&")[-1].split("=")[0] in body["detail"]


async def test_known_parameters_still_pass_and_tokens_come_first(client: httpx.AsyncClient) -> None:
    assert (
        await client.get("/api/v1/hardware/events?type=NODE_DISCOVERED&limit=5", headers=AUTH)
    ).status_code == 200
    # Without a token the answer is 401 whatever the query says.
    assert (await client.get("/api/v1/hardware/nodes?bogus=1")).status_code == 401
    r = await client.get("/api/v1/hardware/nodes?liveness=asleep", headers=AUTH)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/problem+json")


async def test_etag_and_if_none_match(pool: asyncpg.Pool, client: httpx.AsyncClient) -> None:
    await seed(pool)
    node = next(n for n in (await client.get("/api/v1/hardware/nodes", headers=AUTH)).json()["items"])
    acc = (await client.get("/api/v1/hardware/accelerators", headers=AUTH)).json()["items"][0]
    for path in (f"/api/v1/hardware/nodes/{node['id']}", f"/api/v1/hardware/accelerators/{acc['id']}"):
        first = await client.get(path, headers=AUTH)
        assert first.status_code == 200
        etag = first.headers["etag"]
        assert re.fullmatch(r'"[0-9a-f]{32}"', etag)
        # Strong: the tag is the digest of the very bytes sent, and they are JSON.
        assert etag == '"' + hashlib.sha256(first.content).hexdigest()[:32] + '"'
        assert first.headers["content-type"].startswith("application/json")
        again = await client.get(path, headers={**AUTH, "If-None-Match": etag})
        assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
        other = await client.get(path, headers={**AUTH, "If-None-Match": '"0000", W/"1111"'})
        assert other.status_code == 200 and other.json() == first.json()
    # A change to the node changes its tag: a new report of another kernel.
    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    path = f"/api/v1/hardware/nodes/{node['id']}"
    before = (await client.get(path, headers=AUTH)).headers["etag"]
    await report(service, node["hostname"], [], ago=1, kernel="6.9.0-1-generic")
    after = await client.get(path, headers={**AUTH, "If-None-Match": before})
    assert after.status_code == 200 and after.headers["etag"] != before
    assert after.json()["os"]["kernel"] == "6.9.0-1-generic"


async def test_openapi_has_tags_and_readable_operation_ids(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/schema/openapi.json")).json()
    ops = {
        (method, path): op
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if isinstance(op, dict) and "responses" in op
    }
    assert ops[("get", "/api/v1/hardware/nodes")]["operationId"] == "listNodes"
    assert ops[("get", "/api/v1/hardware/nodes/{node_id}")]["operationId"] == "getNode"
    assert ops[("get", "/api/v1/hardware/accelerators")]["operationId"] == "listAccelerators"
    assert ops[("post", "/api/v1/agent/reports")]["operationId"] == "publishReport"
    ids = [op["operationId"] for op in ops.values()]
    assert len(set(ids)) == len(ids)
    for (method, path), op in ops.items():
        assert re.fullmatch(r"[a-z]+[A-Za-z]*", op["operationId"]), (method, path)
        assert op.get("tags"), (method, path)
    names = {p["name"] for p in ops[("get", "/api/v1/hardware/nodes")]["parameters"]}
    assert {"hostname", "liveness", "inventory_status", "cursor", "limit"} <= names
    report = ops[("post", "/api/v1/agent/reports")]
    assert report["security"] == [{"bearer": []}]
    assert report["requestBody"]["content"]["application/json"]["schema"]["$ref"].startswith("#/components/")
    assert "problem+json" in str(ops[("get", "/api/v1/hardware/nodes/{node_id}")]["responses"]["404"])


async def test_docs_page_references_only_local_assets(client: httpx.AsyncClient) -> None:
    page = await client.get("/schema/swagger")
    assert page.status_code == 200
    refs = re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]+)['"]""", page.text)
    assert refs, page.text
    assert not re.search(r"https?://", page.text.replace("http://t", "")), "the page names an outside URL"
    for ref in refs:
        assert ref.startswith("/"), ref
        asset = await client.get(ref)
        assert asset.status_code == 200, ref
        assert asset.content, ref
    bundle = await client.get("/schema/assets/swagger-ui-bundle.js")
    assert b"SwaggerUIBundle" in bundle.content and "javascript" in bundle.headers["content-type"]
    # /schema itself opens the same page.
    assert "/schema/assets/swagger-ui-bundle.js" in (await client.get("/schema")).text


async def test_every_route_resolves_at_most_one_dependency(pool: asyncpg.Pool) -> None:
    """Litestar resolves a route's dependencies level by level, and two at one level in an anyio
    task group with a task each: a tenth of a read's server CPU (api/http/context.py). Every
    route takes one dependency, whose provider reads the app state itself."""
    from litestar.routes import HTTPRoute

    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.reads.repository import HardwareRepository
    from runtime.secrets import digest

    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    app = create_app(
        AppContext(
            pool=pool, service=service, repository=HardwareRepository(pool), admin_token_hash=digest("x")
        )
    )
    costly: list[str] = []
    handlers = 0
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            for handler, kwargs_model in route.route_handler_map.values():
                handlers += 1
                batches = [sorted(d.key for d in batch) for batch in kwargs_model.dependency_batches]
                if len(batches) > 1 or any(len(batch) > 1 for batch in batches):
                    costly.append(f"{route.path} {handler.handler_name}: {batches}")
    assert handlers > 30 and not costly, "\n".join(costly)
