"""How facts and events read to an operator, alike in the web console and on the command line: a
fact's label ("Fan speed", "ECC: uncorrected (volatile)", "Clock event: HW thermal slowdown"), a
known value with its unit ("72 °C", "22.6 GiB"), a state that is not a value in words ("not
supported"), the health signals in nvidia-smi's order, what an event says ("discovered NVIDIA
H200 at index 3, PCI ...") and whose stream it is on, and what an XID means. The API name
(`fan_speed_percent`, `ecc_errors.uncorrected_volatile`) stays where a reader can find it: the
console's tooltip and `data-metric`, the command line's `-o json`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

import msgspec

from api.services.reads.bodies import HealthSignalsBody
from collectors.facts import Fact, Known, TemporarilyFailed, Unavailable, Unknown, Unsupported
from collectors.gpu_health import CLOCK_EVENT_REASONS, ECC_COUNTERS, REMAPPED_ROWS, RETIRED_PAGES
from domain.health import XID_RULES
from ledger.events import (
    DECOMMISSION_AUDIT_STREAM_PREFIX,
    ENROLLMENT_TOKEN_STREAM_PREFIX,
    is_decommission_audit_stream,
    is_enrollment_token_stream,
    is_health_policy_stream,
    is_webhook_stream,
)


class _HasIndex(Protocol):
    @property
    def index(self) -> object: ...
    @property
    def uuid(self) -> str: ...


_Gpu = TypeVar("_Gpu", bound=_HasIndex)

# Units are named by the value's rendering ("41 %", "72 °C"), so labels carry none.
_PLAIN: dict[str, str] = {
    "index": "Index",
    "name": "Model",
    "uuid": "UUID",
    "pci_bus_id": "PCI bus id",
    "memory_total_bytes": "Memory total",
    "memory_used_bytes": "Memory used",
    "memory_available_bytes": "Memory available",
    "compute_capability": "Compute capability",
    "mig_mode": "MIG mode",
    "driver_version": "Driver version",
    "cuda_driver_version": "CUDA driver version",
    "utilization_gpu_percent": "GPU utilization",
    "utilization_memory_percent": "Memory utilization",
    "temperature_celsius": "Temperature",
    "power_watts": "Power draw",
    "clock_graphics_mhz": "Graphics clock",
    "clock_sm_mhz": "SM clock",
    "clock_memory_mhz": "Memory clock",
    "fan_speed_percent": "Fan speed",
    "performance_state": "Performance state",
    "ecc_mode": "ECC mode",
    "pcie_replay_count": "PCIe replays",
    "xid_events": "XID events",
}

_ECC = {
    "corrected_volatile": "ECC: corrected (volatile)",
    "uncorrected_volatile": "ECC: uncorrected (volatile)",
    "corrected_aggregate": "ECC: corrected (aggregate)",
    "uncorrected_aggregate": "ECC: uncorrected (aggregate)",
}

# NVIDIA's own capitalisation of the clock event reasons (nvidia-smi -q).
_CLOCK_WORDS = {"hw": "HW", "sw": "SW", "gpu": "GPU"}


def _words(name: str) -> str:
    words = [_CLOCK_WORDS.get(w, w) for w in name.split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:] if text else text


def fact_label(name: str) -> str:
    """The label a person reads for the API name `name` (a fact, a metric or a `group.member`
    health signal); a name this table does not know yet reads as its words."""
    if name in _PLAIN:
        return _PLAIN[name]
    group, _, member = name.partition(".")
    if group == "ecc_errors" and member in _ECC:
        return _ECC[member]
    if group == "remapped_rows" and member:
        return f"Remapped rows: {member}"
    if group == "retired_pages" and member:
        return f"Retired pages: {_words(member).lower()}"
    if group == "clock_event_reasons" and member:
        return f"Clock event: {_words(member)}"
    return _words(name.replace(".", "_"))


# Every name the collectors define has a label of its own (tests/test_console_views.py holds it).
KNOWN_SIGNAL_NAMES: tuple[str, ...] = (
    *(f"ecc_errors.{c}" for c in ECC_COUNTERS),
    *(f"remapped_rows.{r}" for r in REMAPPED_ROWS),
    *(f"retired_pages.{p}" for p in RETIRED_PAGES),
    *(f"clock_event_reasons.{c}" for c in CLOCK_EVENT_REASONS),
)


_UNITS = (
    ("_percent", " %"),
    ("_celsius", " °C"),
    ("_watts", " W"),
    ("_mhz", " MHz"),
)


def human_bytes(n: int | float) -> str:
    """Binary units, as nvidia-smi and free(1) print memory."""
    value = float(n)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        # Decided on the number as printed: 1023.96 MiB prints as 1024.0, which is 1.0 GiB.
        text = f"{value:.1f}"
        if abs(float(text)) < 1024 or unit == "TiB":
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def known_text(name: str, value: Any) -> str:
    """A known value with its unit, taken from the metric's name (a 0 stays a visible 0)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float) and name.endswith("_bytes"):
        return human_bytes(value)
    if name == "performance_state" and isinstance(value, int):
        return f"P{value}"
    for suffix, unit in _UNITS:
        if name.endswith(suffix) and isinstance(value, int | float):
            shown = f"{value:.1f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"
            return shown + unit
    return str(value)


