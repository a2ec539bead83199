"""Prometheus HTTP service discovery, `GET /api/v1/sd/prometheus`, against the real app and a real
PostgreSQL: one target group per node that is not decommissioned, labels that agree with
`/hardware/nodes`, the port and the filters, bad input refused as problem+json, `[]` for no nodes,
viewer tokens in and agent credentials out. The real Prometheus reading it is
tests/test_prometheus_discovery.py's."""

from __future__ import annotations

from typing import Any

import pytest

from api.services.inventory import HardwareInventoryService
from api.services.reads.discovery import TargetLabels
from api.services.scopes import OperatorTokens
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from tests.builders import gpu
from tests.console_support import OFFLINE, ONLINE, STALE, node_id, report, seed_fleet
from tests.test_decommission import enrolled_node, execute, preview
from tests.test_monitoring_deploy import ROOT

SD = "/api/v1/sd/prometheus"
META = "__meta_modelforge_"


async def fleet_without_offline(api: Any) -> None:
    """The console's fleet (an online, a stale and an offline node), the offline one decommissioned."""
    await seed_fleet(api.pool)
    r = await execute(api, await preview(api, node_id(OFFLINE)))
    assert r.status_code == 200, r.text


def by_host(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {g["labels"][META + "hostname"]: g for g in groups}


async def test_one_target_group_per_node_not_decommissioned_with_its_labels(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await fleet_without_offline(api)
    r = await api.get(SD)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    groups = r.json()
    assert sorted(by_host(groups)) == [ONLINE, STALE], "the decommissioned node is left out"
    online = by_host(groups)[ONLINE]
    assert online == {
        "targets": [f"{ONLINE}:9400"],
        "labels": {
            META + "node_id": node_id(ONLINE),
            META + "hostname": ONLINE,
            META + "liveness": "online",
            META + "inventory_status": online["labels"][META + "inventory_status"],
            META + "health": "degraded",
            META + "gpu_count": "3",  # the missing A100 is still the node's, as in `node list`
            META + "gpu_models": "NVIDIA A100-SXM4-40GB,NVIDIA H200",
            META + "driver_version": online["labels"][META + "driver_version"],
        },
    }
    stale = by_host(groups)[STALE]["labels"]
    assert (stale[META + "liveness"], stale[META + "health"], stale[META + "gpu_count"]) == (
        "stale",
        "failed",
        "1",
    )
    # Every label says what /hardware/nodes says of the node.
    nodes = {n["id"]: n for n in (await api.get("/api/v1/hardware/nodes")).json()["items"]}
    for group in groups:
        labels = group["labels"]
        node = nodes[labels[META + "node_id"]]
        assert labels[META + "liveness"] == node["liveness"]
        assert labels[META + "inventory_status"] == node["inventory_status"]
        assert labels[META + "health"] == node["health"]["status"]
        assert labels[META + "driver_version"] == (node["driver_version"] or "")
        assert group["targets"] == [f"{node['hostname']}:9400"]


async def test_a_node_without_a_hostname_has_no_address_and_is_left_out(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    service = HardwareInventoryService(EventStore(api.pool, ALL_PROJECTIONS))
    await report(service, "", [gpu(1)], ago=1)
    await report(service, "gpu-named", [gpu(2)], ago=1)
    nodes = (await api.get("/api/v1/hardware/nodes")).json()["items"]
    assert sorted(n["hostname"] or "" for n in nodes) == ["", "gpu-named"]
    assert [g["targets"] for g in (await api.get(SD)).json()] == [["gpu-named:9400"]]


async def test_port_and_filters_narrow_as_on_nodes(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await fleet_without_offline(api)

    async def hosts(query: str) -> list[str]:
        r = await api.get(f"{SD}?{query}")
        assert r.status_code == 200, r.text
        return sorted(by_host(r.json()))

    node_exporter = (await api.get(f"{SD}?port=9100")).json()
    assert sorted(t for g in node_exporter for t in g["targets"]) == [f"{ONLINE}:9100", f"{STALE}:9100"]
    assert await hosts("liveness=online") == [ONLINE]
    assert await hosts("liveness=stale&port=9100") == [STALE]
    assert await hosts("health=failed") == [STALE]
    assert await hosts("health=degraded&liveness=online") == [ONLINE]
    assert await hosts("health=healthy") == []
    # The decommissioned node is offline on /hardware/nodes, and still not a target.
    offline = (await api.get("/api/v1/hardware/nodes?liveness=offline")).json()["items"]
    assert [n["id"] for n in offline] == [node_id(OFFLINE)]
    assert await hosts("liveness=offline") == []


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("port=0", "port"),
        ("port=65536", "port"),
        ("port=http", "port"),
        ("liveness=asleep", "liveness"),
        ("health=sick", "health"),
        ("colour=blue", "colour"),
    ],
)
async def test_bad_input_is_a_400_problem_naming_the_parameter(make_api, query: str, field: str) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    r = await api.get(f"{SD}?{query}")
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    # Named in the errors (a bad value) or the detail (an unknown name), not only in the echoed URL.
    named = [e for e in problem.get("errors", []) if e.startswith(f"{field}: ")]
    assert named or f"parameter(s): {field}" in problem["detail"], problem


async def test_no_nodes_is_an_empty_list(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    r = await api.get(SD)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.content == b"[]"


async def test_a_viewer_token_reads_the_targets_an_agent_credential_does_not(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    credential, _ = await enrolled_node(api)  # the harness's host, refreshed by the server
    created = await OperatorTokens(api.pool).create(ttl_seconds=3600, description="prometheus")
    viewer = await api.client.get(SD, headers={"Authorization": f"Bearer {created.token}"})
    assert viewer.status_code == 200, viewer.text
    assert viewer.json() == (await api.get(SD)).json() != []
    for refused in ({"Authorization": f"Bearer {credential}"}, {}):
        r = await api.client.get(SD, headers=refused)
        assert r.status_code == 401, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
    await OperatorTokens(api.pool).revoke(created.token_id)
    assert (await api.client.get(SD, headers={"Authorization": f"Bearer {created.token}"})).status_code == 401


async def test_the_openapi_document_names_the_route_and_its_labels(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    doc = (await api.client.get("/schema/openapi.json")).json()
    op = doc["paths"][SD]["get"]
    assert op["operationId"] == "listPrometheusTargets" and op["tags"] == ["discovery"]
    assert {p["name"] for p in op["parameters"]} == {"port", "liveness", "health"}
    assert {"400", "401", "403", "503"} <= set(op["responses"])
    labels = doc["components"]["schemas"]["TargetLabels"]["properties"]
    assert sorted(labels) == sorted(
        META + n
        for n in (
            "node_id",
            "hostname",
            "liveness",
            "inventory_status",
            "health",
            "gpu_count",
            "gpu_models",
            "driver_version",
        )
    )


def test_the_integrations_doc_names_every_label() -> None:
    doc = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    for name in TargetLabels.__struct_encode_fields__:
        assert f"`{name}`" in doc, name
    assert "## Prometheus service discovery" in doc and "/api/v1/sd/prometheus" in doc
