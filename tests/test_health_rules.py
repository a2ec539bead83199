"""The GPU health rule table (domain/health.py): pure, property-tested."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st

from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from collectors.gpu_health import (
    CLOCK_EVENT_REASONS,
    ECC_COUNTERS,
    REMAPPED_ROWS,
    RETIRED_PAGES,
    AcceleratorHealthSignals,
    XidOccurrence,
)
from domain.health import HEALTHY, XID_RULES, XID_WINDOW, judge, recent_xids
from tests.builders import T0

RANK = {"healthy": 0, "degraded": 1, "failed": 2}

not_known = st.sampled_from([UNSUPPORTED, UNKNOWN, TemporarilyFailed("x"), Unavailable("y")])
counts = st.one_of(not_known, st.builds(Known, st.integers(0, 200)))
flags = st.one_of(not_known, st.builds(Known, st.booleans()))


def clean(**changes: object) -> AcceleratorHealthSignals:
    base = AcceleratorHealthSignals(
        clock_event_reasons={n: Known(False) for n in CLOCK_EVENT_REASONS},
        ecc_mode=Known("enabled"),
        ecc_errors={n: Known(0) for n in ECC_COUNTERS},
        remapped_rows={
            "correctable": Known(0),
            "uncorrectable": Known(0),
            "pending": Known(False),
            "failure": Known(False),
        },
        retired_pages={"single_bit": Known(0), "double_bit": Known(0), "pending": Known(False)},
        pcie_replay_count=Known(0),
        xid_events=Known(True),
    )
    return AcceleratorHealthSignals(**{**{f: getattr(base, f) for f in base.__struct_fields__}, **changes})  # type: ignore[arg-type]


signals = st.builds(
    AcceleratorHealthSignals,
    clock_event_reasons=st.fixed_dictionaries({n: flags for n in CLOCK_EVENT_REASONS}),
    ecc_mode=st.one_of(not_known, st.sampled_from([Known("enabled"), Known("disabled")])),
    ecc_errors=st.fixed_dictionaries({n: counts for n in ECC_COUNTERS}),
    remapped_rows=st.fixed_dictionaries(
        {"correctable": counts, "uncorrectable": counts, "pending": flags, "failure": flags}
    ),
    retired_pages=st.fixed_dictionaries({"single_bit": counts, "double_bit": counts, "pending": flags}),
    pcie_replay_count=counts,
    xid_events=st.just(Known(True)),
)
xids = st.lists(
    st.builds(
        XidOccurrence, code=st.sampled_from([13, 31, 48, 63, 64, 79, 92, 95, 119, 999]), at=st.just(T0)
    ),
    max_size=4,
)


def unsupported_everywhere() -> AcceleratorHealthSignals:
    return AcceleratorHealthSignals(
        clock_event_reasons=dict.fromkeys(CLOCK_EVENT_REASONS, UNSUPPORTED),
        ecc_mode=UNSUPPORTED,
        ecc_errors=dict.fromkeys(ECC_COUNTERS, UNSUPPORTED),
        remapped_rows=dict.fromkeys(REMAPPED_ROWS, UNSUPPORTED),
        retired_pages=dict.fromkeys(RETIRED_PAGES, UNSUPPORTED),
        pcie_replay_count=UNSUPPORTED,
        xid_events=UNSUPPORTED,
    )


@given(st.sampled_from([UNSUPPORTED, UNKNOWN, TemporarilyFailed("lost"), Unavailable("no permission")]))
def test_signals_that_are_not_known_never_degrade(fact: Fact) -> None:
    s = unsupported_everywhere()
    s = AcceleratorHealthSignals(
        clock_event_reasons=dict.fromkeys(CLOCK_EVENT_REASONS, fact),
        ecc_mode=fact,
        ecc_errors=dict.fromkeys(ECC_COUNTERS, fact),
        remapped_rows=dict.fromkeys(REMAPPED_ROWS, fact),
        retired_pages=dict.fromkeys(RETIRED_PAGES, fact),
        pcie_replay_count=fact,
        xid_events=fact,
    )
    assert judge(s) == HEALTHY
    assert judge(None) == HEALTHY


@given(signals, xids)
def test_the_verdict_is_the_worst_reason_and_every_reason_names_an_action(
    s: AcceleratorHealthSignals, occurred: list[XidOccurrence]
) -> None:
    v = judge(s, occurred)
    if not v.reasons:
        assert v == HEALTHY
    else:
        assert v.status == max((r.status for r in v.reasons), key=RANK.__getitem__)
        assert v.status != "healthy" and v.action != "none"
        assert len({r.code for r in v.reasons}) == len(v.reasons)
    assert judge(s, occurred) == v  # pure


@given(signals, xids, st.sampled_from(sorted(XID_RULES)))
def test_an_extra_problem_never_makes_a_gpu_look_better(
    s: AcceleratorHealthSignals, occurred: list[XidOccurrence], code: int
) -> None:
    worse = judge(s, [*occurred, XidOccurrence(code=code, at=T0)])
    assert RANK[worse.status] >= RANK[judge(s, occurred).status]


@given(signals)
def test_growing_counters_alone_do_not_change_the_verdict(s: AcceleratorHealthSignals) -> None:
    grown = AcceleratorHealthSignals(
        **{
            **{f: getattr(s, f) for f in s.__struct_fields__},
            "pcie_replay_count": Known(10_000),
            "ecc_errors": {
                **s.ecc_errors,
                "corrected_volatile": Known(999),
                "corrected_aggregate": Known(999),
            },
        }
    )
    assert judge(grown) == judge(s)


def test_the_table() -> None:
    pending = judge(clean(remapped_rows={**clean().remapped_rows, "pending": Known(True)}))
    assert (pending.status, pending.action, [r.code for r in pending.reasons]) == (
        "degraded",
        "reset_gpu",
        ["row_remap_pending"],
    )
    failure = judge(
        clean(remapped_rows={**clean().remapped_rows, "failure": Known(True), "pending": Known(True)})
    )
    assert (failure.status, failure.action) == ("failed", "service")
    ecc = judge(clean(ecc_errors={**clean().ecc_errors, "uncorrected_volatile": Known(1)}))
    assert (ecc.status, ecc.action, ecc.reasons[0].code) == ("failed", "service", "ecc_uncorrected")
    # Historical uncorrected errors (aggregate only) and corrected ones do not fail a GPU.
    assert judge(clean(ecc_errors={**clean().ecc_errors, "uncorrected_aggregate": Known(1)})) == HEALTHY
    thermal = judge(
        clean(clock_event_reasons={**clean().clock_event_reasons, "hw_thermal_slowdown": Known(True)})
    )
    assert (thermal.status, thermal.action) == ("degraded", "inspect_host")
    assert (
        judge(clean(clock_event_reasons={**clean().clock_event_reasons, "sw_power_cap": Known(True)}))
        == HEALTHY
    )
    retired = judge(
        clean(retired_pages={"single_bit": Known(60), "double_bit": Known(4), "pending": Known(False)})
    )
    assert retired.status == "failed"
    assert (
        judge(
            clean(retired_pages={"single_bit": Known(1), "double_bit": Known(0), "pending": Known(True)})
        ).status
        == "degraded"
    )
    bus = judge(clean(), [XidOccurrence(code=79, at=T0)])
    assert (bus.status, bus.action, bus.reasons[0].code) == ("failed", "service", "xid_79")
    # An application's fault (XID 13, 31, 43, 45) is recorded but says nothing of the GPU.
    assert judge(clean(), [XidOccurrence(code=13, at=T0), XidOccurrence(code=31, at=T0)]) == HEALTHY


def test_an_xid_counts_for_its_window_only() -> None:
    x = XidOccurrence(code=79, at=T0)
    assert recent_xids([x], T0) == [x]
    assert recent_xids([x], T0 + XID_WINDOW - timedelta(seconds=1)) == [x]
    assert recent_xids([x], T0 + XID_WINDOW) == []
