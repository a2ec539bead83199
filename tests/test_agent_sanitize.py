"""The agent's check and repair of an observation before it sends it (agent/sanitize.py): a GPU's
health signals survive the repair, and a health reading outside the contract costs that one fact,
never the report."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.protocol import PROTOCOL_VERSION, Report, decode_report, encode_report
from agent.sanitize import sanitize_observation, validate_observation
from collectors.facts import UNSUPPORTED, Fact, Known, TemporarilyFailed
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.observations import HardwareObservation
from tests.builders import T0, gpu, observation, pending_remap, scan, signals, with_health


def _with_broken_host_reading(obs: HardwareObservation) -> HardwareObservation:
    """A confused sensor elsewhere in the observation, so that sanitising rebuilds it."""
    h = msgspec.structs.replace(obs.host, telemetry={"memory_available_bytes": Known(-3)})
    return msgspec.structs.replace(obs, host=h)


def _sent(obs: HardwareObservation) -> Report:
    """What the server decodes from the report the agent would send."""
    report = Report(
        protocol=PROTOCOL_VERSION,
        node_id="node",
        identity_key="key",
        identity_source="configured",
        stream="inventory",
        sequence=1,
        observed_at=obs.observed_at,
        observation=obs,
    )
    return decode_report(encode_report(report))


def test_a_gpu_s_health_signals_survive_sanitising() -> None:
    remapping = pending_remap(xids=[XidOccurrence(code=79, at=T0)])
    healthy = signals()
    nvml = msgspec.structs.replace(
        scan([with_health(gpu(0), remapping), with_health(gpu(1), healthy)]),
        unlisted_xids={"GPU-gone": [XidOccurrence(code=79, at=T0)]},
    )
    broken = _with_broken_host_reading(observation(nvml=nvml))
    assert validate_observation(broken)  # something to repair, so the observation is rebuilt

    fixed = sanitize_observation(broken)
    assert validate_observation(fixed) == []
    assert isinstance(fixed.host.telemetry["memory_available_bytes"], TemporarilyFailed)
    assert [a.health for a in fixed.nvml.accelerators] == [remapping, healthy]
    assert fixed.nvml.unlisted_xids == nvml.unlisted_xids
    assert [a.health for a in _sent(fixed).observation.nvml.accelerators] == [remapping, healthy]


def test_a_health_reading_outside_the_contract_costs_that_fact_not_the_report() -> None:
    good_xid = XidOccurrence(code=48, at=T0)
    health = signals(
        ecc_errors={"uncorrected_volatile": Known(2**64 - 1), "corrected_volatile": Known(5)},
        clock_event_reasons={"gpu_idle": Known(1), "hw_slowdown": Known(False)},
        ecc_mode=Known("Enabled"),
        pcie_replay_count=TemporarilyFailed("NVML said\x00nothing"),
        xids=[
            XidOccurrence(code=2**40, at=T0),
            XidOccurrence(code=79, at=datetime(1990, 1, 1, tzinfo=UTC)),
            good_xid,
        ],
    )
    nvml = msgspec.structs.replace(
        scan([with_health(gpu(0), health)]),
        unlisted_xids={"GPU-gone": [XidOccurrence(code=79, at=datetime(1990, 1, 1, tzinfo=UTC)), good_xid]},
    )
    obs = observation(nvml=nvml)
    errors = validate_observation(obs)
    where = "nvml.accelerators['GPU-00000000-0000-4000-8000-000000000000'].health"
    for expected in (
        f"{where}.ecc_errors.'uncorrected_volatile'",
        f"{where}.clock_event_reasons.'gpu_idle'",
        f"{where}.ecc_mode",
        f"{where}.pcie_replay_count",
        f"{where}.xids",
        "nvml.unlisted_xids['GPU-gone']",
    ):
        assert any(e.startswith(expected) for e in errors), (expected, errors)

    fixed = sanitize_observation(obs)
    assert validate_observation(fixed) == []
    repaired = fixed.nvml.accelerators[0].health
    assert repaired is not None
    assert isinstance(repaired.ecc_errors["uncorrected_volatile"], TemporarilyFailed)
    assert repaired.ecc_errors["corrected_volatile"] == Known(5)
    assert isinstance(repaired.clock_event_reasons["gpu_idle"], TemporarilyFailed)
    assert repaired.clock_event_reasons["hw_slowdown"] == Known(False)
    assert isinstance(repaired.ecc_mode, TemporarilyFailed)
    assert repaired.pcie_replay_count == TemporarilyFailed("NVML said\ufffdnothing")
    assert repaired.remapped_rows == health.remapped_rows
    assert repaired.xids == [good_xid]
    assert fixed.nvml.unlisted_xids == {"GPU-gone": [good_xid]}
    # ...and the server takes the report the agent sends.
    assert _sent(fixed).observation == fixed


not_known: st.SearchStrategy[Fact] = st.sampled_from([UNSUPPORTED, TemporarilyFailed("not now")])
counts: st.SearchStrategy[Fact] = st.one_of(st.integers(0, 2**63 - 1).map(Known), not_known)
flags: st.SearchStrategy[Fact] = st.one_of(st.booleans().map(Known), not_known)


@st.composite
def health_signals(draw: st.DrawFn) -> AcceleratorHealthSignals:
    def group(names: tuple[str, ...], values: st.SearchStrategy[Fact]) -> dict[str, Fact]:
        return {n: draw(values) for n in names}

    return AcceleratorHealthSignals(
        clock_event_reasons=group(("gpu_idle", "sw_power_cap", "hw_slowdown"), flags),
        ecc_mode=draw(st.one_of(st.sampled_from(["enabled", "disabled"]).map(Known), not_known)),
        ecc_errors=group(("corrected_volatile", "uncorrected_volatile"), counts),
        remapped_rows=group(("correctable", "uncorrectable"), counts) | group(("pending", "failure"), flags),
        retired_pages=group(("single_bit", "double_bit"), counts) | group(("pending",), flags),
        pcie_replay_count=draw(counts),
        xid_events=draw(flags),
        xids=[
            XidOccurrence(code=code, at=T0) for code in draw(st.lists(st.integers(0, 2**32 - 1), max_size=5))
        ],
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(health_signals(), min_size=1, max_size=3))
def test_any_health_within_the_contract_is_sent_as_it_was_collected(
    healths: list[AcceleratorHealthSignals],
) -> None:
    gpus = [with_health(gpu(n), h) for n, h in enumerate(healths)]
    obs = observation(nvml=scan(gpus))
    assert validate_observation(obs) == []
    assert sanitize_observation(obs) is obs
    fixed = sanitize_observation(_with_broken_host_reading(obs))
    assert [a.health for a in fixed.nvml.accelerators] == healths
