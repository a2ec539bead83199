"""The GPU health policy as data: a TOML document of rules (signal -> reason; XID counted in a
time window -> reason), validated into typed rules, identified by the SHA-256 of its text, and
evaluated purely (`evaluate(policy, signals, xids, now)` -> verdict and the XIDs that caused it).

The shipped default (domain/policies/default.toml) is the rule table docs/gpu-health.md
documents; docs/health-policy.md documents the format, how a policy comes into force and why a
verdict names the policy that decided it.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from importlib import resources
from typing import Literal, TypeAlias

import msgspec

from collectors.facts import Fact, Known
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from ledger.events import HealthAction, HealthReason, HealthStatus

STATUS_RANK: dict[str, int] = {"healthy": 0, "degraded": 1, "failed": 2}
ACTION_RANK: dict[str, int] = {"none": 0, "monitor": 1, "inspect_host": 2, "reset_gpu": 3, "service": 4}

# The ledger remembers a GPU's XIDs for this long (at most MAX_XID_COUNT of them), so a rule can
# count no further back and no more than that.
MAX_XID_WINDOW = timedelta(hours=24)
MAX_XID_COUNT = 64
# NVIDIA's XIDs are numbered from 1; the catalog ends in the low hundreds.
XID_RANGE = range(1, 1000)
POLICY_FORMAT = 1

SignalKind: TypeAlias = Literal["flag", "count", "increase"]

# Every signal a rule may name: how it is read from one collection's signals.
SIGNALS: dict[str, SignalKind] = {
    "row_remap_failure": "flag",
    "row_remap_pending": "flag",
    "page_retirement_pending": "flag",
    "clock_event_hw_slowdown": "flag",
    "clock_event_hw_thermal_slowdown": "flag",
    "clock_event_hw_power_brake_slowdown": "flag",
    "ecc_uncorrected_volatile": "count",
    "retired_pages": "count",
    # The lifetime uncorrected ECC count grew since the GPU's previous sample.
    "ecc_uncorrected_aggregate_increase": "increase",
}


class HealthVerdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    status: HealthStatus
    action: HealthAction
    reasons: list[HealthReason]


HEALTHY = HealthVerdict(status="healthy", action="none", reasons=[])


class SignalRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    signal: str
    status: HealthStatus
    action: HealthAction
    detail: str
    code: str = ""  # the reason code; the signal's name when empty
    at_least: int | None = None  # count signals only


class XidRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    xids: list[int]
    status: HealthStatus
    action: HealthAction
    detail: str
    count: int = 1
    window: str = "24h"
    code: str = ""  # the reason code; `xid_<codes>` when empty


class PolicyDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    name: str
    description: str = ""
    signal: list[SignalRule] = []
    xid: list[XidRule] = []


class CompiledXidRule(msgspec.Struct, frozen=True):
    codes: frozenset[int]
    count: int
    window: timedelta
    reason: HealthReason


class CompiledSignalRule(msgspec.Struct, frozen=True):
    signal: str
    at_least: int | None
    reason: HealthReason


class HealthPolicy(msgspec.Struct, frozen=True):
    """A validated policy: its exact text, the text's SHA-256 (what verdicts name) and its rules."""

    text: str
    digest: str
    document: PolicyDocument
    signal_rules: tuple[CompiledSignalRule, ...]
    xid_rules: tuple[CompiledXidRule, ...]

    @property
    def name(self) -> str:
        return self.document.name

    def signal_codes(self) -> dict[str, CompiledSignalRule]:
        return {r.reason.code: r for r in self.signal_rules}


