"""Hypothesis strategies and builders shared by the /metrics tests: stored facts of every state,
and health signals as a sample's event decodes them."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from api.services.reads.facts import stored_fact, stored_facts
from collectors.facts import Unsupported
from collectors.gpu_health import AcceleratorHealthSignals

facts = st.one_of(
    st.builds(lambda v: {"state": "known", "value": v}, st.integers(0, 10**12)),
    st.builds(lambda v: {"state": "known", "value": v}, st.floats(0, 1e6, allow_nan=False)),
    st.builds(lambda v: {"state": "known", "value": v}, st.booleans() | st.just("abc")),
    st.just({"state": "unsupported"}),
    st.just({"state": "unknown"}),
    st.builds(lambda r: {"state": "unavailable", "reason": r}, st.text(max_size=5)),
    st.builds(lambda r: {"state": "temporarily_failed", "reason": r}, st.text(max_size=5)),
)


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
