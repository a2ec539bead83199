"""Local inventory through the HTTP API, real PostgreSQL, fake NVML."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from tests.agent_support import wait_for
from tests.fakes.nvml_devices import FakeGpu
from tests.fixtures_nvml import multi_gpu_scenario, rtx_4090_driver_535


def ids(items: list[dict]) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return sorted((i["id"], i.get("uuid") or i.get("identity_key")) for i in items)


async def test_refresh_twice_same_identities_no_new_lifecycle_events(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(8))
    first = await api.refresh()
    assert first["outcome"] == "succeeded"
    nodes1 = (await api.get("/api/v1/hardware/nodes")).json()["items"]
    accs1 = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
    lifecycle_before = await api.lifecycle_types()
    assert lifecycle_before.count("NODE_DISCOVERED") == 1
    assert lifecycle_before.count("ACCELERATOR_DISCOVERED") == 8

    second = await api.refresh()
    assert all(e["event_class"] == "observation" for e in second["events"])
    nodes2 = (await api.get("/api/v1/hardware/nodes")).json()["items"]
    accs2 = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
    assert ids(nodes1) == ids(nodes2) and len(nodes2) == 1
    assert ids(accs1) == ids(accs2) and len(accs2) == 8
    assert await api.lifecycle_types() == lifecycle_before
    assert nodes1[0]["fingerprint"] == nodes2[0]["fingerprint"]
    # typed metrics: power in watts from milliwatts, temperature known
    acc = next(a for a in accs2 if a["index"] == 0)
    assert acc["telemetry"]["power_watts"] == {"state": "known", "value": 120.0}
    assert acc["telemetry"]["fan_speed_percent"] == {"state": "unsupported"}
    assert acc["status"] == "active" and acc["compute_capability"] == "9.0"


async def test_health_pending_before_any_inventory(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    r = await api.client.get("/api/v1/health")  # no token needed
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["inventory"]["status"] == "pending"


async def test_zero_gpus_node_active_capability_absent(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(0))
    out = await api.refresh()
    assert out["inventory_status"] == "ok"
    node = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]
    assert node["status"] == "active" and node["accelerator_capability"] == "absent"
    assert (await api.get("/api/v1/hardware/accelerators")).json()["items"] == []
    assert (await api.client.get("/api/v1/health")).json()["inventory"]["status"] == "ok"


@pytest.mark.parametrize("error", ["LibraryNotFound", "DriverNotLoaded"])
async def test_nvml_unavailable_without_prior_gpu_is_degraded(make_api, error: str) -> None:  # type: ignore[no-untyped-def]
    sc = multi_gpu_scenario(0)
    sc.init_error = error
    api = make_api(sc)
    out = await api.refresh()
    assert out["outcome"] == "succeeded" and out["inventory_status"] == "degraded"
    node = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]
    assert node["status"] == "active" and node["inventory_status"] == "degraded"
    assert any("NVML unavailable" in r for r in node["inventory_reasons"])
    health = (await api.client.get("/api/v1/health")).json()
    assert health["inventory"]["status"] == "degraded"
    assert "INVENTORY_STATUS_CHANGED" in await api.lifecycle_types()


async def test_incomplete_scan_keeps_last_good_gpu_state(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(3))
    await api.refresh()
    api.scenario.gpus[1].lost = True
    out = await api.refresh()
    assert out["inventory_status"] == "degraded"
    accs = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
    assert len(accs) == 3 and all(a["status"] == "active" for a in accs)
    assert "ACCELERATOR_MISSING" not in await api.lifecycle_types()
    node = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]
    assert any("incomplete" in r for r in node["inventory_reasons"])


async def test_nvml_unavailable_after_gpus_keeps_them_active(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    api.scenario.init_error = "DriverNotLoaded"
    out = await api.refresh()
    assert out["inventory_status"] == "degraded"
    accs = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
    assert [a["status"] for a in accs] == ["active", "active"]


async def audited(api, event_type: str, count: int) -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    """The events of a type as GET /hardware/events shows them, once it shows `count`: the audit
    read is gap-safe, so it shows a transaction once every older one on the server has ended
    (another database's too, e.g. a parallel test run's)."""

    async def read() -> list[dict] | None:  # type: ignore[type-arg]
        items: list[dict] = (await api.get("/api/v1/hardware/events", params={"type": event_type})).json()[
            "items"
        ]  # type: ignore[type-arg]
        return items if len(items) >= count else None

    return await wait_for(read, 30, f"{count} {event_type} in the audit log", every=0.1)  # type: ignore[no-any-return]


async def test_gpu_absent_from_complete_enumeration_is_missing_then_rediscovered(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(3))
    await api.refresh()
    gone = api.scenario.gpus.pop(2)
    await api.refresh()
    accs = {a["uuid"]: a for a in (await api.get("/api/v1/hardware/accelerators")).json()["items"]}
    assert accs[gone.uuid]["status"] == "missing"
    missing = (await api.get("/api/v1/hardware/accelerators", params={"status": "missing"})).json()["items"]
    assert [a["uuid"] for a in missing] == [gone.uuid]
    events = await audited(api, "ACCELERATOR_MISSING", 1)
    assert len(events) == 1 and events[0]["data"]["uuid"] == gone.uuid
    api.scenario.gpus.append(gone)
    await api.refresh()
    accs = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
    assert len(accs) == 3 and all(a["status"] == "active" for a in accs)
    rediscovered = await audited(api, "ACCELERATOR_DISCOVERED", 4)
    assert [e["data"]["rediscovered"] for e in rediscovered] == [False, False, False, True]


async def test_index_and_pci_change_is_one_accelerator_with_hardware_changed(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    a, b = api.scenario.gpus
    a.pci_bus_id, b.pci_bus_id = b.pci_bus_id, a.pci_bus_id
    api.scenario.gpus = [b, a]  # indices swap
    await api.refresh()
    accs = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
    assert len(accs) == 2
    by_uuid = {x["uuid"]: x for x in accs}
    assert by_uuid[a.uuid]["index"] == 1 and by_uuid[b.uuid]["index"] == 0
    changes = await audited(api, "HARDWARE_CHANGED", 2)
    assert len(changes) == 2
    ch = next(c for c in changes if c["data"]["accelerator_uuid"] == a.uuid)["data"]["changes"]
    assert ch["index"] == {"before": {"state": "known", "value": 0}, "after": {"state": "known", "value": 1}}
    assert set(ch) == {"index", "pci_bus_id"}


async def test_fan_zero_is_known_zero_and_unsupported_fan_is_unsupported(make_api) -> None:  # type: ignore[no-untyped-def]
    sc = rtx_4090_driver_535()  # the capture reports fan_speed 0 %
    extra = multi_gpu_scenario(1).gpus[0]  # SXM: fan NotSupported
    sc.gpus.append(extra)
    api = make_api(sc)
    await api.refresh()
    accs = {a["uuid"]: a for a in (await api.get("/api/v1/hardware/accelerators")).json()["items"]}
    assert accs[sc.gpus[0].uuid]["telemetry"]["fan_speed_percent"] == {"state": "known", "value": 0}
    assert accs[extra.uuid]["telemetry"]["fan_speed_percent"] == {"state": "unsupported"}
    assert all(a["status"] == "active" for a in accs.values())


async def test_unsupported_temperature_and_power_keep_accelerator_active(make_api) -> None:  # type: ignore[no-untyped-def]
    sc = multi_gpu_scenario(1)
    sc.gpus[0].errors.update({"temperature": "NotSupported", "power_usage": "NotSupported"})
    api = make_api(sc)
    out = await api.refresh()
    assert out["inventory_status"] == "ok"
    acc = (await api.get("/api/v1/hardware/accelerators")).json()["items"][0]
    assert acc["status"] == "active"
    assert acc["telemetry"]["temperature_celsius"] == {"state": "unsupported"}
    assert acc["telemetry"]["power_watts"] == {"state": "unsupported"}


async def test_host_collection_failure_503_keeps_last_good(make_api, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    before_nodes = (await api.get("/api/v1/hardware/nodes")).json()["items"]
    before_accs = (await api.get("/api/v1/hardware/accelerators")).json()["items"]

    def broken() -> None:
        raise OSError("cannot read /proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    r = await api.post("/api/v1/hardware/refresh")
    assert r.status_code == 503
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["status"] == 503 and problem["type"].endswith("inventory-collection-failed")
    assert "INVENTORY_FAILED" in await api.lifecycle_types()
    after_accs = (await api.get("/api/v1/hardware/accelerators")).json()["items"]
    assert ids(after_accs) == ids(before_accs)
    node = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]
    assert node["inventory_status"] == "failed"
    assert node["fingerprint"] == before_nodes[0]["fingerprint"]
    assert (await api.client.get("/api/v1/health")).json()["inventory"]["status"] == "failed"
    monkeypatch.undo()
    assert (await api.refresh())["inventory_status"] == "ok"


async def test_concurrent_refreshes_are_serialized(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(4))
    responses = await asyncio.gather(*(api.post("/api/v1/hardware/refresh") for _ in range(10)))
    assert [r.status_code for r in responses] == [200] * 10
    types = await api.lifecycle_types()
    assert types.count("NODE_DISCOVERED") == 1
    assert types.count("ACCELERATOR_DISCOVERED") == 4
    assert len((await api.get("/api/v1/hardware/accelerators")).json()["items"]) == 4


async def test_driver_change_new_fingerprint_temperature_change_none(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    fp1 = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]["fingerprint"]
    for g in api.scenario.gpus:
        g.temperature_celsius += 17
    out = await api.refresh()
    assert all(e["event_class"] == "observation" for e in out["events"])
    node = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]
    assert node["fingerprint"] == fp1
    api.scenario.driver_version = "580.95.05"
    out = await api.refresh()
    lifecycle = [e["event_type"] for e in out["events"] if e["event_class"] == "lifecycle"]
    assert "HARDWARE_CHANGED" in lifecycle
    node = (await api.get(f"/api/v1/hardware/nodes/{node['id']}")).json()
    assert node["fingerprint"] != fp1 and node["driver_version"] == "580.95.05"
    changed = next(e for e in out["events"] if e["event_type"] == "HARDWARE_CHANGED")
    assert node["fingerprint_position"] >= changed["global_position"]


async def test_every_route_but_health_needs_a_token(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await api.refresh()
    acc = (await api.get("/api/v1/hardware/accelerators")).json()["items"][0]
    routes = [
        ("POST", "/api/v1/hardware/refresh"),
        ("GET", "/api/v1/hardware/nodes"),
        ("GET", f"/api/v1/hardware/nodes/{acc['node_id']}"),
        ("GET", "/api/v1/hardware/accelerators"),
        ("GET", f"/api/v1/hardware/accelerators/{acc['id']}"),
        ("GET", "/api/v1/hardware/events"),
    ]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            r = await api.client.request(method, path, headers=headers)
            assert r.status_code == 401, (method, path, headers)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["status"] == 401
    assert (await api.client.get("/api/v1/health")).status_code == 200


async def test_openapi_document_and_problem_errors(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    doc = (await api.client.get("/schema/openapi.json")).json()
    assert "/api/v1/hardware/refresh" in doc["paths"]
    r = await api.get("/api/v1/hardware/nodes/nope")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")
    r = await api.get("/api/v1/hardware/accelerators", params={"limit": "0"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/problem+json")
    r = await api.get("/api/v1/hardware/accelerators", params={"cursor": "garbage!"})
    assert r.status_code == 400


async def test_cursor_paging_visits_every_accelerator_once(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(8))
    await api.refresh()
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": "3"} | ({"cursor": cursor} if cursor else {})
        page = (await api.get("/api/v1/hardware/accelerators", params=params)).json()
        seen += [a["id"] for a in page["items"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == 8 == len(set(seen))


async def test_rebuild_verify_passes_after_all_of_the_above(make_api) -> None:  # type: ignore[no-untyped-def]
    from projections.inventory import ALL_PROJECTIONS
    from projections.rebuild import rebuild

    api = make_api(multi_gpu_scenario(3))
    await api.refresh()
    api.scenario.gpus[0].pci_bus_id = "00000000:FF:00.0"
    lost = api.scenario.gpus.pop()
    await api.refresh()
    api.scenario.init_error = "DriverNotLoaded"
    await api.refresh()
    api.scenario.init_error = None
    api.scenario.gpus.append(lost)
    api.scenario.gpus.append(
        FakeGpu(uuid="GPU-new", name="NVIDIA H200", pci_bus_id="00000000:01:00.0", memory_total_bytes=1 << 30)
    )
    await api.refresh()
    report = await rebuild(api.pool, ALL_PROJECTIONS, verify=True)
    assert report.differences == []
