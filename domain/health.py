"""The GPU health rule table: signals -> verdict (`healthy` | `degraded` | `failed`), reasons and
a recommended action. Pure: no I/O, no clock; docs/gpu-health.md documents the same table.

Rules fire on `known` facts only: an `unsupported` (consumer GPU without ECC), `unknown` or failed
signal never degrades a GPU. A reason's `code` and `detail` are fixed per rule, never a count, so
a counter that grows under an unchanged verdict is telemetry and makes no audit event.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

import msgspec

from collectors.facts import Fact, Known
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from ledger.events import HealthAction, HealthReason, HealthStatus

_STATUS_RANK: dict[str, int] = {"healthy": 0, "degraded": 1, "failed": 2}
_ACTION_RANK: dict[str, int] = {"none": 0, "monitor": 1, "inspect_host": 2, "reset_gpu": 3, "service": 4}

# An XID counts towards the verdict for this long after it was drained; then the GPU is judged by
# its other signals again (an operator who reset or serviced it need not clear anything).
XID_WINDOW = timedelta(hours=24)
# NVIDIA retires at most 64 pages per GPU before Ampere; a GPU that reached it needs service.
RETIRED_PAGES_LIMIT = 64


class HealthVerdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    status: HealthStatus
    action: HealthAction
    reasons: list[HealthReason]


HEALTHY = HealthVerdict(status="healthy", action="none", reasons=[])


# code -> (status, action, detail). XIDs not listed (application faults such as 13, 31, 43, 45)
# are recorded but do not change the verdict: they say more about a program than about the GPU.
XID_RULES: dict[int, tuple[HealthStatus, HealthAction, str]] = {
    48: ("degraded", "reset_gpu", "XID 48: double-bit ECC error"),
    61: ("degraded", "reset_gpu", "XID 61: internal micro-controller breakpoint/warning"),
    62: ("degraded", "reset_gpu", "XID 62: internal micro-controller halt"),
    63: ("degraded", "reset_gpu", "XID 63: ECC page retirement or row remapping recorded"),
    64: ("failed", "service", "XID 64: ECC page retirement or row remapping failure"),
    74: ("degraded", "reset_gpu", "XID 74: NVLink error"),
    79: ("failed", "service", "XID 79: GPU has fallen off the bus"),
    92: ("degraded", "monitor", "XID 92: high single-bit ECC error rate"),
    94: ("degraded", "reset_gpu", "XID 94: contained ECC error"),
    95: ("failed", "reset_gpu", "XID 95: uncontained ECC error"),
    119: ("degraded", "reset_gpu", "XID 119: GSP RPC timeout"),
    120: ("degraded", "reset_gpu", "XID 120: GSP error"),
}

# Clock event reasons that point at the hardware (cooling, power delivery); software caps, idle,
# application clocks and sync boost are normal operation.
CLOCK_RULES: dict[str, tuple[HealthStatus, HealthAction, str]] = {
    "hw_slowdown": ("degraded", "inspect_host", "hardware slowdown active (thermal or power)"),
    "hw_thermal_slowdown": ("degraded", "inspect_host", "hardware thermal slowdown active: check cooling"),
    "hw_power_brake_slowdown": (
        "degraded",
        "inspect_host",
        "hardware power brake active: check the power supply",
    ),
}


def _true(fact: Fact | None) -> bool:
    return isinstance(fact, Known) and fact.value is True


def _positive(fact: Fact | None) -> bool:
    return (
        isinstance(fact, Known)
        and isinstance(fact.value, int)
        and not isinstance(fact.value, bool)
        and fact.value > 0
    )


def _count(fact: Fact | None) -> int:
    if isinstance(fact, Known) and isinstance(fact.value, int) and not isinstance(fact.value, bool):
        return fact.value
    return 0


def _reason(code: str, rule: tuple[HealthStatus, HealthAction, str]) -> HealthReason:
    status, action, detail = rule
    return HealthReason(code=code, status=status, action=action, detail=detail)


def recent_xids(xids: Iterable[XidOccurrence], now: datetime) -> list[XidOccurrence]:
    """The XIDs that still count at `now` (within XID_WINDOW, not in the future of it)."""
    return [x for x in xids if now - XID_WINDOW < x.at <= now]


def judge(signals: AcceleratorHealthSignals | None, xids: Iterable[XidOccurrence] = ()) -> HealthVerdict:
    """The verdict from one collection's signals and the XIDs that still count."""
    reasons: list[HealthReason] = []
    if signals is not None:
        rows = signals.remapped_rows
        if _true(rows.get("failure")):
            reasons.append(_reason("row_remap_failure", ("failed", "service", "row remapping failed")))
        if _true(rows.get("pending")):
            reasons.append(
                _reason(
                    "row_remap_pending", ("degraded", "reset_gpu", "row remapping pending: reset the GPU")
                )
            )
        if _positive(signals.ecc_errors.get("uncorrected_volatile")):
            reasons.append(
                _reason(
                    "ecc_uncorrected",
                    ("failed", "service", "uncorrectable ECC errors since the last driver load"),
                )
            )
        pages = signals.retired_pages
        if _true(pages.get("pending")):
            reasons.append(
                _reason(
                    "page_retirement_pending",
                    ("degraded", "reset_gpu", "page retirement pending: reset the GPU"),
                )
            )
        if _count(pages.get("single_bit")) + _count(pages.get("double_bit")) >= RETIRED_PAGES_LIMIT:
            reasons.append(
                _reason(
                    "retired_pages_limit",
                    ("failed", "service", f"{RETIRED_PAGES_LIMIT} or more pages retired"),
                )
            )
        for name, rule in CLOCK_RULES.items():
            if _true(signals.clock_event_reasons.get(name)):
                reasons.append(_reason(f"clock_event_{name}", rule))
    for code in sorted({x.code for x in xids}):
        xid_rule = XID_RULES.get(code)
        if xid_rule is not None:
            reasons.append(_reason(f"xid_{code}", xid_rule))
    if not reasons:
        return HEALTHY
    status = max((r.status for r in reasons), key=_STATUS_RANK.__getitem__)
    action = max((r.action for r in reasons), key=_ACTION_RANK.__getitem__)
    return HealthVerdict(status=status, action=action, reasons=reasons)
