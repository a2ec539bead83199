"""The wire protocol between the compute-node agent and the central API (docs/NODE_AGENT_PROTOCOL.md).

Both sides use these Structs: the agent encodes them, the server decodes and validates them with
the same types, so the contract cannot drift between the two.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Literal, TypeAlias

import msgspec

from collectors.facts import Fact, Known, TemporarilyFailed
from collectors.observations import (
    ACCELERATOR_INVENTORY_FACTS,
    AcceleratorObservation,
    HardwareObservation,
    HostObservation,
    StorageObservation,
)

PROTOCOL_VERSION = 1

# The report streams. Each has its own sequence. Every report carries a full observation (the
# server reconciles it through the one code path); the stream says why it was sent:
#   inventory: at agent start, when the inventory facts changed, and every N reports;
#   telemetry: the periodic heartbeat in between. A full spool drops telemetry first.
STREAMS: tuple[str, ...] = ("inventory", "telemetry")
Stream: TypeAlias = Literal["inventory", "telemetry"]

ENROLL_PATH = "/api/v1/agent/enroll"
REPORTS_PATH = "/api/v1/agent/reports"
# The agent's clock when it sent this attempt (RFC 3339). Not in the body: a retry must be
# byte-identical to the first attempt, and the send time differs per attempt.
SENT_AT_HEADER = "Modelforge-Agent-Sent-At"

ENROLLMENT_TOKEN_PREFIX = "mfe"
CREDENTIAL_PREFIX = "mfc"

MAX_SEQUENCE = 2**63 - 1
MAX_HOSTNAME = 255
MAX_STRING = 1024
MAX_ACCELERATORS = 256
MAX_METRICS = 64
MAX_MOUNTS = 64
MAX_COLLECTORS = 16
_METRIC_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

IdentitySource: TypeAlias = Literal["configured", "state_file", "machine_id"]
Sequence: TypeAlias = Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQUENCE)]
AwareDatetime: TypeAlias = Annotated[datetime, msgspec.Meta(tz=True)]


class EnrollRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """POST /api/v1/agent/enroll, with `Authorization: Bearer <enrollment token>`."""

    identity_key: str
    identity_source: IdentitySource
    hostname: Annotated[str, msgspec.Meta(max_length=MAX_HOSTNAME)]
    agent_version: Annotated[str, msgspec.Meta(max_length=64)] = ""


class EnrollResponse(msgspec.Struct, frozen=True):
    """The node credential, shown once. `streams`: the last accepted sequence per stream, so an
    agent that lost its state directory continues above them instead of being refused."""

    node_id: str
    identity_key: str
    credential_id: str
    credential: str
    streams: dict[str, int]
    superseded_credentials: list[str] = []


class Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """POST /api/v1/agent/reports, with `Authorization: Bearer <node credential>`."""

    protocol: int
    node_id: str
    identity_key: str
    identity_source: IdentitySource
    stream: str
    sequence: Sequence
    observed_at: AwareDatetime  # the agent's clock when it observed
    observation: HardwareObservation


class ReportAck(msgspec.Struct, frozen=True):
    """200: `accepted` (appended) or `duplicate` (an unchanged retry of an accepted report;
    nothing appended). `gap`: sequences skipped since the previous accepted one."""

    status: Literal["accepted", "duplicate"]
    node_id: str
    stream: str
    sequence: int
    previous_sequence: int | None
    gap: int
    received_at: datetime
    events: int
    lifecycle_events: list[str] = []


_report_decoder = msgspec.json.Decoder(Report)
_encoder = msgspec.json.Encoder()


def encode_report(report: Report) -> bytes:
    return _encoder.encode(report)


def decode_report(raw: bytes) -> Report:
    """Raises msgspec.DecodeError (malformed JSON) or msgspec.ValidationError (wrong shape)."""
    return _report_decoder.decode(raw)


# --- validation of an observation's values (both sides) ------------------------------------------


def _named_facts(obs: HardwareObservation) -> Iterator[tuple[str, Fact]]:
    host = obs.host
    for name in ("name", "version", "kernel", "architecture"):
        yield f"host.os.{name}", getattr(host.os, name)
    for name in ("model", "sockets", "physical_cores", "logical_cores"):
        yield f"host.cpu.{name}", getattr(host.cpu, name)
    yield "host.memory_total_bytes", host.memory_total_bytes
    for metric, fact in host.telemetry.items():
        yield f"host.telemetry.{metric}", fact
    for m in host.storage:
        yield f"host.storage[{m.mount}].used_bytes", m.used_bytes
        yield f"host.storage[{m.mount}].total_bytes", m.total_bytes
    yield "nvml.driver_version", obs.nvml.driver_version
    yield "nvml.cuda_driver_version", obs.nvml.cuda_driver_version
    for a in obs.nvml.accelerators:
        prefix = f"nvml.accelerators[{a.uuid}]"
        for name in ACCELERATOR_INVENTORY_FACTS:
            yield f"{prefix}.{name}", getattr(a, name)
        for metric, fact in a.telemetry.items():
            yield f"{prefix}.telemetry.{metric}", fact


def fact_problem(fact: Fact) -> str | None:
    """Why a fact's value is not acceptable, or None. Numbers are finite and >= 0 (every metric
    and count of the catalog is); strings are bounded."""
    if not isinstance(fact, Known):
        reason = getattr(fact, "reason", None)
        if isinstance(reason, str) and len(reason) > MAX_STRING:
            return f"reason longer than {MAX_STRING} characters"
        return None
    value = fact.value
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            return f"{value!r} is not a finite number"
        if value < 0:
            return f"{value!r} is negative"
        return None
    if isinstance(value, str) and len(value) > MAX_STRING:
        return f"string longer than {MAX_STRING} characters"
    return None


def _metric_names(where: str, telemetry: dict[str, Fact]) -> list[str]:
    errors = []
    if len(telemetry) > MAX_METRICS:
        errors.append(f"{where}: more than {MAX_METRICS} metrics")
    errors += [f"{where}.{name}: not a metric name" for name in telemetry if not _METRIC_NAME.match(name)]
    return errors


def validate_observation(obs: HardwareObservation) -> list[str]:
    """Everything wrong with an observation's values that its types cannot say (empty: valid)."""
    errors: list[str] = []
    host = obs.host
    if not host.hostname or len(host.hostname) > MAX_HOSTNAME:
        errors.append(f"host.hostname: must be 1 to {MAX_HOSTNAME} characters")
    if len(host.storage) > MAX_MOUNTS:
        errors.append(f"host.storage: more than {MAX_MOUNTS} mounts")
    if any(len(m.mount) > MAX_STRING for m in host.storage):
        errors.append(f"host.storage: mount path longer than {MAX_STRING} characters")
    errors += _metric_names("host.telemetry", host.telemetry)
    nvml = obs.nvml
    if nvml.reason is not None and len(nvml.reason) > MAX_STRING:
        errors.append(f"nvml.reason: longer than {MAX_STRING} characters")
    if len(nvml.accelerators) > MAX_ACCELERATORS:
        errors.append(f"nvml.accelerators: more than {MAX_ACCELERATORS}")
    uuids = [a.uuid for a in nvml.accelerators]
    if len(set(uuids)) != len(uuids):
        errors.append("nvml.accelerators: the same GPU UUID appears twice")
    for a in nvml.accelerators:
        if not a.uuid or len(a.uuid) > 128:
            errors.append("nvml.accelerators: uuid must be 1 to 128 characters")
        errors += _metric_names(f"nvml.accelerators[{a.uuid}].telemetry", a.telemetry)
    if len(obs.collectors) > MAX_COLLECTORS:
        errors.append(f"collectors: more than {MAX_COLLECTORS}")
    for where, fact in _named_facts(obs):
        problem = fact_problem(fact)
        if problem is not None:
            errors.append(f"{where}: {problem}")
    return errors


