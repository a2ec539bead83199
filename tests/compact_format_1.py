"""The encoder of compact bodies of format 1, as the releases that wrote it had it: the logs they
left hold such bodies, which every later release must decode as they were (tests/test_compact.py).
The product writes format 2 (ledger/compact.py)."""

from __future__ import annotations

import re
from datetime import datetime

from ledger.compact import (
    ENCODER,
    FORMAT_1,
    GPU_TELEMETRY_1,
    HOST_TELEMETRY_1,
    Dense,
    as_id,
    fact,
    gpu_id,
    group,
    health,
    report_sha256,
)
from ledger.events import EventMetadata, NodeTelemetryObserved

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _metadata(m: EventMetadata) -> Dense:
    out: Dense = [
        m.received_at,
        m.source,
        m.observed_at,
        m.agent_stream,
        m.agent_sequence,
        m.agent_sent_at,
        report_sha256(m.agent_report_sha256),
        m.agent_sequence_gap,
        m.actor,
        m.correlation_id,
    ]
    while out and out[-1] is None:
        out.pop()
    return out


def _payload(p: NodeTelemetryObserved) -> Dense:
    return [
        group(p.telemetry, HOST_TELEMETRY_1),
        [[s.mount, fact(s.used_bytes), fact(s.total_bytes)] for s in p.storage],
        [
            [
                gpu_id(a.uuid),
                as_id(a.accelerator_id, _UUID, 0),
                group(a.telemetry, GPU_TELEMETRY_1),
                None if a.health is None else health(a.health),
            ]
            for a in p.accelerators
        ],
    ]


def encode_body_1(payload: NodeTelemetryObserved, metadata: EventMetadata) -> bytes:
    """A body of format 1 of a snapshot whose metadata has a received time."""
    assert type(metadata.received_at) is datetime
    return ENCODER.encode([FORMAT_1, _metadata(metadata), _payload(payload)])
