"""The workload of bench/ledger.py: eight-GPU nodes, each discovered once through the product's
`reconcile`, then agent-style reports of two events (the node's telemetry and its inventory
status, flapping between complete and incomplete NVML scans), split over the writers."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from bench.fleet import model_of, node_key, node_observation
from collectors.identity import NodeIdentity, accelerator_id_for
from domain.node import NodeState
from domain.reconcile import reconcile
from ledger.events import (
    AcceleratorSample,
    EventMetadata,
    EventPayload,
    InventoryStatusChanged,
    NewEvent,
    NodeTelemetryObserved,
)

TASKS = 8
POOL = 4
EVENTS_PER_REPORT = 2  # one NODE_TELEMETRY_OBSERVED snapshot and one lifecycle event


@dataclass
class Node:
    index: int
    node_id: str
    discovered_version: int
    degraded: bool = False
    sequence: int = 0


@dataclass
class Report:
    node_id: str
    events: list[NewEvent]


LOST_GPU_REASON = "NVML scan incomplete: nvmlDeviceGetHandleByIndex(5): GPU is lost; last good GPU state kept"


def discovery_events(node: Node, rng: random.Random) -> list[NewEvent]:
    obs = node_observation(node.index, rng)
    payloads = reconcile(
        obs, NodeState(node_id=node.node_id), NodeIdentity(node_key(node.index), "configured")
    )
    meta = EventMetadata(received_at=datetime.now(UTC), source="agent", observed_at=datetime.now(UTC))
    return [NewEvent(payload=p, metadata=meta) for p in payloads]


def report_events(node: Node, rng: random.Random, received_at: datetime) -> list[NewEvent]:
    """One agent report of an eight-GPU node: telemetry plus the flapping inventory status."""
    obs = node_observation(node.index, rng)
    node.sequence += 1
    node.degraded = not node.degraded
    meta = EventMetadata(
        received_at=received_at,
        source="agent",
        observed_at=received_at - timedelta(milliseconds=rng.randint(5, 400)),
        agent_stream=f"agent-{node.node_id}",
        agent_sequence=node.sequence,
    )
    payloads: list[EventPayload] = [
        NodeTelemetryObserved(
            telemetry=dict(obs.host.telemetry),
            storage=list(obs.host.storage),
            accelerators=[
                AcceleratorSample(
                    accelerator_id=accelerator_id_for(node.node_id, gpu.uuid),
                    uuid=gpu.uuid,
                    telemetry=gpu.telemetry,
                )
                for gpu in obs.nvml.accelerators
            ],
        )
    ]
    if node.degraded:
        payloads.append(
            InventoryStatusChanged(
                status="degraded",
                reasons=[LOST_GPU_REASON],
                nvml_status="incomplete",
                accelerator_capability="present",
            )
        )
    else:
        payloads.append(
            InventoryStatusChanged(
                status="ok", reasons=[], nvml_status="complete", accelerator_capability="present"
            )
        )
    assert len(payloads) == EVENTS_PER_REPORT, model_of(node.index).name
    return [NewEvent(payload=p, metadata=meta) for p in payloads]


def build_reports(
    nodes: list[Node], per_task: int, rng: random.Random, start: datetime
) -> list[list[Report]]:
    owned = [[n for n in nodes if n.index % TASKS == t] for t in range(TASKS)]
    out: list[list[Report]] = []
    at = start
    for t in range(TASKS):
        reports = []
        for k in range(per_task):
            node = owned[t][k % len(owned[t])]
            at += timedelta(microseconds=997)
            reports.append(Report(node.node_id, report_events(node, rng, at)))
        out.append(reports)
    return out


def slices(reports: list[list[Report]], rounds: int) -> list[list[list[Report]]]:
    """Split every task's reports into `rounds` consecutive slices."""
    out = []
    for r in range(rounds):
        part = []
        for task in reports:
            n = len(task)
            part.append(task[r * n // rounds : (r + 1) * n // rounds])
        out.append(part)
    return out
