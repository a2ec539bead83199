"""/metrics on prometheus-client: conventional names, dcgm-exporter labels, build info, liveness,
unsupported absent and a known 0 kept; the catalog page generated from the code."""

from __future__ import annotations

import asyncio
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from api.services.metrics import exposition
from api.services.metrics.catalog import (
    GPU_CLOCK_EVENTS,
    GPU_HEALTH_SIGNALS,
    GPU_LABELS,
    GPU_TELEMETRY,
    GPU_XID,
    HEALTH_ACTIONS,
    HEALTH_STATES,
    LIVENESS_STATES,
    METRICS,
)
from api.services.metrics.exposition import render
from api.services.metrics.page import render_catalog
from api.services.metrics.snapshot import GpuRow, NodeRow, Snapshot, read_snapshot
from api.services.reads.facts import stored_facts
from api.services.reads.liveness import LivenessPolicy
from collectors.gpu_health import CLOCK_EVENT_REASONS, AcceleratorHealthSignals
from tests.fakes.fake_pynvml import nvmlClocksEventReasonGpuIdle, nvmlClocksEventReasonHwThermalSlowdown
from tests.fixtures_nvml import multi_gpu_scenario, rtx_3060_laptop, rtx_4090_driver_535
from tests.loop_support import OtherWork, ran_between, turns_at_calls
from tests.metrics_support import facts, signals_of

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


async def test_a_fleets_text_from_its_decoded_samples_is_that_of_their_stored_form(make_api) -> None:  # type: ignore[no-untyped-def]
    # A scrape reads each GPU's sample as its event decodes it; the same facts in the stored
    # (jsonb) form, as the read models keep a node's, must make the same bytes, signals and all.
    sc = multi_gpu_scenario(4)
    sc.gpus[1].remapped_rows = (0, 0, 0, 1)
    sc.gpus[2].errors["fan_speed"] = "NotSupported"
    api = make_api(sc)
    await api.refresh()
    api.nvml.xid(sc.gpus[3].uuid, 79)
    await api.refresh()
    decoded = await read_snapshot(
        api.pool, LivenessPolicy(api.config.stale_after, api.config.offline_after), {}
    )
    assert len(decoded.gpus) == 4
    assert all(g.telemetry and g.health_signals is not None for g in decoded.gpus)
    stored = msgspec.structs.replace(
        decoded,
        gpus=[
            msgspec.structs.replace(
                g,
                telemetry=stored_facts(msgspec.to_builtins(g.telemetry)),
                health_signals=msgspec.convert(
                    msgspec.to_builtins(g.health_signals), AcceleratorHealthSignals
                ),
            )
            for g in decoded.gpus
        ],
    )
    text = render(decoded)
    assert text == render(stored)
    assert by_uuid(text.decode(), "DCGM_FI_DEV_ROW_REMAP_FAILURE")[sc.gpus[1].uuid] == 1
    assert sc.gpus[2].uuid not in by_uuid(text.decode(), "modelforge_gpu_fan_speed_ratio")


def by_uuid(text: str, name: str) -> dict[str, float]:
    return {s.labels["UUID"]: s.value for s in samples(text, name)}


def state_set(text: str, name: str, label: str) -> dict[str, str]:
    """UUID -> the one state whose series is 1, checking that exactly one is and the rest 0."""
    out: dict[str, str] = {}
    seen: dict[str, list[float]] = {}
    for s in samples(text, name):
        seen.setdefault(s.labels["UUID"], []).append(s.value)
        if s.value == 1:
            out[s.labels["UUID"]] = s.labels[label]
    for uuid, values in seen.items():
        assert sorted(values) == [0] * (len(values) - 1) + [1], (name, uuid, values)
    return out


