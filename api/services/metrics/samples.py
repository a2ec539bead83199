"""Read-model values and decoded samples as sample values: a fact is a sample only when it is
known and of its metric's kind; anything else is absent (no series), never 0.

A node's telemetry and storage come from the read models in the stored (jsonb) form; a GPU's
sample and health signals come decoded from the event that holds them (api.services.reads.samples)
and are read as they are, without a round trip through the stored form."""

from __future__ import annotations

from typing import Any

from api.services.metrics.catalog import MetricSpec
from api.services.reads.facts import stored_fact
from collectors.facts import Fact, Known
from collectors.gpu_health import CLOCK_EVENT_REASONS, AcceleratorHealthSignals


def known_text(raw: Any) -> str:
    """A stored fact's value as a label: the empty string when it is not known."""
    if raw is None:
        return ""
    fact = stored_fact(raw)
    return str(fact.value) if isinstance(fact, Known) else ""


def fact_value(fact: Fact | None) -> float | None:
    """A telemetry fact as a sample value, or None (absent) unless known and numeric.

    A boolean or text in a numeric metric is garbage, not a number: absent, never 1 or 0.
    """
    if not isinstance(fact, Known):
        return None
    value = fact.value
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value[:1] == "P" and value[1:].isdigit():
        return float(value[1:])
    return None


def sample_value(raw: Any) -> float | None:
    """A stored telemetry fact (a node's) as a sample value, as `fact_value` judges it."""
    return None if raw is None else fact_value(stored_fact(raw))


def signal_value(signals: AcceleratorHealthSignals | None, spec: MetricSpec) -> float | None:
    """A health signal as a sample value, or None (absent) unless known and of its kind: a count
    (an integer) or, for a flag, a boolean as 1/0. Unsupported is absent, never 0."""
    if signals is None:
        return None
    group, _, name = spec.source.removeprefix("health.").partition(".")
    fact = getattr(signals, group, None)
    if name:
        fact = fact.get(name) if isinstance(fact, dict) else None
    if not isinstance(fact, Known):
        return None
    value = fact.value
    if spec.flag:
        return float(value) if isinstance(value, bool) else None
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else None


def clock_event_mask(signals: AcceleratorHealthSignals | None) -> int | None:
    """NVML's clock event reasons bitmask (as DCGM reports it), rebuilt from the per-reason
    facts; None unless every reason is a known boolean, since a partial mask would read as
    'not throttled' for the reasons it lacks."""
    if signals is None:
        return None
    reasons = signals.clock_event_reasons
    mask = 0
    for name, bit in CLOCK_EVENT_REASONS.items():
        fact = reasons.get(name)
        if not isinstance(fact, Known) or not isinstance(fact.value, bool):
            return None
        mask |= bit if fact.value else 0
    return mask
