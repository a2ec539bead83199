"""The agent's check of an observation before it sends it, and its repair: a reading the server
would refuse costs that one fact (`temporarily_failed`, with the reason), never the whole report.

The bounds are the wire contract's (agent/protocol.py); the server applies them when it decodes a
report, the agent here, so that what it spools is what the server accepts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import msgspec

from agent.protocol import (
    WIRE_OBSERVATION,
    observation_problems_after_decode,
    time_problem,
)
from collectors.contract import (
    ACCELERATOR_METRIC_TYPES,
    HOST_METRIC_TYPES,
    MAX_ACCELERATORS,
    MAX_CLOCK_EVENT_REASONS,
    MAX_COLLECTORS,
    MAX_DURATION_SECONDS,
    MAX_GPU_UUID,
    MAX_HEALTH_COUNTERS,
    MAX_HOSTNAME,
    MAX_MOUNTS,
    MAX_SHORT,
    MAX_STRING,
    MAX_XIDS,
    Count,
    CountOrFlag,
    EccMode,
    ErrorCount,
    GpuIndex,
    GpuUuid,
    Hostname,
    MemoryBytes,
    MigMode,
    ShortText,
    StorageBytes,
    Text,
    XidCode,
)
from collectors.facts import Fact, Known, TemporarilyFailed, Unavailable
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.observations import (
    ACCELERATOR_INVENTORY_FACTS,
    AcceleratorObservation,
    CollectorRun,
    HardwareObservation,
    HostObservation,
    StorageObservation,
)

_wire_observation_decoder = msgspec.json.Decoder(WIRE_OBSERVATION)
_encoder = msgspec.json.Encoder()

# The bound each accelerator inventory fact's value must hold (one entry per inventory fact).
ACCELERATOR_FACT_TYPES: dict[str, Any] = {
    "index": GpuIndex,
    "name": Text,
    "pci_bus_id": Text,
    "memory_total_bytes": MemoryBytes,
    "compute_capability": ShortText,
    "mig_mode": MigMode,
}
assert set(ACCELERATOR_FACT_TYPES) == set(ACCELERATOR_INVENTORY_FACTS)

# A GPU's single health facts and its groups of them (collectors.gpu_health), with the type a known
# value must have and, for a group, how many facts it may hold.
HEALTH_FACT_TYPES: dict[str, Any] = {"ecc_mode": EccMode, "pcie_replay_count": ErrorCount, "xid_events": bool}
HEALTH_GROUP_TYPES: dict[str, tuple[Any, int]] = {
    "clock_event_reasons": (bool, MAX_CLOCK_EVENT_REASONS),
    "ecc_errors": (ErrorCount, MAX_HEALTH_COUNTERS),
    "remapped_rows": (CountOrFlag, MAX_HEALTH_COUNTERS),
    "retired_pages": (CountOrFlag, MAX_HEALTH_COUNTERS),
}


def _health_facts(prefix: str, health: AcceleratorHealthSignals) -> Iterator[tuple[str, Fact, Any]]:
    for name, value_type in HEALTH_FACT_TYPES.items():
        yield f"{prefix}.{name}", getattr(health, name), value_type
    for group, (value_type, _) in HEALTH_GROUP_TYPES.items():
        for key, fact in getattr(health, group).items():
            yield f"{prefix}.{group}.{key[:64]!r}", fact, value_type


def _named_facts(obs: HardwareObservation) -> Iterator[tuple[str, Fact, Any]]:
    """Every fact of an observation, where it is and the type its value must have."""
    host = obs.host
    for name in ("name", "version", "kernel", "architecture"):
        yield f"host.os.{name}", getattr(host.os, name), Text
    yield "host.cpu.model", host.cpu.model, Text
    for name in ("sockets", "physical_cores", "logical_cores"):
        yield f"host.cpu.{name}", getattr(host.cpu, name), Count
    yield "host.memory_total_bytes", host.memory_total_bytes, MemoryBytes
    for metric, fact in host.telemetry.items():
        if metric in HOST_METRIC_TYPES:
            yield f"host.telemetry.{metric}", fact, HOST_METRIC_TYPES[metric]
    for m in host.storage:
        yield f"host.storage[{m.mount!r}].used_bytes", m.used_bytes, StorageBytes
        yield f"host.storage[{m.mount!r}].total_bytes", m.total_bytes, StorageBytes
    yield "nvml.driver_version", obs.nvml.driver_version, ShortText
    yield "nvml.cuda_driver_version", obs.nvml.cuda_driver_version, ShortText
    for a in obs.nvml.accelerators:
        prefix = f"nvml.accelerators[{a.uuid!r}]"
        for name in ACCELERATOR_INVENTORY_FACTS:
            yield f"{prefix}.{name}", getattr(a, name), ACCELERATOR_FACT_TYPES[name]
        for metric, fact in a.telemetry.items():
            if metric in ACCELERATOR_METRIC_TYPES:
                yield f"{prefix}.telemetry.{metric}", fact, ACCELERATOR_METRIC_TYPES[metric]
        if a.health is not None:
            yield from _health_facts(f"{prefix}.health", a.health)


def _convert_problem(value: Any, value_type: Any) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # e.g. a non-UTF-8 mount path that Python decoded with surrogateescape
            return "not valid UTF-8 (a lone surrogate)"
    try:
        msgspec.convert(value, value_type)
    except msgspec.ValidationError as exc:
        return f"{value!r:.80}: {exc}"
    return None


def fact_problem(fact: Fact, value_type: Any = None) -> str | None:
    """Why a fact is outside the contract, or None. `value_type`: what a known value must be."""
    if isinstance(fact, Known):
        return None if value_type is None else _convert_problem(fact.value, value_type)
    reason = getattr(fact, "reason", None)
    return None if reason is None else _convert_problem(reason, Text)


def _xid_problem(xid: XidOccurrence) -> str | None:
    return _convert_problem(xid.code, XidCode) or time_problem(xid.at)


def _xids_problems(where: str, xids: list[XidOccurrence]) -> list[str]:
    errors = [f"{where}: more than {MAX_XIDS}"] if len(xids) > MAX_XIDS else []
    return errors + [f"{where}: {problem}" for problem in filter(None, map(_xid_problem, xids))]


def _health_problems(where: str, health: AcceleratorHealthSignals) -> list[str]:
    """What the fact walk cannot say about a GPU's health signals: group sizes, keys and XIDs."""
    errors: list[str] = []
    for group, (_, limit) in HEALTH_GROUP_TYPES.items():
        facts: dict[str, Fact] = getattr(health, group)
        if len(facts) > limit:
            errors.append(f"{where}.{group}: more than {limit}")
        if any(_convert_problem(key, ShortText) for key in facts):
            errors.append(f"{where}.{group}: a name is longer than {MAX_SHORT} characters or has a NUL")
    return errors + _xids_problems(f"{where}.xids", health.xids)


