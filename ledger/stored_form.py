"""How the log stores an event: its jsonb (data and metadata) or its compact body, validated
before anything is sent (docs/storage.md). The store sends what this gives `mf_append_many`."""

from __future__ import annotations

import uuid
from typing import NamedTuple

from ledger.compact import GpuSet, encode_body, gpu_set
from ledger.events import (
    EventMetadata,
    EventPayload,
    NewEvent,
    NodeTelemetryObserved,
    validate_metadata,
    validate_payload,
)


class StoredForm(NamedTuple):
    """An event as validated for the log: its jsonb (data, metadata) or its compact body (with
    the digest of the GPUs it samples), and the payload and metadata decoded back from them."""

    data: bytes | None
    metadata_json: bytes | None
    body: bytes | None
    sampled: uuid.UUID | None
    payload: EventPayload
    metadata: EventMetadata


def stored_form(
    event: NewEvent, stream_id: str, usable: set[uuid.UUID] | None = None, *, gpus: GpuSet | None = None
) -> StoredForm:
    """How the log stores an event of stream `stream_id` (what mf_append_many takes for it),
    validated: a snapshot whose GPU set is `usable` (stored: ledger/gpu_sets.py) in format 4.
    `gpus`: the snapshot's set (`gpu_set`) where the caller has it already."""
    if isinstance(event.payload, NodeTelemetryObserved):
        gpus = gpus or gpu_set(event.payload)
        named = gpus if usable is not None and gpus.sampled in usable else None
        body, payload, meta = encode_body(event.payload, event.metadata, stream_id, named)
        return StoredForm(None, None, body, gpus.sampled, payload, meta)
    data, payload = validate_payload(event.payload)
    metadata_json, meta = validate_metadata(event.metadata)
    return StoredForm(data, metadata_json, None, None, payload, meta)
