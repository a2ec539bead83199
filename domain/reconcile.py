"""The pure decider: `reconcile(observation, current state) -> events`.

No I/O and no clock: everything it needs is passed in, so hypothesis can drive it directly.

Decisions (docs/architecture.md has the reasoning):
- A fact that is now `temporarily_failed`, `unknown` or `unavailable` does not overwrite a fact we
  knew: a flaky NVML call is not a hardware change. `known` and `unsupported` are real answers and
  are compared.
- Only a `complete` enumeration can make a known GPU `missing`.
- An unchanged host yields observation events only (telemetry), no lifecycle event.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter

import msgspec

from collectors.facts import Fact, TemporarilyFailed, Unavailable, Unknown
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.identity import NodeIdentity, accelerator_id_for
from collectors.observations import ACCELERATOR_INVENTORY_FACTS, AcceleratorObservation, HardwareObservation
from domain.health_policy import DEFAULT_POLICY, HEALTHY, HealthPolicy, HealthVerdict, evaluate
from domain.node import AcceleratorState, NodeState
from ledger.events import (
    AcceleratorDiscovered,
    AcceleratorHealthChanged,
    AcceleratorMissing,
    AcceleratorSample,
    AcceleratorXidObserved,
    EventPayload,
    FactChange,
    HardwareChanged,
    InventoryStatusChanged,
    NodeDiscovered,
    NodeMetadataChanged,
    NodeTelemetryObserved,
)

_TRANSIENT = (TemporarilyFailed, Unknown, Unavailable)


def _settled(new: Fact, old: Fact) -> Fact:
    """The fact to record: a transient failure keeps what we knew."""
    return old if isinstance(new, _TRANSIENT) and not isinstance(old, _TRANSIENT) else new


def _diff(pairs: Mapping[str, tuple[Fact, Fact]]) -> dict[str, FactChange]:
    changes: dict[str, FactChange] = {}
    for name, (old, new) in pairs.items():
        if new == old:  # most facts of most reports: an equal fact settles to the one known
            continue
        settled = _settled(new, old)
        if settled != old:
            changes[name] = FactChange(before=old, after=settled)
    return changes


def inventory_status_of(observation: HardwareObservation, state: NodeState) -> tuple[str, list[str], str]:
    """(status, reasons, accelerator capability) per the seed's Health list."""
    nvml = observation.nvml
    if nvml.status == "unavailable":
        known_gpus = any(a.status == "active" for a in state.accelerators.values())
        reason = f"NVML unavailable: {nvml.reason or 'no reason given'}"
        return "degraded", [reason], ("unknown" if known_gpus else "absent")
    if nvml.status == "incomplete":
        reason = f"NVML scan incomplete: {nvml.reason or 'no reason given'}; last good GPU state kept"
        return "degraded", [reason], "present" if (nvml.accelerators or state.accelerators) else "unknown"
    return "ok", [], ("present" if nvml.accelerators else "absent")


def _accelerator_discovered(
    node_id: str, obs: AcceleratorObservation, driver: Fact, cuda: Fact, rediscovered: bool
) -> AcceleratorDiscovered:
    return AcceleratorDiscovered(
        accelerator_id=accelerator_id_for(node_id, obs.uuid),
        uuid=obs.uuid,
        index=obs.index,
        name=obs.name,
        pci_bus_id=obs.pci_bus_id,
        memory_total_bytes=obs.memory_total_bytes,
        compute_capability=obs.compute_capability,
        mig_mode=obs.mig_mode,
        driver_version=driver,
        cuda_driver_version=cuda,
        rediscovered=rediscovered,
    )


# A GPU's inventory facts as one tuple, of its folded state or of an observation.
_inventory_facts = attrgetter(*ACCELERATOR_INVENTORY_FACTS)


def _accelerator_changes(
    acc: AcceleratorState, obs: AcceleratorObservation, driver: Fact, cuda: Fact
) -> dict[str, FactChange]:
    # Only the facts that differ are diffed (`_diff` passes over equal ones): most reports of a
    # GPU repeat every inventory fact, and build no pair at all (told in one comparison of them all).
    if (
        driver == acc.driver_version
        and cuda == acc.cuda_driver_version
        and _inventory_facts(acc) == _inventory_facts(obs)
    ):
        return {}
    pairs: dict[str, tuple[Fact, Fact]] = {}
    for name in ACCELERATOR_INVENTORY_FACTS:
        old, new = getattr(acc, name), getattr(obs, name)
        if new != old:
            pairs[name] = (old, new)
    if driver != acc.driver_version:
        pairs["driver_version"] = (acc.driver_version, driver)
    if cuda != acc.cuda_driver_version:
        pairs["cuda_driver_version"] = (acc.cuda_driver_version, cuda)
    return _diff(pairs) if pairs else {}


