"""Read-model values as sample values: a fact is a sample only when it is known and of its
metric's kind; anything else is absent (no series), never 0."""

from __future__ import annotations

from typing import Any

from api.services.metrics.catalog import MetricSpec
from api.services.reads.facts import stored_fact
from collectors.facts import Known
from collectors.gpu_health import CLOCK_EVENT_REASONS


def known_text(raw: Any) -> str:
    """A fact's value as a label: the empty string when it is not known."""
    if raw is None:
        return ""
    fact = stored_fact(raw)
    return str(fact.value) if isinstance(fact, Known) else ""


def sample_value(raw: Any) -> float | None:
    """A telemetry fact as a sample value, or None (absent) unless known and numeric.

    A boolean or text in a numeric metric is garbage, not a number: absent, never 1 or 0.
    """
    if raw is None:
        return None
    fact = stored_fact(raw)
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


def signal_value(signals: dict[str, Any] | None, spec: MetricSpec) -> float | None:
    """A health signal as a sample value, or None (absent) unless known and of its kind: a count
    (an integer) or, for a flag, a boolean as 1/0. Unsupported is absent, never 0."""
    if not signals:
        return None
    group, _, name = spec.source.removeprefix("health.").partition(".")
    raw = signals.get(group)
    if name:
        raw = raw.get(name) if isinstance(raw, dict) else None
    if raw is None:
        return None
    fact = stored_fact(raw)
    if not isinstance(fact, Known):
        return None
    value = fact.value
    if spec.flag:
        return float(value) if isinstance(value, bool) else None
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else None


def clock_event_mask(signals: dict[str, Any] | None) -> int | None:
    """NVML's clock event reasons bitmask (as DCGM reports it), rebuilt from the per-reason
    facts; None unless every reason is a known boolean, since a partial mask would read as
    'not throttled' for the reasons it lacks."""
    reasons = (signals or {}).get("clock_event_reasons")
    if not isinstance(reasons, dict):
        return None
    mask = 0
    for name, bit in CLOCK_EVENT_REASONS.items():
        raw = reasons.get(name)
        fact = None if raw is None else stored_fact(raw)
        if not isinstance(fact, Known) or not isinstance(fact.value, bool):
            return None
        mask |= bit if fact.value else 0
    return mask
