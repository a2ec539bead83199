"""Decoding a compact body of any format (ledger/compact.py lays them out): the log's row
decoder takes a snapshot whole here; a telemetry history reads only parts of many
(ledger/compact_views.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from functools import lru_cache, partial
from typing import Any

import msgspec

from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.identity import accelerator_id_for
from collectors.observations import StorageObservation
from ledger.compact import (
    ABSENT,
    CLOCK_EVENT_REASONS_1,
    CREDENTIAL_PREFIX,
    ECC_COUNTERS_1,
    FORMAT_1,
    FORMAT_2,
    FORMAT_3,
    FORMAT_4,
    GPU_LAYOUT_2,
    GPU_LAYOUT_4,
    GPU_TELEMETRY_1,
    HOST_LAYOUT_2,
    HOST_TELEMETRY_1,
    MILLI,
    NONE,
    REMAPPED_ROWS_1,
    RETIRED_PAGES_1,
    SOURCES_2,
    STORAGE_UNIT_2,
    STREAMS_2,
    TEMPORARILY_FAILED,
    UNAVAILABLE,
    UNSUPPORTED_KIND,
    VERBATIM,
    Dense,
    Layout,
    UndecodableBody,
)
from ledger.events import AcceleratorSample, EventMetadata, NodeTelemetryObserved


def _unfact(v: Any) -> Fact:
    if v is None:
        return UNKNOWN
    if type(v) is list:
        kind = v[0]
        if kind == UNSUPPORTED_KIND:
            return UNSUPPORTED
        if kind == UNAVAILABLE:
            return Unavailable(v[1])
        if kind == TEMPORARILY_FAILED:
            return TemporarilyFailed(v[1])
        raise UndecodableBody(f"unknown fact kind {kind!r}")
    return Known(v)


def from_units(v: Any, unit: int) -> Any:
    """A value at a position with a unit (format 2) as format 1 holds it."""
    t = type(v)
    if t is int:
        return v / 1000 if unit == MILLI else v << unit
    if t is list and v and v[0] == VERBATIM:
        return v[1]
    return v


def _ungroup(dense: Dense, codebook: Sequence[str]) -> dict[str, Fact]:
    out: dict[str, Fact] = {}
    extra: dict[str, Any] | None = None
    for i, v in enumerate(dense):
        if type(v) is dict:
            extra = v
            break
        if type(v) is list and v[0] == ABSENT:
            continue
        out[codebook[i]] = _unfact(v)
    if extra:
        for n, v in extra.items():
            out[n] = _unfact(v)
    return out


def _unid(value: str | bytes, prefix: str) -> str:
    if type(value) is not bytes:
        return str(value)
    if len(value) != 16:
        raise UndecodableBody(f"an id of {len(value)} bytes")
    h = value.hex()
    return f"{prefix}{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# Cached: a node's snapshots hold the same GPUs again and again (gpu_id's cache, the other way).
_gpu_uuid = lru_cache(maxsize=131_072)(partial(_unid, prefix="GPU-"))


def _ungroup_2(dense: Dense, layout: Layout) -> dict[str, Fact]:
    """`_ungroup` with units (`from_units`, inlined for the common cases)."""
    out: dict[str, Fact] = {}
    for i, v in enumerate(dense):
        t = type(v)
        if t is dict:
            for n, x in v.items():
                out[n] = _unfact(x)
            break
        name, unit, _ = layout[i]
        if v is None:
            out[name] = UNKNOWN
        elif t is list:
            kind = v[0]
            if kind == ABSENT:
                continue
            out[name] = Known(v[1]) if kind == VERBATIM and unit != NONE else _unfact(v)
        elif unit == NONE or t is not int:
            out[name] = Known(v)
        else:
            out[name] = Known(v << unit if unit > 0 else v / 1000)
    return out


def _unhealth(d: Dense) -> AcceleratorHealthSignals:
    return AcceleratorHealthSignals(
        clock_event_reasons=_ungroup(d[0], CLOCK_EVENT_REASONS_1),
        ecc_mode=_unfact(d[1]),
        ecc_errors=_ungroup(d[2], ECC_COUNTERS_1),
        remapped_rows=_ungroup(d[3], REMAPPED_ROWS_1),
        retired_pages=_ungroup(d[4], RETIRED_PAGES_1),
        pcie_replay_count=_unfact(d[5]),
        xid_events=_unfact(d[6]),
        xids=[XidOccurrence(code=x[0], at=_at(x[1])) for x in d[7]] if len(d) > 7 else [],
    )


def _at(v: Any) -> datetime:
    if type(v) is not datetime:
        raise UndecodableBody(f"expected a time, got {type(v).__name__}")
    return v


_METADATA_FIELDS = 10


def _maybe(v: Any, kind: type) -> Any:
    if v is not None and type(v) is not kind:
        raise UndecodableBody(f"expected a {kind.__name__}, got {type(v).__name__}")
    return v


_SOURCES = frozenset(SOURCES_2)


def _uncoded(v: Any, names: tuple[str, ...]) -> Any:
    if type(v) is int:
        if not 0 <= v < len(names):
            raise UndecodableBody(f"no name of index {v}")
        return names[v]
    return v


def _since(first: datetime, v: Any) -> datetime | None:
    return first + timedelta(microseconds=v) if type(v) is int else _maybe(v, datetime)


def _unmetadata(d: Dense, form: int) -> EventMetadata:
    v = list(d) + [None] * (_METADATA_FIELDS - len(d))
    received = first = _at(v[0])
    sha, actor = v[6], v[8]
    if form != FORMAT_1:
        if type(v[2]) is int:
            received, v[2] = first + timedelta(microseconds=v[2]), first
        v[1], v[3], v[5] = _uncoded(v[1], SOURCES_2), _uncoded(v[3], STREAMS_2), _since(first, v[5])
        if type(actor) is bytes:
            actor = CREDENTIAL_PREFIX + actor.hex()
    if v[1] not in _SOURCES:
        raise UndecodableBody(f"unknown source {v[1]!r}")
    return EventMetadata(
        received_at=received,
        source=v[1],
        observed_at=_maybe(v[2], datetime),
        agent_stream=_maybe(v[3], str),
        agent_sequence=_maybe(v[4], int),
        agent_sent_at=_maybe(v[5], datetime),
        agent_report_sha256=sha.hex() if type(sha) is bytes else sha,
        agent_sequence_gap=_maybe(v[7], int),
        actor=_maybe(actor, str),
        correlation_id=_maybe(v[9], str),
    )


def _storage(s: Dense, unit: int) -> StorageObservation:
    return StorageObservation(s[0], _unfact(from_units(s[1], unit)), _unfact(from_units(s[2], unit)))


def _unaccelerator_1(g: Dense) -> AcceleratorSample:
    return AcceleratorSample(
        accelerator_id=_unid(g[1], ""),
        uuid=_gpu_uuid(g[0]),
        telemetry=_ungroup(g[2], GPU_TELEMETRY_1),
        health=None if g[3] is None else _unhealth(g[3]),
    )


def _unaccelerator_2(g: Dense, node_id: str, gpu: str, layout: Layout = GPU_LAYOUT_2) -> AcceleratorSample:
    h = g[2] if len(g) > 2 else None
    given = g[3] if len(g) > 3 else None
    return AcceleratorSample(
        accelerator_id=accelerator_id_for(node_id, gpu) if given is None else _unid(given, ""),
        uuid=gpu,
        telemetry=_ungroup_2(g[1], layout),
        health=None if h is None else _unhealth(h),
    )


# Cached: a node's snapshots name the same set report after report.
@lru_cache(maxsize=16_384)
def gpu_names(joined: str) -> tuple[str, ...]:
    """A stored GPU set's UUIDs, by index (ledger/compact.py `GpuSet.joined`)."""
    return tuple(joined.split(","))