class PolicyError(ValueError):
    """A policy document that cannot be in force: `where` names the line and the key path."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        self.message = message


_DURATION = re.compile(r"^([1-9][0-9]*|0)\s*(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_CODE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_PATH = re.compile(r"\$((?:\.\w+|\[\d+\])*)")


def parse_window(text: str) -> timedelta:
    """`90s`, `30m`, `1h`, `1d` -> a duration; ValueError otherwise."""
    m = _DURATION.match(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a duration such as 30m, 1h or 1d")
    return timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])


def _line_of(text: str, path: str) -> int | None:
    """The line of `path` (`xid[2].window`, `name`) in the TOML text, found by its table header
    and key; None where the document does not spell it plainly."""
    m = re.match(r"^(\w+)(?:\[(\d+)\])?(?:\.(\w+))?", path)
    if m is None:
        return None
    table, index, key = m.group(1), m.group(2), m.group(3)
    lines = text.splitlines()
    start, end = 0, len(lines)
    if index is not None:
        headers = [i for i, ln in enumerate(lines) if ln.strip() == f"[[{table}]]"]
        if int(index) >= len(headers):
            return None
        start = headers[int(index)]
        end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), end)
        if key is None:
            return start + 1
    else:
        end = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("[")), end)
        key = table
    for i in range(start, end):
        if re.match(rf"^\s*{re.escape(key)}\s*=", lines[i]):
            return i + 1
    return start + 1 if index is not None else None


def _where(text: str, path: str) -> str:
    line = _line_of(text, path)
    return f"line {line}: {path}" if line is not None else path


def _signal_rule(text: str, k: int, rule: SignalRule) -> CompiledSignalRule:
    path = f"signal[{k}]"
    kind = SIGNALS.get(rule.signal)
    if kind is None:
        raise PolicyError(
            _where(text, f"{path}.signal"), f"unknown signal {rule.signal!r} (one of {', '.join(SIGNALS)})"
        )
    if kind == "count":
        if rule.at_least is None or rule.at_least < 1:
            raise PolicyError(_where(text, f"{path}.at_least"), "a count signal needs at_least >= 1")
    elif rule.at_least is not None:
        raise PolicyError(_where(text, f"{path}.at_least"), f"{rule.signal} is not a count: no at_least")
    code = rule.code or rule.signal
    reason = HealthReason(code=code, status=rule.status, action=rule.action, detail=rule.detail)
    return CompiledSignalRule(signal=rule.signal, at_least=rule.at_least, reason=reason)


def _xid_rule(text: str, k: int, rule: XidRule) -> CompiledXidRule:
    path = f"xid[{k}]"
    if not rule.xids:
        raise PolicyError(_where(text, f"{path}.xids"), "names no XID")
    for xid in rule.xids:
        if xid not in XID_RANGE:
            raise PolicyError(
                _where(text, f"{path}.xids"),
                f"XID {xid} is out of range ({XID_RANGE.start}..{XID_RANGE.stop - 1})",
            )
    try:
        window = parse_window(rule.window)
    except ValueError as exc:
        raise PolicyError(_where(text, f"{path}.window"), str(exc)) from None
    if window <= timedelta(0):
        raise PolicyError(_where(text, f"{path}.window"), "must be positive")
    if window > MAX_XID_WINDOW:
        raise PolicyError(
            _where(text, f"{path}.window"), "at most 24h (the ledger remembers a GPU's XIDs for 24 hours)"
        )
    if not 1 <= rule.count <= MAX_XID_COUNT:
        raise PolicyError(_where(text, f"{path}.count"), f"must be 1..{MAX_XID_COUNT}")
    code = rule.code or "xid_" + "_".join(str(c) for c in sorted(set(rule.xids)))
    reason = HealthReason(code=code, status=rule.status, action=rule.action, detail=rule.detail)
    return CompiledXidRule(codes=frozenset(rule.xids), count=rule.count, window=window, reason=reason)


def load_policy(text: str) -> HealthPolicy:
    """Validate a policy document (TOML); PolicyError names the line and key of the first fault."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError("", f"not TOML: {exc}") from None
    try:
        doc = msgspec.convert(raw, PolicyDocument)
    except msgspec.ValidationError as exc:
        message = str(exc)
        m = _PATH.search(message)
        path = m.group(1).lstrip(".") if m else ""
        message = message.split(" - at `")[0]
        if message.startswith("Object missing required field"):
            field = message.split("`")[1]
            path = f"{path}.{field}" if path else field
            message = "required"
        elif message.startswith("Object contains unknown field"):
            field = message.split("`")[1]
            path = f"{path}.{field}" if path else field
            message = "unknown key"
        elif message.startswith("Invalid enum value"):
            choices = STATUS_RANK if path.endswith(".status") else ACTION_RANK
            message += f" (one of {', '.join(choices)})"
        return _raise(text, path, message[:1].lower() + message[1:])
    if doc.version != POLICY_FORMAT:
        raise PolicyError(_where(text, "version"), f"this release reads policy format {POLICY_FORMAT}")
    if not doc.name.strip():
        raise PolicyError(_where(text, "name"), "must not be empty")
    signal_rules = tuple(_signal_rule(text, k, r) for k, r in enumerate(doc.signal))
    xid_rules = tuple(_xid_rule(text, k, r) for k, r in enumerate(doc.xid))
    seen: set[str] = set()
    for path, reason in [
        *((f"signal[{k}].code", r.reason) for k, r in enumerate(signal_rules)),
        *((f"xid[{k}].code", r.reason) for k, r in enumerate(xid_rules)),
    ]:
        if not _CODE.match(reason.code):
            raise PolicyError(_where(text, path), f"{reason.code!r} is not a reason code (a-z, 0-9, _)")
        if reason.code in seen:
            raise PolicyError(_where(text, path), f"reason code {reason.code!r} is used twice")
        seen.add(reason.code)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return HealthPolicy(
        text=text, digest=digest, document=doc, signal_rules=signal_rules, xid_rules=xid_rules
    )


