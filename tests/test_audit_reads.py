"""The as-of reads (api/services/audit.py) take the live reads' filters: as of the present, every
filter of the node and accelerator lists finds what the live list finds (the live lists page;
a past inventory is one page), one node and one accelerator included."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx

from tests.conftest import OPERATOR_TOKEN
from tests.console_support import caught_up
from tests.test_api_conventions import all_pages, client, seed

__all__ = ["client"]  # the fixture, shared with tests/test_api_conventions.py

AUTH = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


async def as_of(client: httpx.AsyncClient, path: str, moment: datetime, **params: str) -> Any:
    r = await client.get(path, params={**params, "as_of": moment.isoformat()}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


async def test_as_of_the_present_every_filter_finds_what_the_live_list_finds(
    pool: asyncpg.Pool, client: httpx.AsyncClient
) -> None:
    await seed(pool)
    await caught_up(pool)
    now = datetime.now(UTC)
    nodes = await all_pages(client, "/api/v1/hardware/nodes", {}, 100)
    gpus = await all_pages(client, "/api/v1/hardware/accelerators", {}, 100)
    node_filters: list[dict[str, str]] = [
        {},
        {"liveness": "online"},
        {"liveness": "stale"},
        {"liveness": "offline"},
        {"inventory_status": "ok"},
        {"hostname": "STALE-1"},
        {"health": "failed"},
        {"health": "degraded", "liveness": "online"},
    ]
    for params in node_filters:
        live = await all_pages(client, "/api/v1/hardware/nodes", dict(params), 2)
        past = await as_of(client, "/api/v1/hardware/nodes", now, **params)
        assert past["next_cursor"] is None and past["as_of_position"] > 0
        assert [n["id"] for n in past["items"]] == [n["id"] for n in live], params
        assert [n["liveness"] for n in past["items"]] == [n["liveness"] for n in live], params
    model = next(a["name"] for a in gpus if a["name"] != "NVIDIA A100-SXM4-40GB")
    accelerator_filters: list[dict[str, str]] = [
        {},
        {"status": "active"},
        {"status": "missing"},
        {"model": "NVIDIA A100-SXM4-40GB"},
        {"model": model, "health": "degraded"},
        {"health": "failed"},
        {"node_id": nodes[0]["id"]},
        {"node_id": nodes[0]["id"], "health": "healthy"},
    ]
    for params in accelerator_filters:
        live = await all_pages(client, "/api/v1/hardware/accelerators", dict(params), 2)
        past = await as_of(client, "/api/v1/hardware/accelerators", now, **params)
        assert past["next_cursor"] is None
        assert [a["id"] for a in past["items"]] == [a["id"] for a in live], params

    node = await as_of(client, f"/api/v1/hardware/nodes/{nodes[0]['id']}", now)
    assert node["id"] == nodes[0]["id"] and node["liveness"] == nodes[0]["liveness"]
    r = await client.get(
        f"/api/v1/hardware/nodes/{nodes[0]['id']}", params={"as_of": "2000-01-01T00:00:00Z"}, headers=AUTH
    )
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")