def _metric_names(where: str, telemetry: dict[str, Fact], known: dict[str, Any]) -> list[str]:
    return [f"{where}.{name[:64]!r}: not a metric of the protocol" for name in telemetry if name not in known]


def validate_observation(obs: HardwareObservation) -> list[str]:
    """Everything wrong with an observation (empty: valid). The server has already decoded the
    report against the wire types (decode_report); the agent checks what it is about to send."""
    uuids = [a.uuid for a in obs.nvml.accelerators]
    if len(set(uuids)) == len(uuids) and time_problem(obs.observed_at) is None:
        try:
            _wire_observation_decoder.decode(_encoder.encode(obs))
            return []  # the common case, in one pass; the walk below says what is wrong
        except (msgspec.ValidationError, UnicodeEncodeError):
            pass
    errors: list[str] = []
    host = obs.host
    problem = time_problem(obs.observed_at)
    if problem is not None:
        errors.append(f"observed_at: {problem}")
    if _convert_problem(host.hostname, Hostname):
        errors.append(f"host.hostname: must be 1 to {MAX_HOSTNAME} characters without NUL")
    if len(host.storage) > MAX_MOUNTS:
        errors.append(f"host.storage: more than {MAX_MOUNTS} mounts")
    if any(_convert_problem(m.mount, Text) for m in host.storage):
        errors.append(f"host.storage: a mount path is longer than {MAX_STRING} characters or has a NUL")
    errors += _metric_names("host.telemetry", host.telemetry, HOST_METRIC_TYPES)
    nvml = obs.nvml
    if nvml.reason is not None and _convert_problem(nvml.reason, Text):
        errors.append(f"nvml.reason: longer than {MAX_STRING} characters or has a NUL")
    if len(nvml.accelerators) > MAX_ACCELERATORS:
        errors.append(f"nvml.accelerators: more than {MAX_ACCELERATORS}")
    errors += observation_problems_after_decode(obs)
    for a in nvml.accelerators:
        if _convert_problem(a.uuid, GpuUuid):
            errors.append(f"nvml.accelerators: uuid must be 1 to {MAX_GPU_UUID} characters without NUL")
        errors += _metric_names(
            f"nvml.accelerators[{a.uuid[:64]!r}].telemetry", a.telemetry, ACCELERATOR_METRIC_TYPES
        )
        if a.health is not None:
            errors += _health_problems(f"nvml.accelerators[{a.uuid[:64]!r}].health", a.health)
    if len(nvml.unlisted_xids) > MAX_ACCELERATORS:
        errors.append(f"nvml.unlisted_xids: more than {MAX_ACCELERATORS} GPUs")
    for uuid, xids in nvml.unlisted_xids.items():
        if _convert_problem(uuid, GpuUuid):
            errors.append(f"nvml.unlisted_xids: a uuid must be 1 to {MAX_GPU_UUID} characters without NUL")
        errors += _xids_problems(f"nvml.unlisted_xids[{uuid[:64]!r}]", xids)
    if len(obs.collectors) > MAX_COLLECTORS:
        errors.append(f"collectors: more than {MAX_COLLECTORS}")
    for run in obs.collectors:
        if (
            _convert_problem(run.collector, ShortText)
            or (run.error is not None and _convert_problem(run.error, Text))
            or not 0 <= run.duration_seconds <= MAX_DURATION_SECONDS
        ):
            errors.append(f"collectors: {_without_nul(run.collector[:64])!r} is outside the contract")
    for where, fact, value_type in _named_facts(obs):
        problem = fact_problem(fact, value_type)
        if problem is not None:
            errors.append(f"{where}: {problem}")
    return errors