async def test_gpu_health_metrics_follow_the_verdicts_and_export_only_known_signals(make_api) -> None:  # type: ignore[no-untyped-def]
    sc = multi_gpu_scenario(3)
    clean, pending, failing = sc.gpus
    pending.remapped_rows = (0, 1, 1, 0)  # correctable, uncorrectable, pending, failure
    pending.clock_event_reasons = nvmlClocksEventReasonGpuIdle | nvmlClocksEventReasonHwThermalSlowdown
    failing.ecc_errors = {**failing.ecc_errors, "uncorrected_volatile": 3, "corrected_aggregate": 12}
    consumer = rtx_3060_laptop().gpus[0]  # no ECC, no row remapper: unsupported, not 0
    sc.gpus.append(consumer)
    api = make_api(sc)
    await api.refresh()
    api.nvml.xid(failing.uuid, 79)
    api.nvml.xid(failing.uuid, 13)  # an application's fault: recorded, no verdict of its own
    await api.refresh()
    text = (await api.get("/metrics")).text
    accs = {a["uuid"]: a for a in (await api.get("/api/v1/hardware/accelerators")).json()["items"]}

    # The state sets say what the API says, one state at 1 per GPU.
    assert state_set(text, "modelforge_gpu_health_status", "status") == {
        u: a["health"]["status"] for u, a in accs.items()
    }
    assert state_set(text, "modelforge_gpu_health_status", "status") == {
        clean.uuid: "healthy",
        pending.uuid: "degraded",
        failing.uuid: "failed",
        consumer.uuid: "healthy",
    }
    assert state_set(text, "modelforge_gpu_health_action", "action") == {
        u: a["health"]["action"] for u, a in accs.items()
    }
    reasons = {
        (s.labels["UUID"], s.labels["code"], s.labels["status"])
        for s in samples(text, "modelforge_gpu_health_reason")
    }
    assert reasons == {
        (pending.uuid, "row_remap_pending", "degraded"),
        (pending.uuid, "clock_event_hw_thermal_slowdown", "degraded"),
        (failing.uuid, "ecc_uncorrected", "failed"),
        (failing.uuid, "xid_79", "failed"),
    }

    # dcgm-exporter's names and meanings; a consumer GPU's ECC and row counters are absent.
    assert by_uuid(text, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL") == {clean.uuid: 0, pending.uuid: 0, failing.uuid: 3}
    assert by_uuid(text, "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL") == {
        clean.uuid: 0,
        pending.uuid: 0,
        failing.uuid: 12,
    }
    assert by_uuid(text, "DCGM_FI_DEV_ROW_REMAP_PENDING") == {clean.uuid: 0, pending.uuid: 1, failing.uuid: 0}
    assert by_uuid(text, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS")[pending.uuid] == 1
    assert consumer.uuid not in by_uuid(text, "DCGM_FI_DEV_ROW_REMAP_FAILURE")
    assert by_uuid(text, "DCGM_FI_DEV_RETIRED_SBE") == {}, "Hopper and Ampere retire no pages: absent"
    assert by_uuid(text, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER")[consumer.uuid] == 0
    mask = by_uuid(text, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
    assert mask[pending.uuid] == CLOCK_EVENT_REASONS["gpu_idle"] | CLOCK_EVENT_REASONS["hw_thermal_slowdown"]
    assert mask[clean.uuid] == 0
    # The newest XID's code, as dcgm-exporter's is the last one seen; none for GPUs without any.
    assert by_uuid(text, "DCGM_FI_DEV_XID_ERRORS") == {failing.uuid: 13}
    for name in ("DCGM_FI_DEV_XID_ERRORS", "modelforge_gpu_health_status"):
        assert all(set(s.labels) - {"status"} == set(GPU_LABELS) for s in samples(text, name))

    # Serviced: the failing GPU comes back clean; the verdict follows at the next refresh.
    failing.ecc_errors = {**failing.ecc_errors, "uncorrected_volatile": 0}
    await api.refresh()
    text = (await api.get("/metrics")).text
    assert (
        state_set(text, "modelforge_gpu_health_status", "status")[failing.uuid] == "failed"
    )  # XID 79 window
    assert {
        s.labels["code"]
        for s in samples(text, "modelforge_gpu_health_reason")
        if s.labels["UUID"] == failing.uuid
    } == {"xid_79"}


async def test_promtool_accepts_the_health_metrics(make_api) -> None:  # type: ignore[no-untyped-def]
    from tests.test_monitoring_deploy import promtool_path

    sc = multi_gpu_scenario(2)
    sc.gpus[1].remapped_rows = (0, 0, 0, 1)
    api = make_api(sc)
    await api.refresh()
    api.nvml.xid(sc.gpus[1].uuid, 64)
    await api.refresh()
    text = (await api.get("/metrics")).text
    done = await asyncio.to_thread(
        subprocess.run,
        [promtool_path(), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # dcgm-exporter's own names are kept on purpose (docs/metrics.md), lint and all: its label
    # names (modelName, ...) are not snake_case and its PCIe replay counter says "COUNTER".
    dcgm_names = (
        "label names should be written in 'snake_case'",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER metric name should not include type 'counter'",
    )
    lines = (done.stdout + done.stderr).splitlines()
    problems = [line for line in lines if line.strip() and not any(d in line for d in dcgm_names)]
    assert problems == [], problems
    assert done.returncode in (0, 3), done  # 3: lint findings only (those above), no parse error
    assert by_uuid(text, "DCGM_FI_DEV_ROW_REMAP_FAILURE") == {sc.gpus[0].uuid: 0, sc.gpus[1].uuid: 1}


# --- the collector, without I/O ---------------------------------------------------------------------


def expected(fact: dict[str, Any], scale: float) -> float | None:
    value = fact.get("value")
    if fact["state"] != "known" or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) * scale


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(telemetry=st.dictionaries(st.sampled_from([m.source for m in GPU_TELEMETRY]), facts))
def test_a_sample_exists_exactly_when_its_fact_is_a_known_number(telemetry: dict[str, Any]) -> None:
    decoded = stored_facts(telemetry)
    gpu = GpuRow("n1", "host", "GPU-1", "active", "0", "NVIDIA H200", "0000:01:00.0", "580", decoded)
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
@given(state=st.sampled_from(LIVENESS_STATES), age=st.floats(0, 1000))
def test_liveness_gauge_has_exactly_one_state_set(state: str, age: float) -> None:
    # The verdict itself is the read models' (tests/test_liveness.py); the gauge shows it.
    now = datetime(2026, 1, 1, tzinfo=UTC)
    node = NodeRow("n1", "h", state, "ok", now - timedelta(seconds=age), {}, [])
    text = render(
        Snapshot(nodes=[node], gpus=[], accelerator_counts={}, head=0, folded=0, counters={})
    ).decode()
    got = {s.labels["liveness"]: s.value for s in samples(text, "modelforge_node_liveness")}
    assert got == {s: float(s == state) for s in LIVENESS_STATES}


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.fixed_dictionaries({spec.source: facts for spec in GPU_HEALTH_SIGNALS}),
    reasons=st.dictionaries(st.sampled_from(sorted(CLOCK_EVENT_REASONS)), facts),
    xid=st.none() | st.integers(1, 200),
    verdict=st.sampled_from(HEALTH_STATES),
    action=st.sampled_from(HEALTH_ACTIONS),
)
def test_a_health_sample_exists_exactly_when_its_signal_is_known_and_of_its_kind(
    values: dict[str, Any], reasons: dict[str, Any], xid: int | None, verdict: str, action: str
) -> None:
    signals = signals_of(values, reasons)
    gpu = GpuRow(
        "n1",
        "host",
        "GPU-1",
        "active",
        "0",
        "NVIDIA H200",
        "0000:01:00.0",
        "580",
        {},
        health_status=verdict,
        health_action=action,
        health_signals=signals,
        last_xid=xid,
    )
    text = render(
        Snapshot(nodes=[], gpus=[gpu], accelerator_counts={}, head=0, folded=0, counters={})
    ).decode()
    parsed = families(text)
    for spec in GPU_HEALTH_SIGNALS:
        fact = values[spec.source]
        value = fact.get("value")
        if fact["state"] != "known":
            want = None
        elif spec.flag:
            want = float(value) if isinstance(value, bool) else None
        else:
            want = float(value) if isinstance(value, int) and not isinstance(value, bool) else None
        got = [s.value for s in parsed[spec.name].samples]
        assert got == ([] if want is None else [want]), (spec.name, fact)
    # The clock bitmask only when every reason is a known boolean; never a partial mask.
    complete = set(reasons) == set(CLOCK_EVENT_REASONS) and all(
        f["state"] == "known" and isinstance(f.get("value"), bool) for f in reasons.values()
    )
    mask = [s.value for s in parsed[GPU_CLOCK_EVENTS.name].samples]
    if complete:
        assert mask == [float(sum(CLOCK_EVENT_REASONS[n] for n, f in reasons.items() if f["value"]))]
    else:
        assert mask == []
    assert [s.value for s in parsed[GPU_XID.name].samples] == ([] if xid is None else [float(xid)])
    assert {s.labels["status"]: s.value for s in parsed["modelforge_gpu_health_status"].samples} == {
        s: float(s == verdict) for s in HEALTH_STATES
    }
    assert {s.labels["action"]: s.value for s in parsed["modelforge_gpu_health_action"].samples} == {
        a: float(a == action) for a in HEALTH_ACTIONS
    }


def test_metrics_catalog_page_is_up_to_date() -> None:
    page = ROOT / "docs" / "metrics.md"
    assert page.read_text(encoding="utf-8") == render_catalog(), (
        "docs/metrics.md is out of date with api/services/metrics/catalog.py: run `python -m api.services.metrics --write`"
    )


def test_a_fleet_without_lines_for_a_family_is_still_rendered_in_bounded_pieces(
    monkeypatch: Any,
) -> None:
    # A fleet whose GPUs send no health signals and no known metric gives most families no line
    # at all. The route lets the event loop run between pieces (agent reports, liveness probes);
    # pieces cut by lines alone would make each such family one pass over every GPU with the
    # loop held (bench.api: a probe waited 1.2 s during a scrape of 80,000 GPUs).
    gpus = [
        GpuRow(
            f"n{i // 8}",
            f"h{i // 8}",
            f"GPU-{i}",
            "active",
            str(i % 8),
            "NVIDIA H200",
            "0000:01:00.0",
            "580",
            {},
        )
        for i in range(3 * exposition.CHUNK_LINES)
    ]
    examined = 0

    def counted(real: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            nonlocal examined
            examined += 1
            return real(*args)

        return wrapper

    for name in ("fact_value", "signal_value", "clock_event_mask"):
        monkeypatch.setattr(exposition, name, counted(getattr(exposition, name)))
    snapshot = Snapshot(nodes=[], gpus=gpus, accelerator_counts={}, head=0, folded=0, counters={})
    marks = [examined for _piece in exposition.render_chunks(snapshot)]
    assert examined >= len(gpus) * (len(GPU_TELEMETRY) + len(GPU_HEALTH_SIGNALS))
    gaps = [after - before for before, after in zip([0, *marks], marks, strict=False)]
    assert max(gaps) <= exposition.CHUNK_LINES


async def test_a_scrape_decodes_the_fleets_samples_with_the_event_loop_let_run_between(
    make_api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape reads every node's latest snapshot (tens of milliseconds for a thousand nodes,
    seconds for ten thousand) on the loop the agents' reports wait on: they are decoded a slice at
    a time, and what else is ready runs between two slices."""
    from api.services.reads import samples as sample_reads

    for node in ("metrics-node-1", "metrics-node-2", "metrics-node-3"):
        await make_api(multi_gpu_scenario(2), node_id=node).refresh()
    api = make_api(multi_gpu_scenario(2), node_id="metrics-node-4")
    await api.refresh()
    other = OtherWork()
    monkeypatch.setattr(sample_reads, "DECODE_SLICE", 1)
    seen = turns_at_calls(monkeypatch, sample_reads, "event_from_row", other)
    async with other:
        snapshot = await read_snapshot(
            api.pool, LivenessPolicy(api.config.stale_after, api.config.offline_after), {}
        )
    assert len(snapshot.gpus) == 8 and all(g.telemetry for g in snapshot.gpus)
    assert len(seen) == 4, seen  # each node's latest snapshot once
    assert ran_between(seen), seen


async def test_a_scrape_holds_the_older_collections_off_until_its_rows_are_gone(
    make_api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the read to the end of the text, one deferral: ended between them, or with the rows
    still alive, the first older pass after it goes over every row of the fleet with the event
    loop held (over a second at 10,000 nodes)."""
    import gc

    from api.http import app as routes

    api = make_api(multi_gpu_scenario(2))
    await api.refresh()
    before = gc.get_threshold()
    assert before[1] < 10**9
    seen: list[tuple[str, int]] = []
    read, render = routes.read_snapshot, exposition.render_chunks

    async def reading(*args: Any) -> Snapshot:
        snapshot = await read(*args)
        seen.append(("read", gc.get_threshold()[1]))  # its own deferral has ended here
        return snapshot

    def rendering(snapshot: Snapshot) -> Any:
        for chunk in render(snapshot):
            seen.append(("chunk", gc.get_threshold()[1]))
            yield chunk

    monkeypatch.setattr(routes, "read_snapshot", reading)
    monkeypatch.setattr(exposition, "render_chunks", rendering)
    r = await api.get("/metrics")
    assert r.status_code == 200 and b"modelforge_gpu_info{" in r.content
    assert seen[0][0] == "read" and len(seen) > 1
    assert all(older >= 10**9 for _, older in seen), seen
    assert gc.get_threshold() == before