def _raise(text: str, path: str, message: str) -> HealthPolicy:
    raise PolicyError(_where(text, path) if path else "", message)


DEFAULT_POLICY_TEXT = resources.files("domain").joinpath("policies/default.toml").read_text(encoding="utf-8")
DEFAULT_POLICY = load_policy(DEFAULT_POLICY_TEXT)


def _known_int(fact: Fact | None) -> int | None:
    if isinstance(fact, Known) and isinstance(fact.value, int) and not isinstance(fact.value, bool):
        return fact.value
    return None


def _flag(signals: AcceleratorHealthSignals, signal: str) -> bool:
    match signal:
        case "row_remap_failure":
            fact = signals.remapped_rows.get("failure")
        case "row_remap_pending":
            fact = signals.remapped_rows.get("pending")
        case "page_retirement_pending":
            fact = signals.retired_pages.get("pending")
        case _:
            fact = signals.clock_event_reasons.get(signal.removeprefix("clock_event_"))
    return isinstance(fact, Known) and fact.value is True


def _count(signals: AcceleratorHealthSignals, signal: str) -> int:
    if signal == "ecc_uncorrected_volatile":
        return _known_int(signals.ecc_errors.get("uncorrected_volatile")) or 0
    pages = signals.retired_pages
    return (_known_int(pages.get("single_bit")) or 0) + (_known_int(pages.get("double_bit")) or 0)


def _holds(
    rule: CompiledSignalRule, signals: AcceleratorHealthSignals, previous: AcceleratorHealthSignals | None
) -> bool:
    kind = SIGNALS[rule.signal]
    if kind == "flag":
        return _flag(signals, rule.signal)
    if kind == "count":
        return rule.at_least is not None and _count(signals, rule.signal) >= rule.at_least
    now = _known_int(signals.ecc_errors.get("uncorrected_aggregate"))
    before = None if previous is None else _known_int(previous.ecc_errors.get("uncorrected_aggregate"))
    return now is not None and before is not None and now > before


def verdict_of(reasons: Sequence[HealthReason]) -> HealthVerdict:
    if not reasons:
        return HEALTHY
    status = max((r.status for r in reasons), key=STATUS_RANK.__getitem__)
    action = max((r.action for r in reasons), key=ACTION_RANK.__getitem__)
    return HealthVerdict(status=status, action=action, reasons=list(reasons))


def signal_reasons(
    policy: HealthPolicy,
    signals: AcceleratorHealthSignals | None,
    previous: AcceleratorHealthSignals | None = None,
) -> list[HealthReason]:
    """The reasons the policy's signal rules give one collection's signals (known facts only)."""
    if signals is None:
        return []
    return [r.reason for r in policy.signal_rules if _holds(r, signals, previous)]


_BY_CODE: dict[str, dict[int, tuple[int, ...]]] = {}


def _rules_by_code(policy: HealthPolicy) -> dict[int, tuple[int, ...]]:
    """XID code -> the indexes of the policy's rules that count it (cached per digest)."""
    index = _BY_CODE.get(policy.digest)
    if index is None:
        found: dict[int, list[int]] = {}
        for k, rule in enumerate(policy.xid_rules):
            for code in rule.codes:
                found.setdefault(code, []).append(k)
        index = _BY_CODE[policy.digest] = {c: tuple(ks) for c, ks in found.items()}
    return index


def xid_reasons(
    policy: HealthPolicy, xids: Iterable[XidOccurrence], now: datetime
) -> tuple[list[HealthReason], list[XidOccurrence]]:
    """The reasons the policy's XID rules give at `now`, and the occurrences that fired them."""
    remembered = list(xids)
    reasons: list[HealthReason] = []
    evidence: list[XidOccurrence] = []
    if not remembered:
        return reasons, evidence
    index = _rules_by_code(policy)
    chosen = sorted({k for x in remembered for k in index.get(x.code, ())})
    for rule in (policy.xid_rules[k] for k in chosen):
        counted = [x for x in remembered if x.code in rule.codes and now - rule.window < x.at <= now]
        if len(counted) >= rule.count:
            reasons.append(rule.reason)
            evidence.extend(x for x in counted if x not in evidence)
    return reasons, evidence


def evaluate(
    policy: HealthPolicy,
    signals: AcceleratorHealthSignals | None,
    xids: Iterable[XidOccurrence],
    now: datetime,
    previous: AcceleratorHealthSignals | None = None,
) -> tuple[HealthVerdict, list[XidOccurrence]]:
    """The verdict at `now` from one collection's signals (and the previous collection's, for
    increases) and the XIDs the ledger remembers; with the XIDs that fired its reasons."""
    reasons, evidence = xid_reasons(policy, xids, now)
    return verdict_of([*signal_reasons(policy, signals, previous), *reasons]), evidence