def _without_nul(text: str) -> str:
    """NUL and lone surrogates (neither storable by PostgreSQL) become U+FFFD."""
    return text.replace("\x00", "\ufffd").encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _clean(fact: Fact, value_type: Any) -> Fact:
    if isinstance(fact, Unavailable | TemporarilyFailed) and fact_problem(fact) is not None:
        return type(fact)(_without_nul(fact.reason)[:MAX_STRING])
    if isinstance(fact, Known) and isinstance(fact.value, str) and fact_problem(fact, value_type) is not None:
        repaired = Known(_without_nul(fact.value))
        if fact_problem(repaired, value_type) is None:
            return repaired
    problem = fact_problem(fact, value_type)
    if problem is None:
        return fact
    return TemporarilyFailed(_without_nul(f"invalid reading ({problem})")[:MAX_STRING])


def _clean_metrics(telemetry: dict[str, Fact], known: dict[str, Any]) -> dict[str, Fact]:
    # A metric the protocol does not know would cost the report: it stays on this side.
    return {name: _clean(fact, known[name]) for name, fact in telemetry.items() if name in known}


def _clean_group(facts: dict[str, Fact], value_type: Any, limit: int) -> dict[str, Fact]:
    return {
        _without_nul(key)[:MAX_SHORT]: _clean(fact, value_type) for key, fact in list(facts.items())[:limit]
    }


def _clean_xids(xids: list[XidOccurrence]) -> list[XidOccurrence]:
    # An occurrence the contract refuses (a code beyond 32 bits, a time from a broken clock) is
    # left out rather than costing the report with every other signal in it.
    return [x for x in xids if _xid_problem(x) is None][:MAX_XIDS]


