"""/metrics on prometheus-client: conventional names, dcgm-exporter labels, build info, liveness,
unsupported absent and a known 0 kept; the catalog page generated from the code."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from api.services.metrics import (
    GPU_LABELS,
    GPU_TELEMETRY,
    METRICS,
    GpuRow,
    NodeRow,
    Snapshot,
    render,
    render_catalog,
)
from tests.fixtures_nvml import multi_gpu_scenario, rtx_4090_driver_535

ROOT = Path(__file__).resolve().parent.parent


def families(text: str) -> dict[str, Any]:
    out = {}
    for f in text_string_to_metric_families(text):
        # the parser names a counter family without `_total`; the catalog names the sample
        out[f.name + "_total" if f.type == "counter" else f.name] = f
    return out


def samples(text: str, name: str) -> list[Any]:
    return list(families(text)[name].samples) if name in families(text) else []


async def test_metrics_content_type_names_and_dcgm_labels(make_api) -> None:  # type: ignore[no-untyped-def]
    sc = rtx_4090_driver_535()  # fan at a measured 0 %
    sc.gpus.append(multi_gpu_scenario(1).gpus[0])
    sc.gpus[1].errors["fan_speed"] = "NotSupported"
    sc.gpus[1].utilization_gpu_percent = 37
    sc.gpus[1].clock_sm_mhz = 1980
    api = make_api(sc)
    await api.refresh()
    assert (await api.client.get("/metrics")).status_code == 401
    r = await api.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    got = families(r.text)
    assert set(got) == {m.name for m in METRICS}, "every family is in the catalog and vice versa"
    for name in got:
        assert not name.endswith(("_percent", "_mhz")), name

    fan = {s.labels["UUID"]: s.value for s in got["modelforge_gpu_fan_speed_ratio"].samples}
    assert fan == {sc.gpus[0].uuid: 0.0}, "a known 0 is 0; an unsupported fan is absent"
    util = {s.labels["UUID"]: s.value for s in got["modelforge_gpu_utilization_ratio"].samples}
    assert util[sc.gpus[1].uuid] == 0.37
    sm = {s.labels["UUID"]: s.value for s in got["modelforge_gpu_clock_sm_hertz"].samples}
    assert sm[sc.gpus[1].uuid] == 1980e6

    accs = {a["uuid"]: a for a in (await api.get("/api/v1/hardware/accelerators")).json()["items"]}
    node = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]
    for s in got["modelforge_gpu_temperature_celsius"].samples:
        acc = accs[s.labels["UUID"]]
        assert set(s.labels) == set(GPU_LABELS)
        assert s.labels["gpu"] == str(acc["index"])
        assert s.labels["modelName"] == acc["name"]
        assert s.labels["Hostname"] == node["hostname"] and s.labels["node_id"] == node["id"]
        assert s.value == acc["telemetry"]["temperature_celsius"]["value"]

    (build,) = got["modelforge_build_info"].samples
    assert build.labels["version"] == "0.1.0" and build.value == 1
    liveness = {s.labels["liveness"]: s.value for s in got["modelforge_node_liveness"].samples}
    assert liveness == {"local": 1, "online": 0, "stale": 0, "offline": 0}
    inventory = {s.labels["status"]: s.value for s in got["modelforge_node_inventory_status"].samples}
    assert inventory["ok"] == 1 and sum(inventory.values()) == 1
    assert samples(r.text, "modelforge_ingest_events_total")[0].value > 0
    assert got["modelforge_projection_lag_events"].samples[0].value == 0


async def test_missing_gpu_is_flagged_and_has_no_current_telemetry(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    gone = api.scenario.gpus.pop(1)
    await api.refresh()
    text = (await api.get("/metrics")).text
    info = {s.labels["UUID"]: s.labels["status"] for s in samples(text, "modelforge_gpu_info")}
    assert info[gone.uuid] == "missing"
    assert all(s.labels["UUID"] != gone.uuid for s in samples(text, "modelforge_gpu_power_watts"))
    counts = {s.labels["status"]: s.value for s in samples(text, "modelforge_accelerators")}
    assert counts == {"active": 1, "missing": 1}


# --- the collector, without I/O ---------------------------------------------------------------------

facts = st.one_of(
    st.builds(lambda v: {"state": "known", "value": v}, st.integers(0, 10**12)),
    st.builds(lambda v: {"state": "known", "value": v}, st.floats(0, 1e6, allow_nan=False)),
    st.builds(lambda v: {"state": "known", "value": v}, st.booleans() | st.just("abc")),
    st.just({"state": "unsupported"}),
    st.just({"state": "unknown"}),
    st.builds(lambda r: {"state": "unavailable", "reason": r}, st.text(max_size=5)),
    st.builds(lambda r: {"state": "temporarily_failed", "reason": r}, st.text(max_size=5)),
)


def expected(fact: dict[str, Any], scale: float) -> float | None:
    value = fact.get("value")
    if fact["state"] != "known" or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) * scale


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(telemetry=st.dictionaries(st.sampled_from([m.source for m in GPU_TELEMETRY]), facts))
def test_a_sample_exists_exactly_when_its_fact_is_a_known_number(telemetry: dict[str, Any]) -> None:
    gpu = GpuRow("n1", "host", "GPU-1", "active", "0", "NVIDIA H200", "0000:01:00.0", "580", telemetry)
    text = render(
        Snapshot(nodes=[], gpus=[gpu], accelerator_counts={}, head=0, folded=0, counters={})
    ).decode()
    parsed = families(text)
    for spec in GPU_TELEMETRY:
        got = [s.value for s in parsed[spec.name].samples]
        want = expected(telemetry[spec.source], spec.scale) if spec.source in telemetry else None
        if want is None:
            assert got == [], spec.name
        else:
            assert len(got) == 1 and abs(got[0] - want) <= 1e-9 * max(1.0, abs(want)), spec.name


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(age=st.floats(0, 1000))
def test_liveness_gauge_has_exactly_one_state_set(age: float) -> None:
    from api.services.repository import LivenessPolicy

    now = datetime(2026, 1, 1, tzinfo=UTC)
    state = LivenessPolicy(60, 300).judge("agent", now - timedelta(seconds=age), now)
    node = NodeRow("n1", "h", state, "ok", now - timedelta(seconds=age), {}, [])
    text = render(
        Snapshot(nodes=[node], gpus=[], accelerator_counts={}, head=0, folded=0, counters={})
    ).decode()
    got = {s.labels["liveness"]: s.value for s in samples(text, "modelforge_node_liveness")}
    assert sum(got.values()) == 1 and got[state] == 1
    assert state == ("online" if age <= 60 else "stale" if age <= 300 else "offline")


def test_metrics_catalog_page_is_up_to_date() -> None:
    page = ROOT / "docs" / "metrics.md"
    assert page.read_text(encoding="utf-8") == render_catalog(), (
        "docs/metrics.md is out of date with api/services/metrics.py: run `python -m api.services.metrics --write`"
    )