def reconcile(
    observation: HardwareObservation,
    state: NodeState,
    identity: NodeIdentity,
    policy: HealthPolicy = DEFAULT_POLICY,
) -> list[EventPayload]:
    """The events that bring `state` in line with `observation`; GPU verdicts by `policy` (the
    health policy in force, docs/health-policy.md)."""
    events: list[EventPayload] = []
    host = observation.host
    nvml = observation.nvml
    node_id = state.node_id

    if not state.discovered:
        events.append(
            NodeDiscovered(
                node_id=node_id,
                identity_key=identity.key,
                identity_source=identity.source,
                hostname=host.hostname,
                os=host.os,
                cpu=host.cpu,
                memory_total_bytes=host.memory_total_bytes,
                driver_version=nvml.driver_version,
                cuda_driver_version=nvml.cuda_driver_version,
            )
        )
        driver, cuda = nvml.driver_version, nvml.cuda_driver_version
    else:
        if host.hostname != state.hostname:
            events.append(
                NodeMetadataChanged(
                    changes={"hostname": FactChange(before=state.hostname, after=host.hostname)}
                )
            )
        # Most reports repeat every node fact: told in one comparison of them all (equal facts
        # make no change), the pairs diffed one by one only where something differs.
        if not (
            host.memory_total_bytes == state.memory_total_bytes
            and host.os == state.os
            and host.cpu == state.cpu
            and (
                nvml.status == "unavailable"
                or (
                    nvml.driver_version == state.driver_version
                    and nvml.cuda_driver_version == state.cuda_driver_version
                )
            )
        ):
            pairs: dict[str, tuple[Fact, Fact]] = {
                "memory_total_bytes": (state.memory_total_bytes, host.memory_total_bytes),
            }
            for name in ("name", "version", "kernel", "architecture"):
                pairs[f"os.{name}"] = (getattr(state.os, name), getattr(host.os, name))
            for name in ("model", "sockets", "physical_cores", "logical_cores"):
                pairs[f"cpu.{name}"] = (getattr(state.cpu, name), getattr(host.cpu, name))
            if nvml.status != "unavailable":
                pairs["driver_version"] = (state.driver_version, nvml.driver_version)
                pairs["cuda_driver_version"] = (state.cuda_driver_version, nvml.cuda_driver_version)
            changes = _diff(pairs)
            if changes:
                events.append(HardwareChanged(subject="node", changes=changes))
        driver = _settled(nvml.driver_version, state.driver_version)
        cuda = _settled(nvml.cuda_driver_version, state.cuda_driver_version)

    seen: set[str] = set()
    for obs in nvml.accelerators:
        seen.add(obs.uuid)
        acc = state.accelerators.get(obs.uuid)
        if acc is None or acc.status != "active":
            events.append(_accelerator_discovered(node_id, obs, driver, cuda, acc is not None))
            continue
        acc_changes = _accelerator_changes(acc, obs, driver, cuda)
        if acc_changes:
            events.append(
                HardwareChanged(
                    subject="accelerator",
                    changes=acc_changes,
                    accelerator_id=acc.accelerator_id,
                    accelerator_uuid=acc.uuid,
                )
            )

    health = _health_events(observation, state, policy, state.stream_version + len(events))
    events.extend(health)

    # Most reports list every GPU the node has: told in one set comparison.
    if nvml.status == "complete" and not seen.issuperset(state.accelerators):
        for gpu_uuid, acc in sorted(state.accelerators.items()):
            if acc.status == "active" and gpu_uuid not in seen:
                events.append(
                    AcceleratorMissing(
                        accelerator_id=acc.accelerator_id,
                        uuid=gpu_uuid,
                        reason="absent from a complete NVML enumeration",
                    )
                )

    status, reasons, capability = inventory_status_of(observation, state)
    if (status, reasons, capability, nvml.status) != (
        state.inventory_status,
        state.inventory_reasons,
        state.accelerator_capability,
        state.nvml_status,
    ):
        events.append(
            InventoryStatusChanged(
                status=status,  # type: ignore[arg-type]
                reasons=reasons,
                nvml_status=nvml.status,
                accelerator_capability=capability,  # type: ignore[arg-type]
            )
        )

    # Telemetry: one observation event for the whole snapshot, never audit noise. It is the last
    # event of the append, so its stream version is known now: the verdicts name it as evidence.
    sample_version = state.stream_version + len(events) + 1
    if any(isinstance(e, AcceleratorHealthChanged) for e in health):
        events = [
            msgspec.structs.replace(e, evidence=[*(v for v in e.evidence if v != _SAMPLE), sample_version])
            if isinstance(e, AcceleratorHealthChanged) and _SAMPLE in e.evidence
            else e
            for e in events
        ]
    # The observation's own dicts and lists: it is a value nothing changes in place (the fold
    # takes them on into the state likewise).
    events.append(
        NodeTelemetryObserved(
            telemetry=host.telemetry,
            storage=host.storage,
            accelerators=[
                AcceleratorSample(
                    accelerator_id=accelerator_id_for(node_id, obs.uuid),
                    uuid=obs.uuid,
                    telemetry=obs.telemetry,
                    health=_without_xids(obs.health),
                )
                for obs in nvml.accelerators
            ],
        )
    )
    return events