def _clean_health(health: AcceleratorHealthSignals) -> AcceleratorHealthSignals:
    groups = {
        group: _clean_group(getattr(health, group), value_type, limit)
        for group, (value_type, limit) in HEALTH_GROUP_TYPES.items()
    }
    return AcceleratorHealthSignals(
        ecc_mode=_clean(health.ecc_mode, EccMode),
        pcie_replay_count=_clean(health.pcie_replay_count, ErrorCount),
        xid_events=_clean(health.xid_events, bool),
        xids=_clean_xids(health.xids),
        **groups,
    )


def _clean_unlisted_xids(unlisted: dict[str, list[XidOccurrence]]) -> dict[str, list[XidOccurrence]]:
    cleaned = ((_without_nul(uuid)[:MAX_GPU_UUID], _clean_xids(xids)) for uuid, xids in unlisted.items())
    return dict(itertools.islice(((uuid, xids) for uuid, xids in cleaned if uuid), MAX_ACCELERATORS))


def sanitize_observation(obs: HardwareObservation) -> HardwareObservation:
    """The agent's side: a reading the server would refuse (a negative, non-finite or impossible
    number from a confused sensor, a value of the wrong type) becomes `temporarily_failed` with
    the reason, rather than costing the whole report; a NUL in a name becomes U+FFFD."""
    if not validate_observation(obs):
        return obs
    host = obs.host
    clean_host = HostObservation(
        hostname=_without_nul(host.hostname)[:MAX_HOSTNAME] or "unknown",
        os=type(host.os)(**{f: _clean(getattr(host.os, f), Text) for f in host.os.__struct_fields__}),
        cpu=type(host.cpu)(
            model=_clean(host.cpu.model, Text),
            sockets=_clean(host.cpu.sockets, Count),
            physical_cores=_clean(host.cpu.physical_cores, Count),
            logical_cores=_clean(host.cpu.logical_cores, Count),
        ),
        memory_total_bytes=_clean(host.memory_total_bytes, MemoryBytes),
        telemetry=_clean_metrics(host.telemetry, HOST_METRIC_TYPES),
        storage=[
            StorageObservation(
                mount=_without_nul(m.mount)[:MAX_STRING],
                used_bytes=_clean(m.used_bytes, StorageBytes),
                total_bytes=_clean(m.total_bytes, StorageBytes),
            )
            for m in host.storage[:MAX_MOUNTS]
        ],
    )
    accelerators = [
        AcceleratorObservation(
            uuid=_without_nul(a.uuid)[:MAX_GPU_UUID],
            index=_clean(a.index, GpuIndex),
            name=_clean(a.name, Text),
            pci_bus_id=_clean(a.pci_bus_id, Text),
            memory_total_bytes=_clean(a.memory_total_bytes, MemoryBytes),
            compute_capability=_clean(a.compute_capability, ShortText),
            mig_mode=_clean(a.mig_mode, MigMode),
            telemetry=_clean_metrics(a.telemetry, ACCELERATOR_METRIC_TYPES),
            health=None if a.health is None else _clean_health(a.health),
        )
        for a in obs.nvml.accelerators
    ]
    reason = obs.nvml.reason
    nvml = msgspec.structs.replace(
        obs.nvml,
        reason=None if reason is None else _without_nul(reason)[:MAX_STRING],
        driver_version=_clean(obs.nvml.driver_version, ShortText),
        cuda_driver_version=_clean(obs.nvml.cuda_driver_version, ShortText),
        accelerators=accelerators,
        unlisted_xids=_clean_unlisted_xids(obs.nvml.unlisted_xids),
    )
    collectors = [
        CollectorRun(
            collector=_without_nul(run.collector)[:MAX_SHORT],
            ok=run.ok,
            duration_seconds=min(max(run.duration_seconds, 0.0), MAX_DURATION_SECONDS)
            if math.isfinite(run.duration_seconds)
            else MAX_DURATION_SECONDS,
            error=None if run.error is None else _without_nul(run.error)[:MAX_STRING],
        )
        for run in obs.collectors[:MAX_COLLECTORS]
    ]
    return msgspec.structs.replace(obs, host=clean_host, nvml=nvml, collectors=collectors)