class FactView(msgspec.Struct, frozen=True):
    """A fact as people read it: `state` styles it (the console), `text` is what is read, `reason` why."""

    state: str
    text: str
    reason: str = ""


def fact_view(name: str, fact: Fact | None) -> FactView:
    """Unsupported, unavailable, failed, unknown and a measured value never read alike."""
    if fact is None:
        return FactView("unknown", "not reported")
    if isinstance(fact, Known):
        return FactView("known", known_text(name, fact.value))
    if isinstance(fact, Unsupported):
        return FactView("unsupported", "not supported", "the device does not have this sensor or feature")
    if isinstance(fact, Unavailable):
        return FactView("unavailable", "unavailable", fact.reason)
    if isinstance(fact, TemporarilyFailed):
        return FactView("temporarily_failed", "read failed", fact.reason)
    if isinstance(fact, Unknown):
        return FactView("unknown", "unknown")
    raise TypeError(f"not a fact: {fact!r}")


def _plain(value: Any) -> str:
    if isinstance(value, dict) and "state" in value:
        return str(value["value"]) if value["state"] == "known" else str(value["state"])
    if value is None:
        return "—"
    return str(value)


def xid_meaning(code: int) -> str:
    """What an XID says about the GPU: the rule's text, or that it is not a GPU fault."""
    rule = XID_RULES.get(code)
    if rule is None:
        return f"XID {code}: not in the health rules (usually a program's fault): recorded only"
    return rule[2]


def _reason_text(reason: Any) -> str:
    if isinstance(reason, dict) and "code" in reason:
        return f"{reason['code']} ({reason.get('detail', '')})"
    return str(reason)


def event_summary(event_type: str, data: dict[str, Any]) -> list[str]:
    """One line per thing the event says; changes read `field: before -> after`."""
    lines: list[str] = []
    changes = data.get("changes")
    if isinstance(changes, dict):
        for field, change in sorted(changes.items()):
            before = change.get("before") if isinstance(change, dict) else None
            after = change.get("after") if isinstance(change, dict) else None
            lines.append(f"{field}: {_plain(before)} -> {_plain(after)}")
    if event_type == "ACCELERATOR_DISCOVERED":
        name, index, pci = (_plain(data.get(k)) for k in ("name", "index", "pci_bus_id"))
        what = f"{name} at index {index}, PCI {pci}"
        lines.append(("rediscovered " if data.get("rediscovered") else "discovered ") + what)
    if event_type == "ACCELERATOR_HEALTH_CHANGED":
        lines.append(f"health: {data.get('before')} -> {data.get('after')}, action {data.get('action')}")
    if event_type == "ACCELERATOR_XID_OBSERVED" and isinstance(data.get("code"), int):
        lines.append(xid_meaning(data["code"]))
    if event_type == "NODE_TELEMETRY_OBSERVED" and isinstance(data.get("accelerators"), list):
        n = len(data["accelerators"])
        lines.append(f"telemetry of the host and {n} GPU{'' if n == 1 else 's'}")
    lines += _off_node_summary(event_type, data)
    for key in ("reason", "status", "stage", "detail", "hostname", "owner", "actor"):
        if key in data and isinstance(data[key], str | int) and not isinstance(data[key], bool):
            lines.append(f"{key}: {data[key]}")
    if data.get("reasons"):
        lines.append("reasons: " + "; ".join(_reason_text(r) for r in data["reasons"]))
    uuid = data.get("uuid") or data.get("accelerator_uuid")
    if uuid:
        lines.append(f"GPU {uuid}")
    return lines