def _clean(fact: Fact) -> Fact:
    problem = fact_problem(fact)
    return fact if problem is None else TemporarilyFailed(f"invalid reading ({problem})"[:MAX_STRING])


def _clean_metrics(telemetry: dict[str, Fact]) -> dict[str, Fact]:
    return {name: _clean(fact) for name, fact in telemetry.items()}


def sanitize_observation(obs: HardwareObservation) -> HardwareObservation:
    """The agent's side: a reading the server would refuse (a negative or non-finite number from
    a confused sensor) becomes `temporarily_failed` rather than costing the whole report."""
    if not validate_observation(obs):
        return obs
    host = obs.host
    clean_host = HostObservation(
        hostname=host.hostname,
        os=host.os,
        cpu=type(host.cpu)(**{f: _clean(getattr(host.cpu, f)) for f in host.cpu.__struct_fields__}),
        memory_total_bytes=_clean(host.memory_total_bytes),
        telemetry=_clean_metrics(host.telemetry),
        storage=[
            StorageObservation(
                mount=m.mount, used_bytes=_clean(m.used_bytes), total_bytes=_clean(m.total_bytes)
            )
            for m in host.storage
        ],
    )
    accelerators = [
        AcceleratorObservation(
            uuid=a.uuid,
            index=_clean(a.index),
            name=a.name,
            pci_bus_id=a.pci_bus_id,
            memory_total_bytes=_clean(a.memory_total_bytes),
            compute_capability=a.compute_capability,
            mig_mode=a.mig_mode,
            telemetry=_clean_metrics(a.telemetry),
        )
        for a in obs.nvml.accelerators
    ]
    return msgspec.structs.replace(
        obs, host=clean_host, nvml=msgspec.structs.replace(obs.nvml, accelerators=accelerators)
    )