def _without_xids(signals: AcceleratorHealthSignals | None) -> AcceleratorHealthSignals | None:
    """A sample's health signals, its XIDs left out (they are events of their own): most
    collections drain none, and their signals are taken as they are."""
    if signals is None or not signals.xids:
        return signals
    return msgspec.structs.replace(signals, xids=[])


# Stands for the stream version of this refresh's telemetry snapshot until it is known.
_SAMPLE = -1


def _health_events(
    observation: HardwareObservation, state: NodeState, policy: HealthPolicy, version: int
) -> list[EventPayload]:
    """Each new XID once, and a verdict change (`policy`) of each observed GPU; `version` is the
    stream version of the last event before these.

    Follows the inventory events of the same refresh, whose fold judges a (re)discovered GPU
    afresh, so `before` is `healthy` for it. A GPU the scan could not list (XID 79: fallen off
    the bus) is judged by its last signals and its XIDs."""
    events: list[EventPayload] = []
    now = observation.observed_at
    nvml = observation.nvml
    judged: list[tuple[str, AcceleratorHealthSignals | None, list[XidOccurrence], HealthVerdict, bool]] = []
    for obs in nvml.accelerators:
        acc = state.accelerators.get(obs.uuid)
        before = acc.health if acc is not None and acc.status == "active" else HEALTHY
        if obs.health is None and (acc is None or not acc.xids) and before == HEALTHY:
            # No signal, no XID reported or remembered, healthy: healthy it stays, whatever the
            # policy (most GPUs of a fleet without health signals, report after report).
            continue
        judged.append((obs.uuid, obs.health, obs.health.xids if obs.health is not None else [], before, True))
    listed = {obs.uuid for obs in nvml.accelerators} if nvml.unlisted_xids else set()
    for gpu_uuid, xids in sorted(nvml.unlisted_xids.items()):
        acc = state.accelerators.get(gpu_uuid)
        if acc is None or gpu_uuid in listed:
            continue  # a GPU never inventoried has no accelerator to attach them to
        sample = state.accelerator_telemetry.get(gpu_uuid)
        last = sample.health if sample is not None else None
        judged.append((gpu_uuid, last, xids, acc.health, False))
    for gpu_uuid, signals, reported, before, sampled in judged:
        acc = state.accelerators.get(gpu_uuid)
        accelerator_id = (
            acc.accelerator_id if acc is not None else accelerator_id_for(state.node_id, gpu_uuid)
        )
        remembered: list[XidOccurrence] = acc.xids if acc is not None else []
        # Most reports bring no XID and change no verdict: the versions are worked out for those
        # that do (every GPU of every report otherwise, up to MAX_RECENT_XIDS each).
        known = remembered
        added: dict[XidOccurrence, int] = {}
        if reported:
            known = list(remembered)
            seen = {(x.code, x.at) for x in known}
            for xid in reported:
                if (xid.code, xid.at) in seen:
                    continue  # the same occurrence reported again
                seen.add((xid.code, xid.at))
                known.append(xid)
                events.append(
                    AcceleratorXidObserved(
                        accelerator_id=accelerator_id, uuid=gpu_uuid, code=xid.code, at=xid.at
                    )
                )
                added[xid] = version + len(events)
        # The XIDs of this report were drained during its collection, after `observed_at` was
        # taken: judged at the latest of them, so they count at once rather than a refresh later.
        sample = state.accelerator_telemetry.get(gpu_uuid) if sampled else None
        previous = sample.health if sample is not None else None
        at = max(now, *(x.at for x in reported)) if reported else now
        after, counted = evaluate(policy, signals, known, at, previous)
        if after != before:
            versions = {**(acc.versions_of_xids() if acc is not None else {}), **added}
            evidence = sorted({versions.get(x, 0) for x in counted} - {0})
            if sampled:
                evidence.append(_SAMPLE)
            events.append(
                AcceleratorHealthChanged(
                    accelerator_id=accelerator_id,
                    uuid=gpu_uuid,
                    before=before.status,
                    after=after.status,
                    action=after.action,
                    reasons=list(after.reasons),
                    before_reasons=[r.code for r in before.reasons],
                    policy_digest=policy.digest,
                    evidence=evidence,
                )
            )
    return events
