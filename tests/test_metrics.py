"""/metrics on prometheus-client: conventional names, dcgm-exporter labels, build info, liveness,
unsupported absent and a known 0 kept; the catalog page generated from the code."""

from __future__ import annotations

import asyncio
import platform
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
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
from api.services.metrics.samples import clock_event_mask, fact_value, sample_value, signal_value
from api.services.metrics.snapshot import GpuRow, NodeRow, Snapshot, WebhookRow, read_snapshot
from api.services.reads.facts import stored_fact, stored_facts
from api.services.reads.liveness import LivenessPolicy
from collectors.facts import Unsupported
from collectors.gpu_health import CLOCK_EVENT_REASONS, AcceleratorHealthSignals
from tests.fakes.fake_pynvml import nvmlClocksEventReasonGpuIdle, nvmlClocksEventReasonHwThermalSlowdown
from tests.fixtures_nvml import multi_gpu_scenario, rtx_3060_laptop, rtx_4090_driver_535

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


# --- the text, against prometheus-client's own writer ------------------------------------------------


def reference_text(s: Snapshot) -> bytes:
    """The same snapshot through prometheus-client's registry and `generate_latest` (the writer
    /metrics stands in for, 5-7x faster): the same families in the same order,
    made with the same value decisions; only the writing differs."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from api.services.metrics import catalog as m

    def family(spec: Any) -> Any:
        if spec.kind == "counter":
            return CounterMetricFamily(spec.name.removesuffix("_total"), spec.help, labels=spec.labels)
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)

    def collect() -> Any:
        build = family(m.BUILD_INFO)
        build.add_metric([m.VERSION, platform.python_version()], 1)
        yield build
        node_specs = (m.NODE_LIVENESS, m.NODE_INVENTORY, m.NODE_LAST_SEEN, *m.NODE_TELEMETRY, *m.STORAGE)
        f = {spec.name: family(spec) for spec in node_specs}
        for n in s.nodes:
            base = [n.hostname, n.node_id]
            for state in m.LIVENESS_STATES:
                f[m.NODE_LIVENESS.name].add_metric([*base, state], 1 if n.liveness == state else 0)
            for state in m.INVENTORY_STATES:
                f[m.NODE_INVENTORY.name].add_metric([*base, state], 1 if n.inventory_status == state else 0)
            if n.last_received_at is not None:
                f[m.NODE_LAST_SEEN.name].add_metric(base, n.last_received_at.timestamp())
            for spec in m.NODE_TELEMETRY:
                value = sample_value(n.telemetry.get(spec.source))
                if value is not None:
                    f[spec.name].add_metric(base, value * spec.scale)
            for mount, used, total in n.storage:
                for spec, raw in zip(m.STORAGE, (used, total), strict=True):
                    value = sample_value(raw)
                    if value is not None:
                        f[spec.name].add_metric([*base, mount], value)
        yield from f.values()
        gpu_specs = (m.GPU_INFO, *m.GPU_TELEMETRY, m.GPU_HEALTH_STATUS, m.GPU_HEALTH_ACTION,
                     m.GPU_HEALTH_REASON, *m.GPU_HEALTH_SIGNALS, m.GPU_CLOCK_EVENTS, m.GPU_XID)  # fmt: skip
        f = {spec.name: family(spec) for spec in gpu_specs}
        for g in s.gpus:
            labels = [g.index, g.uuid, g.model, g.hostname, g.pci_bus_id, g.node_id]
            f[m.GPU_INFO.name].add_metric([*labels, g.status, g.driver_version], 1)
            for spec in m.GPU_TELEMETRY:
                value = fact_value(g.telemetry.get(spec.source))
                if value is not None:
                    f[spec.name].add_metric(labels, value * spec.scale)
            for state in m.HEALTH_STATES:
                f[m.GPU_HEALTH_STATUS.name].add_metric([*labels, state], 1 if g.health_status == state else 0)
            for name in m.HEALTH_ACTIONS:
                f[m.GPU_HEALTH_ACTION.name].add_metric([*labels, name], 1 if g.health_action == name else 0)
            for reason in g.health_reasons:
                f[m.GPU_HEALTH_REASON.name].add_metric([*labels, *reason], 1)
            for spec in m.GPU_HEALTH_SIGNALS:
                value = signal_value(g.health_signals, spec)
                if value is not None:
                    f[spec.name].add_metric(labels, value)
            mask = clock_event_mask(g.health_signals)
            if mask is not None:
                f[m.GPU_CLOCK_EVENTS.name].add_metric(labels, mask)
            if g.last_xid is not None:
                f[m.GPU_XID.name].add_metric(labels, g.last_xid)
        yield from f.values()
        accelerators = family(m.ACCELERATORS)
        for status, count in sorted(s.accelerator_counts.items()):
            accelerators.add_metric([status], count)
        yield accelerators
        for spec in m.COUNTERS:
            counter = family(spec)
            counter.add_metric([], s.counters.get(spec.source, 0))
            yield counter
        for spec, value in ((m.LOG_HEAD, s.head), (m.PROJECTION_LAG, max(0, s.head - s.folded))):
            single = family(spec)
            single.add_metric([], value)
            yield single
        f = {spec.name: family(spec) for spec in m.WEBHOOKS}
        for state in m.WEBHOOK_STATES:
            f[m.WEBHOOK_SUBSCRIPTIONS.name].add_metric(
                [state], sum(1 for w in s.webhooks if w.state == state)
            )
        for w in s.webhooks:
            for state in m.WEBHOOK_STATES:
                f[m.WEBHOOK_STATE.name].add_metric([w.subscription_id, state], 1 if w.state == state else 0)
            for outcome, count in zip(m.WEBHOOK_OUTCOMES, (w.delivered, w.rejected, w.retried), strict=True):
                f[m.WEBHOOK_DELIVERIES.name].add_metric([w.subscription_id, outcome], count)
            f[m.WEBHOOK_FAILED_ATTEMPTS.name].add_metric([w.subscription_id], w.attempts)
            if w.last_delivered_at is not None:
                f[m.WEBHOOK_LAST_DELIVERED.name].add_metric(
                    [w.subscription_id], w.last_delivered_at.timestamp()
                )
        yield from f.values()
        lag = family(m.REPLAY_LAG)
        if s.replay_lag is not None:
            lag.add_metric([], s.replay_lag)
        yield lag

    class Reference:
        def collect(self) -> Any:
            return collect()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Reference())
    return generate_latest(registry)


def signals_of(values: dict[str, Any], reasons: dict[str, Any]) -> AcceleratorHealthSignals:
    """Health signals as a sample's event decodes them, from one stored fact per signal's source
    (any other signal unsupported)."""
    groups: dict[str, Any] = {
        "clock_event_reasons": stored_facts(reasons),
        "ecc_mode": Unsupported(),
        "ecc_errors": {},
        "remapped_rows": {},
        "retired_pages": {},
        "pcie_replay_count": Unsupported(),
        "xid_events": Unsupported(),
    }
    for source, fact in values.items():
        group, _, name = source.removeprefix("health.").partition(".")
        if name:
            groups[group][name] = stored_fact(fact)
        else:
            groups[group] = stored_fact(fact)
    return AcceleratorHealthSignals(**groups)


# Label values a scrape must carry through intact: quotes, backslashes, newlines, non-ASCII.
label_text = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ['a"b', "back\\slash", "two\nlines", "\\n", 'q"\\', "gpu-r001.dc1", ""]
)
gpu_rows = st.builds(
    GpuRow,
    node_id=label_text,
    hostname=label_text,
    uuid=label_text,
    status=st.sampled_from(["active", "missing"]),
    index=label_text,
    model=label_text,
    pci_bus_id=label_text,
    driver_version=label_text,
    telemetry=st.dictionaries(st.sampled_from([m.source for m in GPU_TELEMETRY]), facts).map(stored_facts),
    health_status=st.sampled_from(HEALTH_STATES),
    health_action=st.sampled_from(HEALTH_ACTIONS),
    health_reasons=st.lists(
        st.tuples(label_text, st.sampled_from(HEALTH_STATES), st.sampled_from(HEALTH_ACTIONS)), max_size=2
    ),
    health_signals=st.none()
    | st.builds(
        signals_of,
        st.fixed_dictionaries({spec.source: facts for spec in GPU_HEALTH_SIGNALS}),
        st.dictionaries(st.sampled_from(sorted(CLOCK_EVENT_REASONS)), facts),
    ),
    last_xid=st.none() | st.integers(0, 2**32 - 1),
)
node_rows = st.builds(
    NodeRow,
    node_id=label_text,
    hostname=label_text,
    liveness=st.sampled_from(["online", "stale", "offline", "local"]),
    inventory_status=st.sampled_from(["pending", "ok", "degraded", "failed"]),
    last_received_at=st.none() | st.datetimes(timezones=st.just(UTC)),
    telemetry=st.dictionaries(st.sampled_from(["memory_available_bytes", "memory_total_bytes"]), facts),
    storage=st.lists(st.tuples(label_text, facts, facts), max_size=2),
)
webhook_rows = st.builds(
    WebhookRow,
    subscription_id=label_text,
    state=st.sampled_from(["active", "failing"]),
    delivered=st.integers(0, 2**53),
    rejected=st.integers(0, 10**6),
    retried=st.integers(0, 10**6),
    attempts=st.integers(0, 100),
    last_delivered_at=st.none() | st.datetimes(timezones=st.just(UTC)),
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(
    nodes=st.lists(node_rows, max_size=3),
    gpus=st.lists(gpu_rows, max_size=3),
    counts=st.dictionaries(st.sampled_from(["active", "missing", "removed"]), st.integers(0, 10**6)),
    counters=st.fixed_dictionaries(
        {}, optional={"events": st.integers(0, 2**53), "refreshes": st.integers(0, 9)}
    ),
    head=st.integers(0, 2**40),
    behind=st.integers(-5, 5),
    webhooks=st.lists(webhook_rows, max_size=2),
    lag=st.none() | st.floats(0, 1e6, allow_nan=False),
)
def test_the_text_is_what_prometheus_clients_writer_makes_of_the_same_snapshot(
    nodes: list[NodeRow],
    gpus: list[GpuRow],
    counts: dict[str, int],
    counters: dict[str, int],
    head: int,
    behind: int,
    webhooks: list[WebhookRow],
    lag: float | None,
) -> None:
    snapshot = Snapshot(
        nodes=nodes,
        gpus=gpus,
        accelerator_counts=counts,
        head=head,
        folded=head - behind,
        counters=counters,
        webhooks=webhooks,
        replay_lag=lag,
    )
    assert render(snapshot) == reference_text(snapshot)


def test_a_fleet_without_lines_for_a_family_is_still_rendered_in_bounded_pieces(
    monkeypatch: Any,
) -> None:
    # A fleet whose GPUs send no health signals and no known metric gives most families no line
    # at all. The route lets the event loop run between pieces (agent reports, liveness probes);
    # pieces cut by lines alone made each such family one pass over every GPU with the loop held
    # (bench.api: a probe waited 1.2 s during a scrape of 80,000 GPUs).
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
