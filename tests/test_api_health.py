"""GPU health in the API bodies: each accelerator's verdict, action, reasons, remembered
XIDs and latest signals; each node's GPUs by verdict; both lists filtered by verdict, live and as
of a moment (paging with the filter on: tests/test_api_conventions.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from api.services.inventory import HardwareInventoryService
from collectors.facts import UNSUPPORTED
from collectors.gpu_health import ECC_COUNTERS, REMAPPED_ROWS, XidOccurrence
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from tests.builders import gpu, pending_remap, signals, uncorrected_ecc, with_health
from tests.console_support import report
from tests.test_api_conventions import AUTH, client  # noqa: F401  # the fixture

ACCELERATORS = "/api/v1/hardware/accelerators"
NODES = "/api/v1/hardware/nodes"
# A consumer GPU: no ECC, no row remapper. Unsupported, never 0, and never a reason.
CONSUMER = signals(
    ecc_mode=UNSUPPORTED,
    ecc_errors={n: UNSUPPORTED for n in ECC_COUNTERS},
    remapped_rows={n: UNSUPPORTED for n in REMAPPED_ROWS},
)


async def get(c: httpx.AsyncClient, path: str, **params: str) -> Any:
    r = await c.get(path, params=params, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def by_uuid(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {a["uuid"]: a for a in items}


def moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def test_bodies_show_verdict_action_reasons_xids_and_signals(
    pool: asyncpg.Pool,
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    xid_at = (datetime.now(UTC) - timedelta(seconds=30)).replace(microsecond=0)
    await report(
        service,
        "health-a",
        [
            with_health(gpu(1), CONSUMER),
            with_health(gpu(2), pending_remap(xids=[XidOccurrence(code=63, at=xid_at)])),
            with_health(gpu(3), uncorrected_ecc()),
            gpu(4),  # from an agent that sends no health signals
        ],
    )
    await report(service, "health-b", [])
    accs = by_uuid((await get(client, ACCELERATORS))["items"])

    consumer = accs[gpu(1).uuid]["health"]
    assert (consumer["status"], consumer["action"], consumer["reasons"]) == ("healthy", "none", [])
    assert consumer["signals"]["ecc_errors"]["uncorrected_volatile"] == {"state": "unsupported"}
    assert consumer["signals"]["remapped_rows"]["pending"] == {"state": "unsupported"}
    assert consumer["signals"]["clock_event_reasons"]["hw_slowdown"] == {"state": "known", "value": False}

    degraded = accs[gpu(2).uuid]["health"]
    assert (degraded["status"], degraded["action"]) == ("degraded", "reset_gpu")
    assert degraded["reasons"] == [
        {
            "code": "row_remap_pending",
            "status": "degraded",
            "action": "reset_gpu",
            "detail": "row remapping pending: reset the GPU",
        },
        {
            "code": "xid_63",
            "status": "degraded",
            "action": "reset_gpu",
            "detail": "XID 63: ECC page retirement or row remapping recorded",
        },
    ]
    assert [(x["code"], moment(x["at"])) for x in degraded["recent_xids"]] == [(63, xid_at)]
    assert degraded["signals"]["remapped_rows"]["pending"] == {"state": "known", "value": True}
    assert "xids" not in degraded["signals"], "XIDs are shown once, in recent_xids"

    failed = accs[gpu(3).uuid]["health"]
    assert (failed["status"], failed["action"]) == ("failed", "service")
    assert [r["code"] for r in failed["reasons"]] == ["ecc_uncorrected"]
    assert failed["signals"]["ecc_errors"]["uncorrected_volatile"] == {"state": "known", "value": 2}

    old_agent = accs[gpu(4).uuid]["health"]
    assert old_agent == {
        "status": "healthy",
        "action": "none",
        "reasons": [],
        "recent_xids": [],
        "signals": None,
    }

    # One accelerator reads as it does in the list.
    one = await get(client, f"{ACCELERATORS}/{accs[gpu(2).uuid]['id']}")
    assert one["health"] == degraded

    nodes = {n["hostname"]: n for n in (await get(client, NODES))["items"]}
    assert nodes["health-a"]["health"] == {"status": "failed", "healthy": 2, "degraded": 1, "failed": 1}
    assert nodes["health-b"]["health"] == {"status": "healthy", "healthy": 0, "degraded": 0, "failed": 0}
    assert (await get(client, f"{NODES}/{nodes['health-a']['id']}"))["health"] == nodes["health-a"]["health"]


async def test_filters_follow_a_change_of_verdict_live_and_as_of(
    pool: asyncpg.Pool,
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    service = HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS))
    xid_at = datetime.now(UTC) - timedelta(seconds=30)
    failing = [with_health(gpu(1), signals()), with_health(gpu(2), uncorrected_ecc())]
    await report(service, "filter-a", failing, ago=2)
    await report(service, "filter-b", [with_health(gpu(7), pending_remap(xids=[XidOccurrence(94, xid_at)]))])
    before = datetime.now(UTC)

    async def uuids(path: str, **params: str) -> list[str]:
        return [i.get("uuid") or i["hostname"] for i in (await get(client, path, **params))["items"]]

    assert await uuids(ACCELERATORS, health="failed") == [gpu(2).uuid]
    assert await uuids(ACCELERATORS, health="degraded") == [gpu(7).uuid]
    assert await uuids(NODES, health="failed") == ["filter-a"]

    # Serviced: the same GPU reports clean. It leaves the failed list, its node turns healthy.
    await report(service, "filter-a", [with_health(gpu(1), signals()), with_health(gpu(2), signals())])
    assert await uuids(ACCELERATORS, health="failed") == []
    assert sorted(await uuids(ACCELERATORS, health="healthy")) == sorted([gpu(1).uuid, gpu(2).uuid])
    assert await uuids(NODES, health="failed") == []
    assert sorted(await uuids(NODES, health="healthy")) == ["filter-a"]

    # A report without the XID keeps it remembered, and it still counts within its window.
    await report(service, "filter-b", [with_health(gpu(7), signals())])
    b = by_uuid((await get(client, ACCELERATORS, health="degraded"))["items"])[gpu(7).uuid]["health"]
    assert [r["code"] for r in b["reasons"]] == ["xid_94"] and [x["code"] for x in b["recent_xids"]] == [94]

    # As of the moment before the service, the verdicts and the filters read as they did then.
    past = {"as_of": before.isoformat()}
    assert await uuids(ACCELERATORS, health="failed", **past) == [gpu(2).uuid]
    assert await uuids(NODES, health="failed", **past) == ["filter-a"]
    then = by_uuid((await get(client, ACCELERATORS, **past))["items"])
    assert [r["code"] for r in then[gpu(7).uuid]["health"]["reasons"]] == ["row_remap_pending", "xid_94"]
    # As of now, the fold from the log equals the live read models.
    now = {"as_of": datetime.now(UTC).isoformat()}
    live = by_uuid((await get(client, ACCELERATORS))["items"])
    folded = by_uuid((await get(client, ACCELERATORS, **now))["items"])
    assert {u: a["health"] for u, a in folded.items()} == {u: a["health"] for u, a in live.items()}
    live_nodes = {n["id"]: n["health"] for n in (await get(client, NODES))["items"]}
    assert {n["id"]: n["health"] for n in (await get(client, NODES, **now))["items"]} == live_nodes


@pytest.mark.parametrize("path", [ACCELERATORS, NODES])
async def test_an_unknown_verdict_is_refused(client: httpx.AsyncClient, path: str) -> None:  # noqa: F811
    r = await client.get(path, params={"health": "sick"}, headers=AUTH)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/problem+json")
    assert "health" in r.text


async def test_the_openapi_document_describes_the_health_fields(client: httpx.AsyncClient) -> None:  # noqa: F811
    doc = (await client.get("/schema/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    assert "health" in schemas["AcceleratorBody"]["required"] and "health" in schemas["NodeBody"]["required"]
    assert set(schemas["AcceleratorHealthBody"]["required"]) == {
        "status",
        "action",
        "reasons",
        "recent_xids",
        "signals",
    }
    for path in ("/api/v1/hardware/accelerators", "/api/v1/hardware/nodes"):
        (param,) = [p for p in doc["paths"][path]["get"]["parameters"] if p["name"] == "health"]
        assert all(v in str(param["schema"]) for v in ("healthy", "degraded", "failed")), param
