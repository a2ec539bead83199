"""The shipped GPU health rule table (domain/policies/default.toml, evaluated by
domain/health_policy.py): signals -> verdict (`healthy` | `degraded` | `failed`), reasons and a
recommended action. Pure: no I/O, no clock; docs/gpu-health.md documents the same table.

Rules fire on `known` facts only: an `unsupported` (consumer GPU without ECC), `unknown` or failed
signal never degrades a GPU. A reason's `code` and `detail` are fixed per rule, never a count, so
a counter that grows under an unchanged verdict is telemetry and makes no audit event.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from domain.health_policy import DEFAULT_POLICY, HEALTHY, HealthVerdict, signal_reasons, verdict_of
from ledger.events import HealthAction, HealthStatus

__all__ = ["HEALTHY", "HealthVerdict", "judge", "recent_xids"]

# An XID counts towards the verdict of the shipped policy for this long after it was drained;
# then the GPU is judged by its other signals again (an operator who reset or serviced it need not
# clear anything).
XID_WINDOW = timedelta(hours=24)
# NVIDIA retires at most 64 pages per GPU before Ampere; a GPU that reached it needs service.
RETIRED_PAGES_LIMIT = 64

# The shipped policy's XID rules, code -> (status, action, detail). XIDs not listed (application
# faults such as 13, 31, 43, 45) are recorded but do not change the verdict.
XID_RULES: dict[int, tuple[HealthStatus, HealthAction, str]] = {
    code: (r.reason.status, r.reason.action, r.reason.detail)
    for r in DEFAULT_POLICY.xid_rules
    for code in r.codes
}

# Clock event reasons that point at the hardware (cooling, power delivery); software caps, idle,
# application clocks and sync boost are normal operation.
CLOCK_RULES: dict[str, tuple[HealthStatus, HealthAction, str]] = {
    r.signal.removeprefix("clock_event_"): (r.reason.status, r.reason.action, r.reason.detail)
    for r in DEFAULT_POLICY.signal_rules
    if r.signal.startswith("clock_event_")
}


def recent_xids(xids: Iterable[XidOccurrence], now: datetime) -> list[XidOccurrence]:
    """The XIDs that still count at `now` (within XID_WINDOW, not in the future of it)."""
    return [x for x in xids if now - XID_WINDOW < x.at <= now]


def judge(signals: AcceleratorHealthSignals | None, xids: Iterable[XidOccurrence] = ()) -> HealthVerdict:
    """The shipped policy's verdict from one collection's signals and the XIDs that still count."""
    counted = [x.code for x in xids]
    reasons = signal_reasons(DEFAULT_POLICY, signals)
    reasons.extend(
        r.reason for r in DEFAULT_POLICY.xid_rules if sum(c in r.codes for c in counted) >= r.count
    )
    return verdict_of(reasons)