def _indexed(i: Any, names: tuple[str, ...]) -> str:
    if type(i) is not int or not 0 <= i < len(names):
        raise UndecodableBody(f"no GPU of index {i!r} in the snapshot's set")
    return names[i]


def resolved(values: Dense, first: Dense) -> Dense:
    """A GPU's telemetry values of format 4 with a reference (`[]`, last) replaced by the first
    GPU's values from its position to the end, in place (a whole body's decode and the history
    views alike)."""
    if values and type(values[-1]) is list and not values[-1]:
        i = len(values) - 1
        rest = first[i:]
        if not rest:
            raise UndecodableBody(f"a reference to the first GPU's values from {i}, which it lacks")
        values[i:] = rest
    return values


def _resolved_entries(entries: list[Dense]) -> list[Dense]:
    """Format 4's entries with their references to the first one's values and health resolved."""
    if len(entries) < 2:
        return entries
    first = entries[0]
    signals = first[2] if len(first) > 2 else None
    for entry in entries[1:]:
        resolved(entry[1], first[1])
        if len(entry) > 2 and type(entry[2]) is list and not entry[2]:
            if type(signals) is not list or not signals:
                raise UndecodableBody("a reference to the first GPU's health, which it lacks")
            entry[2] = signals
    return entries


def decode_body(
    body: bytes, stream_id: str, gpus: str | None = None
) -> tuple[NodeTelemetryObserved, EventMetadata]:
    """The payload and metadata of a stored compact body of stream `stream_id`; of format 3 with
    `gpus`, the stored set its `sampled` names (`gpu_sets.gpus`); the same for format 4."""
    try:
        doc = msgspec.msgpack.decode(body)
        if type(doc) is not list or len(doc) != 3 or doc[0] not in (FORMAT_1, FORMAT_2, FORMAT_3, FORMAT_4):
            raise UndecodableBody("not a compact body of format 1, 2, 3 or 4")
        form, m, p = doc
        host, storage, entries = p
        if form == FORMAT_1:
            payload = NodeTelemetryObserved(
                telemetry=_ungroup(host, HOST_TELEMETRY_1),
                storage=[StorageObservation(s[0], _unfact(s[1]), _unfact(s[2])) for s in storage],
                accelerators=[_unaccelerator_1(g) for g in entries],
            )
        else:
            if form == FORMAT_2:
                accelerators = [_unaccelerator_2(g, stream_id, _gpu_uuid(g[0])) for g in entries]
            elif gpus is None:
                raise UndecodableBody(f"a body of format {form} read without its GPU set")
            else:
                names = gpu_names(gpus)
                layout = GPU_LAYOUT_2
                if form == FORMAT_4:
                    entries, layout = _resolved_entries(entries), GPU_LAYOUT_4
                accelerators = [
                    _unaccelerator_2(g, stream_id, _indexed(g[0], names), layout) for g in entries
                ]
            payload = NodeTelemetryObserved(
                telemetry=_ungroup_2(host, HOST_LAYOUT_2),
                storage=[_storage(s, STORAGE_UNIT_2) for s in storage],
                accelerators=accelerators,
            )
        metadata = _unmetadata(m, form)
    except UndecodableBody:
        raise
    except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return payload, metadata
