"""Building reports: each observation becomes the next report of its stream, written to the
durable spool before any send (docs/NODE_AGENT_PROTOCOL.md, section 10)."""

from __future__ import annotations

import hashlib

import msgspec

from agent.protocol import PROTOCOL_VERSION, Report, encode_report
from agent.spool import Spool, SpoolEntry
from agent.state import Credential, Sequences
from collectors.identity import NodeIdentity
from collectors.observations import ACCELERATOR_INVENTORY_FACTS, HardwareObservation


def inventory_signature(obs: HardwareObservation) -> str:
    """A digest of the inventory facts only (telemetry excluded): a change means a report on the
    inventory stream."""
    host, nvml = obs.host, obs.nvml
    doc = {
        "hostname": host.hostname,
        "os": host.os,
        "cpu": host.cpu,
        "memory_total_bytes": host.memory_total_bytes,
        "nvml": [nvml.status, nvml.driver_version, nvml.cuda_driver_version],
        "accelerators": [
            [a.uuid, *(getattr(a, name) for name in ACCELERATOR_INVENTORY_FACTS)]
            for a in sorted(nvml.accelerators, key=lambda a: a.uuid)
        ],
    }
    return hashlib.sha256(msgspec.json.encode(doc)).hexdigest()


class ReportWriter:
    """Numbers each observation on its stream and spools it as a report. The first report of a
    run, one whose inventory changed, and every `inventory_every`-th go on the inventory stream;
    the rest are telemetry."""

    def __init__(
        self,
        credential: Credential,
        identity: NodeIdentity,
        sequences: Sequences,
        spool: Spool,
        *,
        inventory_every: int,
    ) -> None:
        self.credential = credential
        self.identity = identity
        self.sequences = sequences
        self.spool = spool
        self.inventory_every = max(1, inventory_every)
        self.written = 0
        self._inventory_signature: str | None = None

    def stream_for(self, obs: HardwareObservation) -> str:
        signature = inventory_signature(obs)
        changed = signature != self._inventory_signature
        self._inventory_signature = signature
        return "inventory" if changed or self.written % self.inventory_every == 0 else "telemetry"

    def write(self, obs: HardwareObservation) -> SpoolEntry:
        """Spool `obs` (already sanitized) as the next report of its stream."""
        stream = self.stream_for(obs)
        order, sequence = self.sequences.allocate(stream)
        report = Report(
            protocol=PROTOCOL_VERSION,
            node_id=self.credential.node_id,
            identity_key=self.identity.key,
            identity_source=self.identity.source,
            stream=stream,
            sequence=sequence,
            observed_at=obs.observed_at,
            observation=obs,
        )
        self.spool.add(order, stream, sequence, encode_report(report))
        self.written += 1
        return SpoolEntry(order, stream, sequence, "")