def _off_node_summary(event_type: str, data: dict[str, Any]) -> list[str]:
    """What the events of tokens, the health policy and webhooks say (their ids, digests and
    hashes stay in the event's data)."""
    if event_type == "ENROLLMENT_TOKEN_CREATED":
        uses = data.get("uses")
        said = [f"{uses} use{'' if uses == 1 else 's'}, expires {_plain(data.get('expires_at'))}"]
        return said + ([f"description: {data['description']}"] if data.get("description") else [])
    if event_type == "ENROLLMENT_TOKEN_USED":
        return [f"enrolled node {_plain(data.get('node_id'))}"]
    if event_type == "HEALTH_POLICY_APPLIED":
        return [f"policy {_plain(data.get('name'))} in force"]
    if event_type == "WEBHOOK_SUBSCRIBED":
        said = [f"to {_plain(data.get('destination'))}"]
        return said + ([f"description: {data['description']}"] if data.get("description") else [])
    if event_type == "WEBHOOK_RESUMED":
        return [f"resumed from position {_plain(data.get('at_position'))}"]
    return []


def event_lines(event_type: str, data: Any) -> list[str]:
    """`event_summary` of an event's payload (a msgspec Struct, a dict or nothing)."""
    plain = msgspec.to_builtins(data) if data is not None else {}
    return event_summary(event_type, plain if isinstance(plain, dict) else {})


def _ordered(group: str, facts: dict[str, Fact], names: tuple[str, ...]) -> list[tuple[str, Fact]]:
    # The collector's order first (how nvidia-smi -q lists them), then anything newer.
    keys = [n for n in names if n in facts] + sorted(set(facts) - set(names))
    return [(f"{group}.{k}", facts[k]) for k in keys]


def signal_rows(signals: HealthSignalsBody) -> list[tuple[str, Fact]]:
    """The health signals as (name, fact) rows, grouped as docs/gpu-health.md lists them and each
    group in nvidia-smi's order."""
    return [
        ("ecc_mode", signals.ecc_mode),
        *_ordered("ecc_errors", signals.ecc_errors, ECC_COUNTERS),
        *_ordered("remapped_rows", signals.remapped_rows, REMAPPED_ROWS),
        *_ordered("retired_pages", signals.retired_pages, RETIRED_PAGES),
        ("pcie_replay_count", signals.pcie_replay_count),
        *_ordered("clock_event_reasons", signals.clock_event_reasons, tuple(CLOCK_EVENT_REASONS)),
        ("xid_events", signals.xid_events),
    ]


class StreamView(msgspec.Struct, frozen=True):
    """An event's stream as a reader names it: a short text, the stream id in full, and the node
    whose page the event belongs on (None where there is no such node: a token's, the health
    policy's or the webhooks' stream)."""

    text: str
    stream_id: str
    node_id: str | None


def stream_view(stream_id: str) -> StreamView:
    """Most streams are a node's (its id, shortened); the others say what they are, so that an
    enrollment token's events do not read as a node called `enrollme`."""
    if is_enrollment_token_stream(stream_id):
        return StreamView(
            "token " + stream_id.removeprefix(ENROLLMENT_TOKEN_STREAM_PREFIX)[:8], stream_id, None
        )
    if is_decommission_audit_stream(stream_id):
        node_id = stream_id.removeprefix(DECOMMISSION_AUDIT_STREAM_PREFIX)
        return StreamView("audit of " + node_id[:8], stream_id, node_id)
    if is_health_policy_stream(stream_id):
        return StreamView("health policy", stream_id, None)
    if is_webhook_stream(stream_id):
        return StreamView("webhooks", stream_id, None)
    return StreamView(stream_id[:8], stream_id, stream_id)


def gpu_order(index: object, uuid: str) -> tuple[bool, int, str]:
    """A GPU's place in a list for people: by index, as nvidia-smi lists them (one without a known
    index after the others), then by UUID."""
    known = type(index) is int
    return (not known, index if type(index) is int else 0, uuid)


def gpu_ordered(gpus: Iterable[_Gpu]) -> list[_Gpu]:
    """GPUs in `gpu_order`."""
    return sorted(gpus, key=lambda g: gpu_order(g.index, g.uuid))
