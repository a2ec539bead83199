"""What a telemetry history reads of thousands of compact snapshots (ledger/compact.py).

Typed views of formats 1 to 4 that decode the times and the one group of facts a history counts:
the parts in between stay undecoded (msgspec.Raw: no object for what they hold), the parts after
it are not looked at (an array_like Struct skips trailing elements), and the groups of every
snapshot are decoded together in one call. The views that hold no container are not tracked by
the garbage collector (gc=False): a day of snapshots makes ~100,000 of them per read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from itertools import compress
from operator import attrgetter, itemgetter
from typing import Any, Literal

import msgspec

from ledger.compact import (
    ABSENT,
    ABSENT_FACT,
    AS_FIRST,
    ENCODER,
    FORMAT_1,
    FORMAT_2,
    FORMAT_3,
    FORMAT_4,
    GPU_TELEMETRY_1,
    GPU_TELEMETRY_4,
    GPU_UNITS_2,
    GPU_UNITS_4,
    HOST_TELEMETRY_1,
    HOST_UNITS_2,
    NONE,
    POSITIONS,
    SET_FORMATS,
    TEMPORARILY_FAILED,
    UNAVAILABLE,
    UNSUPPORTED_KIND,
    Dense,
    UndecodableBody,
    gpu_id,
)
from ledger.compact_decode import from_units, gpu_names, resolved


class _Times1(msgspec.Struct, array_like=True, gc=False):
    received_at: msgspec.Raw  # decoded only where observed_at is missing
    source: msgspec.Raw = msgspec.Raw(b"\xc0")
    observed_at: datetime | None = None


class _Times2(msgspec.Struct, array_like=True, gc=False):
    first: datetime  # observed where the second is the received time after it, else received
    source: msgspec.Raw = msgspec.Raw(b"\xc0")
    second: int | datetime | None = None


class _Entry1(msgspec.Struct, array_like=True, gc=False):
    uuid: msgspec.Raw
    accelerator_id: msgspec.Raw
    telemetry: msgspec.Raw


class _Entry2(msgspec.Struct, array_like=True, gc=False):
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


class _GpusView3(msgspec.Struct, array_like=True):
    format: Literal[3]
    metadata: _Times2
    payload: _Gpus2


class _GpusView4(msgspec.Struct, array_like=True):
    format: Literal[4]
    metadata: _Times2
    payload: _Gpus2


class _Host(msgspec.Struct, array_like=True, gc=False):
    host: msgspec.Raw


class _HostView1(msgspec.Struct, array_like=True, gc=False):
    format: Literal[1]
    metadata: _Times1
    payload: _Host


class _HostView2(msgspec.Struct, array_like=True, gc=False):
    format: Literal[2]
    metadata: _Times2
    payload: _Host


class _HostView3(msgspec.Struct, array_like=True, gc=False):
    format: Literal[3]
    metadata: _Times2
    payload: _Host


class _HostView4(msgspec.Struct, array_like=True, gc=False):
    format: Literal[4]
    metadata: _Times2
    payload: _Host


# A body's second byte is its format, after the marker of a 3-element array.
_gpus_views: dict[int, Callable[[bytes], _GpusView1 | _GpusView2 | _GpusView3 | _GpusView4]] = {
    1: msgspec.msgpack.Decoder(_GpusView1).decode,
    2: msgspec.msgpack.Decoder(_GpusView2).decode,
    3: msgspec.msgpack.Decoder(_GpusView3).decode,
    4: msgspec.msgpack.Decoder(_GpusView4).decode,
}
_host_views: dict[int, Callable[[bytes], _HostView1 | _HostView2 | _HostView3 | _HostView4]] = {
    1: msgspec.msgpack.Decoder(_HostView1).decode,
    2: msgspec.msgpack.Decoder(_HostView2).decode,
    3: msgspec.msgpack.Decoder(_HostView3).decode,
    4: msgspec.msgpack.Decoder(_HostView4).decode,
}
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


class Values(msgspec.Struct):
    """Of the snapshots that sample what a history reads, in the order given: their indices in
    the bodies read, their times and their values (one list each: no object per snapshot)."""

    indices: list[int]
    times: list[datetime]
    values: list[Dense]


def gpu_key(gpu_uuid: str) -> bytes:
    """A GPU UUID as a compact body holds it, encoded."""
    return ENCODER.encode(gpu_id(gpu_uuid))


def gpu_values(
    bodies: Sequence[bytes], gpu_uuid: str, names: Sequence[str], sets: Sequence[str | None] | None = None
) -> Values:
    """Of each compact snapshot in `bodies` that samples the GPU: its index in `bodies`, its time
    (observed, else received) and the GPU's telemetry (its last entry, as the fold takes it) as
    values of `names`, one each in that order: each fact as format 1 stores it (a scalar known,
    nil unknown, else what `value_state` tells; ABSENT where the GPU lacks the name). `sets`: of
    each body of format 3 or 4, the stored GPU set its row names (`gpu_sets.gpus`), else None.

    Every entry of the GPU holds its key: its encoded UUID (formats 1 and 2), or its index in the
    snapshot's set (formats 3 and 4, which list each GPU once). So a snapshot of format 1 or 2 without
    those bytes does not sample it, and one that holds them once and lists the GPU at some index
    lists it there only."""
    encoded = gpu_key(gpu_uuid)
    try:
        keys, held = _keys(bodies, encoded, gpu_uuid, sets)
        read = _at_one_index(bodies, held, keys) or _one_by_one(bodies, held, keys)
        dense = _decoded(read.groups)
        if read.firsts:
            _resolve_references(dense, read.firsts)
        _in_format_1(dense, read.with_units, GPU_UNITS_2)
        if read.of_format_4:
            _in_format_1(dense, read.of_format_4, GPU_UNITS_4)
            dense = _in_order_1(dense, read.of_format_4)
        dense = _values(dense, GPU_TELEMETRY_1, names)
    except _BAD_VIEW as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return Values(read.indices, read.times, dense)


def _resolve_references(dense: list[Dense], firsts: dict[int, msgspec.Raw]) -> None:
    """The groups of format 4 that end in a reference (`[]`) with the first GPU's values from
    there on (`firsts`: the first GPU's entries, by the group's index); only the entries of those
    that refer are decoded."""
    keys = list(firsts)
    tails = map(_LAST, map(dense.__getitem__, keys))
    referring = list(compress(keys, map(_REFERENCE.__eq__, tails)))
    if not referring:
        return
    for k, entry in zip(referring, _decoded([firsts[k] for k in referring]), strict=True):
        resolved(dense[k], entry[1])


_LAST = itemgetter(slice(-1, None))
_REFERENCE = [AS_FIRST]
# Format 4's codebook positions in format 1's order.
_TO_ORDER_1 = itemgetter(*(GPU_TELEMETRY_4.index(n) for n in GPU_TELEMETRY_1))
_ORDER_1_OF_4 = tuple(GPU_TELEMETRY_1.index(n) for n in GPU_TELEMETRY_4)


def _in_order_1(dense: list[Dense], of_format_4: list[int]) -> list[Dense]:
    """The groups with those of format 4 (their indexes) in format 1's codebook order: where every
    group is of format 4 and holds its whole codebook and nothing else (a node's usual day), in
    one call into C."""
    whole = len(GPU_TELEMETRY_4)
    if len(of_format_4) == len(dense) and set(map(len, dense)) == {whole}:
        if dict not in set(map(type, map(itemgetter(-1), dense))):
            return list(map(_TO_ORDER_1, dense))
    for k in of_format_4:
        d = dense[k]
        extra = d[-1] if d and type(d[-1]) is dict else None
        out: Dense = [ABSENT_FACT] * len(GPU_TELEMETRY_1)
        for j, v in enumerate(d if extra is None else d[:-1]):
            out[_ORDER_1_OF_4[j]] = v
        if extra is not None:
            out.append(extra)
        dense[k] = out
    return dense


def _keys(
    bodies: Sequence[bytes], encoded: bytes, gpu_uuid: str, sets: Sequence[str | None] | None
) -> tuple[list[msgspec.Raw], list[int]]:
    """Each body's key of the GPU (an entry of it holds that) and how many entries hold it: for
    format 1 and 2 the count of its encoded UUID's bytes, for formats 3 and 4 one where its set has it."""
    key = msgspec.Raw(encoded)
    if sets is None or all(s is None for s in sets):
        if any(body[1] in SET_FORMATS for body in bodies):
            raise UndecodableBody("a body of format 3 or 4 read without its GPU set")
        return [key] * len(bodies), [body.count(encoded) for body in bodies]
    if sets.count(sets[0]) == len(sets) and all(body[1] in SET_FORMATS for body in bodies):
        # A node's usual day: every snapshot naming one set.
        k = _key_in(sets[0], gpu_uuid)
        return [key if k is None else k] * len(bodies), [0 if k is None else 1] * len(bodies)
    keys: list[msgspec.Raw] = []
    held: list[int] = []
    of_set: dict[str | None, msgspec.Raw | None] = {}
    for body, joined in zip(bodies, sets, strict=True):
        if body[1] not in SET_FORMATS:
            keys.append(key)
            held.append(body.count(encoded))
            continue
        if joined not in of_set:
            of_set[joined] = _key_in(joined, gpu_uuid)
        k = of_set[joined]
        keys.append(key if k is None else k)
        held.append(0 if k is None else 1)
    return keys, held


def _key_in(joined: str | None, gpu_uuid: str) -> msgspec.Raw | None:
    """The GPU's key in snapshots of format 3 or 4 naming the set `joined`: its index there,
    encoded; None where the set lacks it."""
    if joined is None:
        raise UndecodableBody("a body of format 3 or 4 read without its GPU set")
    names = gpu_names(joined)
    return msgspec.Raw(ENCODER.encode(names.index(gpu_uuid))) if gpu_uuid in names else None


class _Read:
    """Of the snapshots read: their indices, times and the GPU's groups, which groups are of
    formats 2 and 3 (format 2's units) and which of format 4 (its codebook and units), and of
    format 4 past a snapshot's first GPU, that GPU's entry (what a reference names), by the
    group's index."""

    __slots__ = ("firsts", "groups", "indices", "of_format_4", "times", "with_units")

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.times: list[datetime] = []
        self.groups: list[msgspec.Raw] = []
        self.with_units: list[int] = []
        self.of_format_4: list[int] = []
        self.firsts: dict[int, msgspec.Raw] = {}

    def add(self, i: int, form: int, at: datetime, group: msgspec.Raw, first: msgspec.Raw | None) -> None:
        k = len(self.groups)
        if form in (FORMAT_2, FORMAT_3):
            self.with_units.append(k)
        elif form == FORMAT_4:
            self.of_format_4.append(k)
            if first is not None:
                self.firsts[k] = first
        self.indices.append(i)
        self.times.append(at)
        self.groups.append(group)


_ENTRY = attrgetter("payload.accelerators.entry")
_FIRST_ENTRY = attrgetter("payload.accelerators.first")
_UUID_OF = attrgetter("uuid")
_TELEMETRY = attrgetter("telemetry")
_METADATA = attrgetter("metadata")
# A view per index up to the most GPUs an agent may report; a GPU listed later is read whole.
_MOST_INDEXED = 256
_ENTRY_VIEWS: dict[tuple[int, int], Callable[[bytes], Any]] = {}


def _entry_view(form: int, index: int) -> Callable[[bytes], Any]:
    """The decoder of a view of format `form` that skips the first `index` GPU entries whole (a
    Raw each) and decodes the one after: a node lists its GPUs in the same order report after
    report, so one GPU's history is mostly read at one index, without an object per other GPU.
    Of format 4 past the first GPU, the first entry is kept too (`first`: what the entry's
    references name)."""
    decode = _ENTRY_VIEWS.get((form, index))
    if decode is None:
        if form not in (FORMAT_1, FORMAT_2, FORMAT_3, FORMAT_4):
            raise UndecodableBody(f"not a compact body of format 1 to 4: format {form}")
        skipped: list[tuple[str, Any]] = [(f"skipped_{j}", msgspec.Raw) for j in range(index)]
        if form == FORMAT_4 and index > 0:
            skipped[0] = ("first", msgspec.Raw)
        entries = msgspec.defstruct(
            f"_Entries{form}At{index}",
            [*skipped, ("entry", _Entry1 if form == 1 else _Entry2)],
            array_like=True,
            gc=False,
        )
        payload = msgspec.defstruct(
            f"_Payload{form}At{index}",
            [("host", msgspec.Raw), ("storage", msgspec.Raw), ("accelerators", entries)],
            array_like=True,
            gc=False,
        )
        view = msgspec.defstruct(
            f"_EntryView{form}At{index}",
            [
                ("format", Literal[form]),
                ("metadata", _Times1 if form == 1 else _Times2),
                ("payload", payload),
            ],
            array_like=True,
            gc=False,
        )
        decode = _ENTRY_VIEWS[form, index] = msgspec.msgpack.Decoder(view).decode
    return decode


class _TimesView(msgspec.Struct, array_like=True, gc=False):
    format: int
    metadata: _Times2


_times_view = msgspec.msgpack.Decoder(_TimesView).decode


def snapshot_times(bodies: Sequence[bytes]) -> list[datetime]:
    """Each snapshot's time as a history counts it (observed, else received), of formats 2 to 4
    (format 1's metadata is laid out otherwise: UndecodableBody)."""
    try:
        views = list(map(_times_view, bodies))
    except _BAD_VIEW as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    if any(v.format == FORMAT_1 or v.format not in _gpus_views for v in views):
        raise UndecodableBody("not a compact body of format 2 to 4")
    return list(map(_at_of, map(attrgetter("metadata"), views)))


def _format(body: bytes) -> int:
    if len(body) < 2 or body[1] not in _gpus_views:
        raise UndecodableBody("not a compact body of format 1 to 4")
    return body[1]


def _whole(
    body: bytes, key: msgspec.Raw
) -> tuple[int, _Times1 | _Times2, int | None, msgspec.Raw | None, msgspec.Raw | None]:
    """A snapshot read whole: its format, times, the GPU's last index and group, and of format 4
    past the first GPU, the first GPU's entry."""
    form = _format(body)
    view = _gpus_views[form](body)
    index, group = None, None
    entries: Sequence[_Entry1 | _Entry2] = view.payload.accelerators
    for j, g in enumerate(entries):
        if g.uuid == key:
            index, group = j, g.telemetry
    first = None
    if form == FORMAT_4 and index:
        first = msgspec.Raw(ENCODER.encode([entries[0].uuid, entries[0].telemetry]))
    return form, view.metadata, index, group, first


_FIRST, _SECOND, _OBSERVED = attrgetter("first"), attrgetter("second"), attrgetter("observed_at")


def _times_of(metadata: list[Any]) -> list[datetime]:
    """`_at_of` of many snapshots' times of one format: in a few calls into C where each has the
    time it names first (formats 2 and 3: no observed time after a received one; format 1: an
    observed time)."""
    if metadata and type(metadata[0]) is _Times2:
        if datetime not in set(map(type, map(_SECOND, metadata))):
            return list(map(_FIRST, metadata))
    elif None not in (observed := list(map(_OBSERVED, metadata))):
        return observed
    return list(map(_at_of, metadata))


def _at_one_index(bodies: Sequence[bytes], held: list[int], keys: list[msgspec.Raw]) -> _Read | None:
    """A node's usual day, every snapshot of one format listing the GPU once and at the same
    index, read in a few calls into C rather than a few lines of Python per snapshot; None for
    any other day."""
    if not bodies or held.count(1) != len(held):
        return None
    form, _, index, _, _ = _whole(bodies[0], keys[0])
    if index is None or index >= _MOST_INDEXED:
        return None
    try:
        views = list(map(_entry_view(form, index), bodies))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None  # fewer GPUs, or another format
    entries = list(map(_ENTRY, views))
    if list(map(_UUID_OF, entries)) != keys:
        return None
    read = _Read()
    every = list(range(len(bodies)))
    read.indices, read.times, read.groups = (
        every,
        _times_of(list(map(_METADATA, views))),
        list(map(_TELEMETRY, entries)),
    )
    if form in (FORMAT_2, FORMAT_3):
        read.with_units = every
    elif form == FORMAT_4:
        read.of_format_4 = every
        if index > 0:
            read.firsts = dict(enumerate(map(_FIRST_ENTRY, views)))
    return read


def _one_by_one(bodies: Sequence[bytes], held: list[int], keys: list[msgspec.Raw]) -> _Read:
    """Each snapshot that holds the GPU's key read at the index it had in the one before (read
    whole where the entry there is not the GPU's or the key occurs more than once)."""
    read = _Read()
    index = 0
    for i, body in enumerate(bodies):
        if not held[i]:
            continue
        form = _format(body)
        key = keys[i]
        if held[i] == 1:
            try:
                view = _entry_view(form, index)(body)
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass  # fewer GPUs than the index: read whole
            else:
                entry: _Entry1 | _Entry2 = view.payload.accelerators.entry
                if entry.uuid == key:
                    first = view.payload.accelerators.first if form == FORMAT_4 and index > 0 else None
                    read.add(i, form, _at_of(view.metadata), entry.telemetry, first)
                    continue
        form, metadata, last, group, first = _whole(body, key)
        if group is not None:
            read.add(i, form, _at_of(metadata), group, first)
            if last is not None and last < _MOST_INDEXED:
                index = last
    return read


def host_values(bodies: Sequence[bytes], names: Sequence[str]) -> Values:
    """`gpu_values` of the host's telemetry, which every snapshot holds."""
    times: list[datetime] = []
    groups: list[msgspec.Raw] = []
    of_format_2: list[int] = []
    try:
        for i, body in enumerate(bodies):
            form = _format(body)
            view = _host_views[form](body)
            if form != FORMAT_1:
                of_format_2.append(i)
            times.append(_at_of(view.metadata))
            groups.append(view.payload.host)
        dense = _decoded(groups)
        _in_format_1(dense, of_format_2, HOST_UNITS_2)
        dense = _values(dense, HOST_TELEMETRY_1, names)
    except _BAD_VIEW as exc:
        raise UndecodableBody(f"compact body: {exc}") from exc
    return Values(list(range(len(times))), times, dense)


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
