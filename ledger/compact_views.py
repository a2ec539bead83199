"""What a telemetry history reads of thousands of compact snapshots (ledger/compact.py).

Typed views of formats 1 and 2 that decode the times and the one group of facts a history counts:
the parts in between stay undecoded (msgspec.Raw: no object for what they hold), the parts after
it are not looked at (an array_like Struct skips trailing elements), and the groups of every
snapshot are decoded together in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal, TypeAlias

import msgspec

from ledger.compact import (
    ABSENT,
    ABSENT_FACT,
    ENCODER,
    GPU_TELEMETRY_1,
    GPU_UNITS_2,
    HOST_TELEMETRY_1,
    HOST_UNITS_2,
    NONE,
    POSITIONS,
    TEMPORARILY_FAILED,
    UNAVAILABLE,
    UNSUPPORTED_KIND,
    Dense,
    UndecodableBody,
    gpu_id,
)
from ledger.compact_decode import from_units


class _Times1(msgspec.Struct, array_like=True):
    received_at: msgspec.Raw  # decoded only where observed_at is missing
    source: msgspec.Raw = msgspec.Raw(b"\xc0")
    observed_at: datetime | None = None


class _Times2(msgspec.Struct, array_like=True):
    first: datetime  # observed where the second is the received time after it, else received
    source: msgspec.Raw = msgspec.Raw(b"\xc0")
    second: int | datetime | None = None


class _Entry1(msgspec.Struct, array_like=True):
    uuid: msgspec.Raw
    accelerator_id: msgspec.Raw
    telemetry: msgspec.Raw


class _Entry2(msgspec.Struct, array_like=True):
    uuid: msgspec.Raw
    telemetry: msgspec.Raw


class _Gpus1(msgspec.Struct, array_like=True):
    host: msgspec.Raw
    storage: msgspec.Raw
    accelerators: list[_Entry1]


class _Gpus2(msgspec.Struct, array_like=True):
    host: msgspec.Raw
    storage: msgspec.Raw
    accelerators: list[_Entry2]


class _GpusView1(msgspec.Struct, array_like=True):
    format: Literal[1]
    metadata: _Times1
    payload: _Gpus1


class _GpusView2(msgspec.Struct, array_like=True):
    format: Literal[2]
    metadata: _Times2
    payload: _Gpus2


class _Host(msgspec.Struct, array_like=True):
    host: msgspec.Raw


class _HostView1(msgspec.Struct, array_like=True):
    format: Literal[1]
    metadata: _Times1
    payload: _Host


class _HostView2(msgspec.Struct, array_like=True):
    format: Literal[2]
    metadata: _Times2
    payload: _Host


_FORMAT_2 = b"\x02"  # a body's second byte: its format, after the marker of a 3-element array
_gpus_view1 = msgspec.msgpack.Decoder(_GpusView1).decode
_gpus_view2 = msgspec.msgpack.Decoder(_GpusView2).decode
_host_view1 = msgspec.msgpack.Decoder(_HostView1).decode
_host_view2 = msgspec.msgpack.Decoder(_HostView2).decode
_time = msgspec.msgpack.Decoder(datetime)
_groups = msgspec.msgpack.Decoder(list[list[Any]])
_BAD_VIEW = (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, IndexError)


def _at_of(times: _Times1 | _Times2) -> datetime:
    if type(times) is _Times1:
        return times.observed_at or _time.decode(times.received_at)
    second = times.second  # type: ignore[union-attr]
    return second if type(second) is datetime else times.first  # type: ignore[union-attr]


def _decoded(groups: list[msgspec.Raw]) -> list[Dense]:
    """Many groups at once: one msgpack array of them (array 32: a marker, the count, big-endian)."""
    return _groups.decode(b"".join([b"\xdd", len(groups).to_bytes(4, "big"), *groups]))


def _in_format_1(dense: list[Dense], of_format_2: list[int], units: Sequence[int]) -> None:
    """The groups of format 2 (their indexes) with each value of a position with a unit as
    format 1 holds it (`from_units`, inlined for the common case: an int)."""
    at = [(i, u) for i, u in enumerate(units) if u != NONE]
    for k in of_format_2:
        d = dense[k]
        n = len(d)
        for i, unit in at:
            if i >= n:
                break
            v = d[i]
            if type(v) is int:
                d[i] = v << unit if unit > 0 else v / 1000
            elif type(v) is list:
                d[i] = from_units(v, unit)
            elif type(v) is dict:
                break


def _spread(dense: Dense, codebook: Sequence[str], names: Sequence[str]) -> Dense:
    extra = dense[-1] if dense and type(dense[-1]) is dict else None
    positions = POSITIONS[codebook]
    n = len(dense) - (0 if extra is None else 1)
    out: Dense = []
    for name in names:
        i = positions.get(name)
        if i is not None and i < n:
            out.append(dense[i])
        elif extra is not None and name in extra:
            out.append(extra[name])
        else:
            out.append(ABSENT_FACT)
    return out


def _values(groups: list[Dense], codebook: Sequence[str], names: Sequence[str]) -> list[Dense]:
    """Each group as its values of `names`, one each in that order: the group itself where it
    holds the whole codebook and nothing else and `names` is the codebook."""
    if tuple(names) != codebook:
        return [_spread(d, codebook, names) for d in groups]
    whole = len(codebook)
    return [d if len(d) == whole and type(d[-1]) is not dict else _spread(d, codebook, names) for d in groups]


Values: TypeAlias = list[tuple[int, datetime, Dense]]


def gpu_key(gpu_uuid: str) -> bytes:
    """A GPU UUID as a compact body holds it, encoded."""
    return ENCODER.encode(gpu_id(gpu_uuid))


def gpu_values(bodies: Sequence[bytes], gpu_uuid: str, names: Sequence[str]) -> Values:
    """Of each compact snapshot in `bodies` that samples the GPU: its index in `bodies`, its time
    (observed, else received) and the GPU's telemetry (its last entry, as the fold takes it) as
    values of `names`, one each in that order: each fact as format 1 stores it (a scalar known,
    nil unknown, else what `value_state` tells; ABSENT where the GPU lacks the name)."""
    key = msgspec.Raw(gpu_key(gpu_uuid))
    found: list[tuple[int, datetime]] = []
    groups: list[msgspec.Raw] = []
    of_format_2: list[int] = []
    try:
        for i, body in enumerate(bodies):
            view: _GpusView1 | _GpusView2
            if body[1:2] == _FORMAT_2:
                view = _gpus_view2(body)
                two = True
            else:
                view = _gpus_view1(body)
                two = False
            group = None
            for g in view.payload.accelerators:
                if g.uuid == key:
                    group = g.telemetry
            if group is not None:
                if two:
                    of_format_2.append(len(groups))
                found.append((i, _at_of(view.metadata)))
                groups.append(group)
        dense = _decoded(groups)
        _in_format_1(dense, of_format_2, GPU_UNITS_2)
        dense = _values(dense, GPU_TELEMETRY_1, names)
    except _BAD_VIEW as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return [(i, at, d) for (i, at), d in zip(found, dense, strict=True)]


def host_values(bodies: Sequence[bytes], names: Sequence[str]) -> Values:
    """`gpu_values` of the host's telemetry, which every snapshot holds."""
    times: list[datetime] = []
    groups: list[msgspec.Raw] = []
    of_format_2: list[int] = []
    try:
        for i, body in enumerate(bodies):
            view: _HostView1 | _HostView2
            if body[1:2] == _FORMAT_2:
                view = _host_view2(body)
                of_format_2.append(i)
            else:
                view = _host_view1(body)
            times.append(_at_of(view.metadata))
            groups.append(view.payload.host)
        dense = _decoded(groups)
        _in_format_1(dense, of_format_2, HOST_UNITS_2)
        dense = _values(dense, HOST_TELEMETRY_1, names)
    except _BAD_VIEW as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return [(i, at, d) for i, (at, d) in enumerate(zip(times, dense, strict=True))]


_STATE_NAMES = {
    UNAVAILABLE: "unavailable",
    TEMPORARILY_FAILED: "temporarily_failed",
    UNSUPPORTED_KIND: "unsupported",
}


def value_state(value: object) -> str | None:
    """The availability state of a fact as stored that is not a scalar nor nil (`[kind, ...]`),
    None where it is ABSENT (the group lacks the name)."""
    if type(value) is list and value and type(kind := value[0]) is int:
        if kind == ABSENT:
            return None
        state = _STATE_NAMES.get(kind)
        if state is not None:
            return state
    raise UndecodableBody(f"not a fact of a compact body: {value!r}")
