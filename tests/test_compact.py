"""Compact observation bodies (ledger/compact.py): exact round trips, frozen formats (the bodies of
format 1 that earlier releases wrote decode as the format 2 ones written now), the size a steady
eight-GPU snapshot costs, and the digest retention compares agreeing with PostgreSQL's."""

from __future__ import annotations

import operator
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.identity import accelerator_id_for
from collectors.observations import StorageObservation
from domain.telemetry_history import reading
from ledger.compact import (
    FORMAT_3,
    FORMAT_4,
    GPU_TELEMETRY_1,
    HOST_TELEMETRY_1,
    Dense,
    GpuSet,
    UndecodableBody,
    encode_body,
    encode_body_of,
    gpu_set,
    sampled_digest,
)
from ledger.compact_decode import decode_body
from ledger.compact_views import Values, gpu_values, host_values
from ledger.events import AcceleratorSample, EventMetadata, EventValidationError, NodeTelemetryObserved
from tests.builders import signals
from tests.compact_format_1 import encode_body_1
from tests.telemetry_support import as_reading

T0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)

names = st.one_of(
    st.sampled_from(GPU_TELEMETRY_1), st.sampled_from(HOST_TELEMETRY_1), st.text(min_size=1, max_size=12)
)
values = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    # whole KiB, MiB and 4 KiB blocks of bytes, and milliwatts as watts: what format 2 stores in units
    st.builds(operator.mul, st.integers(-(2**43), 2**43), st.sampled_from([1024, 4096, 1024 * 1024])),
    st.integers(-(10**15), 10**15).map(lambda m: m / 1000),
    st.floats(allow_nan=False),
    st.just(-0.0),
    st.text(max_size=10),
)
facts: st.SearchStrategy[Fact] = st.one_of(
    st.builds(Known, values),
    st.just(UNKNOWN),
    st.just(UNSUPPORTED),
    st.builds(Unavailable, st.text(max_size=20)),
    st.builds(TemporarilyFailed, st.text(max_size=20)),
)
groups = st.dictionaries(names, facts, max_size=14)
times = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))
gpu_uuids = st.one_of(
    st.uuids().map(lambda u: f"GPU-{u}"),
    st.uuids().map(lambda u: f"GPU-{str(u).upper()}"),
    st.text(max_size=12),
)
health = st.builds(
    AcceleratorHealthSignals,
    clock_event_reasons=groups,
    ecc_mode=facts,
    ecc_errors=groups,
    remapped_rows=groups,
    retired_pages=groups,
    pcie_replay_count=facts,
    xid_events=facts,
    xids=st.lists(st.builds(XidOccurrence, st.integers(0, 2**31), times), max_size=3),
)
samples = st.builds(
    AcceleratorSample,
    accelerator_id=st.one_of(st.uuids().map(str), st.text(max_size=12)),
    uuid=gpu_uuids,
    telemetry=groups,
    health=st.one_of(st.none(), health),
)
snapshots = st.builds(
    NodeTelemetryObserved,
    telemetry=groups,
    storage=st.lists(st.builds(StorageObservation, st.text(max_size=8), facts, facts), max_size=3),
    accelerators=st.lists(samples, max_size=9),
)
# A node's stream: its id (a UUID) as the server names it, or any text.
stream_ids = st.one_of(st.uuids().map(str), st.text(max_size=8))


@st.composite
def node_snapshots(draw: st.DrawFn) -> tuple[str, NodeTelemetryObserved]:
    """A stream and a snapshot of it, its GPUs' ids derived from the stream's id and their UUIDs
    (as the server derives them) or not."""
    stream, payload = draw(stream_ids), draw(snapshots)
    derived = [draw(st.booleans()) for _ in payload.accelerators]
    accelerators = [
        msgspec.structs.replace(a, accelerator_id=accelerator_id_for(stream, a.uuid)) if d else a
        for a, d in zip(payload.accelerators, derived, strict=True)
    ]
    return stream, msgspec.structs.replace(payload, accelerators=accelerators)


metadata = st.builds(
    EventMetadata,
    received_at=times,
    source=st.sampled_from(["local", "agent", "operator", "system"]),
    observed_at=st.one_of(st.none(), times),
    agent_stream=st.one_of(st.none(), st.sampled_from(["telemetry", "inventory"]), st.text(max_size=8)),
    agent_sequence=st.one_of(st.none(), st.integers(0, 2**62)),
    agent_sent_at=st.one_of(st.none(), times),
    agent_report_sha256=st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex), st.text()),
    agent_sequence_gap=st.one_of(st.none(), st.integers(0, 1000)),
    actor=st.one_of(
        st.none(),
        st.text(max_size=8),
        st.uuids().map(lambda u: f"credential:{u.hex}"),
        st.uuids().map(lambda u: f"credential:{u.hex.upper()}"),
    ),
    correlation_id=st.one_of(st.none(), st.text(max_size=8)),
)


def as_json(value: object) -> object:
    """What the jsonb form would hold: the comparison that sees a lost state or a changed type."""
    return msgspec.json.decode(msgspec.json.encode(value))


@settings(max_examples=300, deadline=None)
@given(node_snapshots(), metadata)
def test_every_snapshot_comes_back_exactly(
    snapshot: tuple[str, NodeTelemetryObserved], meta: EventMetadata
) -> None:
    stream, payload = snapshot
    body, decoded, decoded_meta = encode_body(payload, meta, stream)
    assert decode_body(body, stream) == (decoded, decoded_meta)
    assert decoded == payload and decoded_meta == meta
    # the same JSON an auditor reads off /events, states, types and names included
    assert as_json(decoded) == as_json(payload) and as_json(decoded_meta) == as_json(meta)
    # formats 3 and 4, the GPUs named by their index in the stored set, where it lists each GPU
    # once (4: what the GPUs after the first share with it as references)
    gpus = gpu_set(payload)
    if gpus.storable:
        once = len(payload.accelerators) == len(gpus.index)
        for form, body_n in (
            (FORMAT_3, encode_body_of(FORMAT_3, payload, meta, stream, gpus)[0]),
            (FORMAT_4, encode_body(payload, meta, stream, gpus)[0]),
        ):
            assert body_n[1] == (form if once else 2)
            assert decode_body(body_n, stream, gpus.joined) == (payload, meta)
            assert as_json(decode_body(body_n, stream, gpus.joined)) == as_json((payload, meta))


@settings(max_examples=200, deadline=None)
@given(node_snapshots(), metadata)
def test_a_snapshot_stored_in_format_1_by_an_earlier_release_reads_as_its_format_2_body(
    snapshot: tuple[str, NodeTelemetryObserved], meta: EventMetadata
) -> None:
    stream, payload = snapshot
    old = decode_body(encode_body_1(payload, meta), stream)
    assert old == decode_body(encode_body(payload, meta, stream)[0], stream) == (payload, meta)
    assert as_json(old) == as_json((payload, meta))


def rows(read: Values) -> list[tuple[int, datetime, Dense]]:
    return list(zip(read.indices, read.times, read.values, strict=True))


def expected_values(
    decoded: list[tuple[NodeTelemetryObserved, EventMetadata]], uuid: str | None, names: list[str]
) -> list[tuple[int, datetime, list[tuple[str, float | None] | None]]]:
    """What the whole decode says a history reads: each snapshot's time and the readings of the
    GPU's last entry (or the host's), the snapshots without the GPU left out."""
    out = []
    for i, (payload, meta) in enumerate(decoded):
        entries = (
            [a.telemetry for a in payload.accelerators if a.uuid == uuid]
            if uuid is not None
            else [payload.telemetry]
        )
        if entries:
            facts = entries[-1]
            at = meta.observed_at or meta.received_at
            out.append((i, at, [None if (f := facts.get(n)) is None else reading(f) for n in names]))
    return out


@settings(max_examples=200, deadline=None)
@given(stream_ids, st.lists(st.tuples(snapshots, metadata, st.sampled_from([1, 2, 3, 4])), max_size=4))
def test_a_history_reads_one_gpu_or_the_host_as_the_whole_decode_does(
    stream: str, events: list[tuple[NodeTelemetryObserved, EventMetadata, int]]
) -> None:
    # a log of every format: formats 1 to 3 of earlier releases, format 4 where its set is stored
    bodies, sets = stored_in(events, stream)
    decoded = [decode_body(b, stream, s) for b, s in zip(bodies, sets, strict=True)]
    every_gpu = {a.uuid for payload, _ in decoded for a in payload.accelerators}
    for gpu in [*sorted(every_gpu), "GPU-not-sampled"]:
        carried = [
            n for payload, _ in decoded for a in payload.accelerators if a.uuid == gpu for n in a.telemetry
        ]
        # the codebook's names as the read asks them, and names outside it too
        for names in (list(GPU_TELEMETRY_1), [*GPU_TELEMETRY_1, *carried, "never_sampled"]):
            got = [
                (i, at, [as_reading(v) for v in values])
                for i, at, values in rows(gpu_values(bodies, gpu, names, sets))
            ]
            assert got == expected_values(decoded, gpu, names)
    carried = [n for payload, _ in decoded for n in payload.telemetry]
    for names in (list(HOST_TELEMETRY_1), [*HOST_TELEMETRY_1, *carried, "never_sampled"]):
        got = [(i, at, [as_reading(v) for v in values]) for i, at, values in rows(host_values(bodies, names))]
        assert got == expected_values(decoded, None, names)


def stored_in(
    events: list[tuple[NodeTelemetryObserved, EventMetadata, int]], stream: str
) -> tuple[list[bytes], list[str | None]]:
    """Each snapshot's body in the format given (3 and 4: where it names a storable set and lists
    each GPU once, else 2) and the stored set a body of format 3 or 4 names (None for the others)."""
    bodies: list[bytes] = []
    sets: list[str | None] = []
    for payload, meta, form in events:
        gpus = gpu_set(payload)
        if form == 1:
            bodies.append(encode_body_1(payload, meta))
        else:
            named = gpus if form in (FORMAT_3, FORMAT_4) and gpus.storable else None
            bodies.append(encode_body_of(form, payload, meta, stream, named)[0])
        sets.append(gpus.joined if bodies[-1][1] in (FORMAT_3, FORMAT_4) else None)
    return bodies, sets


# How one snapshot of a node's day differs from its usual one: the GPU of the history missing,
# listed twice, listed at another index, or its UUID's bytes also held by another GPU's id.
DAY_CHANGES = ["as usual"] * 6 + ["without it", "twice", "moved", "its uuid as another's id", "nothing else"]


@settings(max_examples=150, deadline=None)
@given(
    stream_ids,
    st.lists(st.uuids().map(lambda u: f"GPU-{u}"), min_size=1, max_size=5, unique=True),
    st.data(),
    st.lists(st.tuples(st.sampled_from(DAY_CHANGES), groups, times, st.booleans()), min_size=1, max_size=12),
    st.sampled_from(["format 4", "format 3", "format 2", "format 1", "all four"]),
)
def test_a_day_of_one_nodes_snapshots_reads_as_the_whole_decode_does(
    stream: str,
    gpus: list[str],
    data: st.DataObject,
    day: list[tuple[str, dict[str, Fact], datetime, bool]],
    formats: str,
) -> None:
    gpu = data.draw(st.sampled_from(gpus))
    day_events: list[tuple[NodeTelemetryObserved, EventMetadata, int]] = []
    for k, (change, telemetry, at, observed) in enumerate(day):
        entries = [  # each GPU's facts its own: a read at the wrong index shows
            AcceleratorSample(f"a{i}", u, {**telemetry, "clock_sm_mhz": Known(i)}) for i, u in enumerate(gpus)
        ]
        mine = next(e for e in entries if e.uuid == gpu)
        if change == "without it":
            entries.remove(mine)
        elif change == "twice":
            entries.append(AcceleratorSample(accelerator_id="again", uuid=gpu, telemetry={}))
        elif change == "moved":
            entries = entries[1:] + entries[:1]
        elif change == "its uuid as another's id":
            entries.insert(0, AcceleratorSample(gpu.removeprefix("GPU-"), "GPU-x", {}))
        elif change == "nothing else":
            entries = [mine]
        meta = EventMetadata(received_at=at, source="agent", observed_at=at if observed else None)
        payload = NodeTelemetryObserved(telemetry={}, storage=[], accelerators=entries)
        form = int(formats[-1]) if formats != "all four" else 4 - k % 4
        day_events.append((payload, meta, form))
    bodies, sets = stored_in(day_events, stream)
    decoded = [decode_body(b, stream, s) for b, s in zip(bodies, sets, strict=True)]
    names = list(GPU_TELEMETRY_1)
    got = [
        (i, at, [as_reading(v) for v in values])
        for i, at, values in rows(gpu_values(bodies, gpu, names, sets))
    ]
    assert got == expected_values(decoded, gpu, names)


def steady_snapshot(gpus: int = 8) -> NodeTelemetryObserved:
    def telemetry(i: int) -> dict[str, Fact]:
        return {
            "memory_used_bytes": Known(34_046_214_144 + i),
            "memory_total_bytes": Known(85_899_345_920),
            "utilization_gpu_percent": Known(97),
            "utilization_memory_percent": Known(41),
            "temperature_celsius": Known(56 + i),
            "power_watts": Known(412.518),
            "clock_graphics_mhz": Known(1980),
            "clock_sm_mhz": Known(1980),
            "clock_memory_mhz": Known(2619),
            "fan_speed_percent": UNSUPPORTED,
            "performance_state": Known("P0"),
        }

    return NodeTelemetryObserved(
        telemetry={"memory_available_bytes": Known(1_525_290_480_117), "memory_total_bytes": Known(2**41)},
        storage=[StorageObservation("/", Known(88_046_829_568), Known(959_925_190_656))],
        accelerators=[
            AcceleratorSample(
                accelerator_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"a{i}")),
                uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'g{i}')}",
                telemetry=telemetry(i),
                health=signals(),
            )
            for i in range(gpus)
        ],
    )


STEADY_META = EventMetadata(
    received_at=T0,
    source="agent",
    observed_at=T0 - timedelta(milliseconds=40),
    agent_stream="telemetry",
    agent_sequence=8640,
    agent_sent_at=T0 - timedelta(milliseconds=20),
    agent_report_sha256="ab" * 32,
)


NODE = "6c0b2c4e-58f1-5b4d-9a51-2f3c0d7e8a19"
MIB = 1024 * 1024


def reported(gpus: int = 8) -> tuple[NodeTelemetryObserved, EventMetadata]:
    """A steady report's snapshot as the server stores it: the GPUs' ids derived from the node's,
    bytes of memory as NVML (MiB) and /proc/meminfo (KiB) count them, watts from milliwatts, the
    reporting credential as the actor."""
    base = steady_snapshot(gpus)
    payload = msgspec.structs.replace(
        base,
        telemetry={
            "memory_available_bytes": Known(1_489_541_484 * 1024),
            "memory_total_bytes": Known(2**41),
        },
        accelerators=[
            msgspec.structs.replace(
                a,
                accelerator_id=accelerator_id_for(NODE, a.uuid),
                telemetry={**a.telemetry, "memory_used_bytes": Known((32_469 + i) * MIB)},
                health=None,
            )
            for i, a in enumerate(base.accelerators)
        ],
    )
    return payload, msgspec.structs.replace(STEADY_META, actor=f"credential:{uuid.UUID(int=7).hex}")


def test_a_steady_eight_gpu_snapshot_is_a_fifth_of_its_json() -> None:
    payload = steady_snapshot()
    body, _, _ = encode_body(payload, STEADY_META, NODE)
    as_jsonb = len(msgspec.json.encode(payload)) + len(msgspec.json.encode(STEADY_META))
    # health signals included: 40 facts a GPU
    assert len(body) < 1_600 and len(body) * 5 < as_jsonb, (len(body), as_jsonb)


def test_a_steady_report_stores_two_thirds_of_what_format_1_stored() -> None:
    payload, meta = reported()
    body, _, _ = encode_body(payload, meta, NODE)
    assert decode_body(body, NODE) == (payload, meta)
    earlier = encode_body_1(payload, meta)
    assert len(body) < 560 and len(body) * 3 < len(earlier) * 2, (len(body), len(earlier))


def test_the_formats_are_frozen() -> None:
    # A stored body must decode forever: a change to the encoding of a released format fails
    # here (a new encoding takes a new format number instead).
    assert encode_body_1(steady_snapshot(1), STEADY_META).hex() == FORMAT_1_STEADY_ONE_GPU
    assert decode_body(bytes.fromhex(FORMAT_1_STEADY_ONE_GPU), NODE) == (steady_snapshot(1), STEADY_META)
    payload, meta = reported(1)
    assert encode_body(payload, meta, NODE)[0].hex() == FORMAT_2_REPORTED_ONE_GPU
    assert decode_body(bytes.fromhex(FORMAT_2_REPORTED_ONE_GPU), NODE) == (payload, meta)
    payload, meta = reported(2)
    gpus = gpu_set(payload)
    assert encode_body_of(FORMAT_3, payload, meta, NODE, gpus)[0].hex() == FORMAT_3_REPORTED_TWO_GPUS
    assert gpus.joined == FORMAT_3_REPORTED_SET
    assert decode_body(bytes.fromhex(FORMAT_3_REPORTED_TWO_GPUS), NODE, FORMAT_3_REPORTED_SET) == (
        payload,
        meta,
    )
    assert encode_body(payload, meta, NODE, gpus)[0].hex() == FORMAT_4_REPORTED_TWO_GPUS
    assert decode_body(bytes.fromhex(FORMAT_4_REPORTED_TWO_GPUS), NODE, FORMAT_3_REPORTED_SET) == (
        payload,
        meta,
    )


def test_a_steady_report_of_format_3_stores_the_gpus_uuids_once_per_set() -> None:
    payload, meta = reported()
    gpus = gpu_set(payload)
    body, _, _ = encode_body_of(FORMAT_3, payload, meta, NODE, gpus)
    format_2, _, _ = encode_body(payload, meta, NODE)
    assert decode_body(body, NODE, gpus.joined) == (payload, meta)
    # each GPU's UUID, 18 bytes (16 and their header), against its index's one
    assert len(format_2) - len(body) == 8 * 17, (len(body), len(format_2))


def test_a_body_of_format_3_without_its_set_or_with_another_is_refused_by_name() -> None:
    payload, meta = reported(2)
    gpus = gpu_set(payload)
    body, _, _ = encode_body(payload, meta, NODE, gpus)
    with pytest.raises(UndecodableBody, match="without its GPU set"):
        decode_body(body, NODE)
    with pytest.raises(UndecodableBody, match="no GPU of index 1"):
        decode_body(body, NODE, "GPU-only-one")
    with pytest.raises(UndecodableBody, match="without its GPU set"):
        gpu_values([body], payload.accelerators[0].uuid, list(GPU_TELEMETRY_1), [None])


def test_a_snapshot_listing_a_gpu_twice_or_a_set_of_other_gpus_is_stored_in_format_2() -> None:
    payload, meta = reported(2)
    twice = msgspec.structs.replace(payload, accelerators=[*payload.accelerators, payload.accelerators[0]])
    for p, gpus in (
        (twice, gpu_set(twice)),
        (payload, GpuSet(uuid.UUID(int=1), "GPU-x", {"GPU-x": 0}, True)),
    ):
        body, _, _ = encode_body(p, meta, NODE, gpus)
        assert body[1] == 2 and decode_body(body, NODE) == (p, meta)
    # a set that cannot be joined by ',' or stored as text is not named at all
    assert not gpu_set(msgspec.structs.replace(payload, accelerators=[])).storable
    for odd in ("GPU-a,b", "GPU-\x00"):
        one = AcceleratorSample(accelerator_id="a", uuid=odd, telemetry={})
        assert not gpu_set(msgspec.structs.replace(payload, accelerators=[one])).storable


FORMAT_1_STEADY_ONE_GPU = (
    "930197d6ff6b112180a56167656e74d7ffe4e1c0006b11217fa974656c656d65747279cd21c0d7ffe9a674006b11217f"
    "c420abababababababababababababababababababababababababababababababab9392cf000001632265b1f5cf0000"
    "0200000000009193a12fcf0000001480000000cf000000df800000009194c4101684789bc49e5f87aba271c94bccbf94"
    "c410fcf3eedb19f555d6a50742652e30ce549bcf00000007ed500000cf0000001400000000612938cb4079c849ba5e35"
    "3fcd07bccd07bccd0a3b9102a250309799c2c2c2c2c2c2c2c2c2a7656e61626c65649400000000940000c2c2930000c2"
    "00c3"
)
FORMAT_3_REPORTED_SET = "GPU-1684789b-c49e-5f87-aba2-71c94bccbf94,GPU-2e318d8b-9b2d-54a0-a920-ec53a4b2188e"
FORMAT_3_REPORTED_TWO_GPUS = (
    "930399d7ffe4e1c0006b11217f01cd9c4001cd21c0cd4e20c420abababababababababababababababababababababab"
    "ababababababababababc0c410000000000000000000000000000000079392ce58c8996cce800000009193a12fce0148"
    "0000ce0df800009292009bcd7ed5ce00014000612938ce00064b66cd07bccd07bccd0a3b9102a2503092019bcd7ed6ce"
    "00014000612939ce00064b66cd07bccd07bccd0a3b9102a25030"
)
FORMAT_4_REPORTED_TWO_GPUS = (
    "930499d7ffe4e1c0006b11217f01cd9c4001cd21c0cd4e20c420abababababababababababababababababababababab"
    "ababababababababababc0c410000000000000000000000000000000079392ce58c8996cce800000009193a12fce0148"
    "0000ce0df800009292009bcd7ed5612938ce00064b66cd07bccd07bc9102cd0a3bce00014000a25030920195cd7ed661"
    "293990"
)
FORMAT_2_REPORTED_ONE_GPU = (
    "930299d7ffe4e1c0006b11217f01cd9c4001cd21c0cd4e20c420abababababababababababababababababababababab"
    "ababababababababababc0c410000000000000000000000000000000079392ce58c8996cce800000009193a12fce0148"
    "0000ce0df800009192c4101684789bc49e5f87aba271c94bccbf949bcd7ed5ce00014000612938ce00064b66cd07bccd"
    "07bccd0a3b9102a25030"
)


@pytest.mark.parametrize(
    "body",
    [b"", b"\x00", bytes.fromhex("93049090"), bytes.fromhex("9302") + b"\xc1", b"{}"],
    ids=["empty", "not msgpack", "another format", "truncated", "json"],
)
def test_bytes_that_are_no_body_are_refused_by_name(body: bytes) -> None:
    with pytest.raises(UndecodableBody):
        decode_body(body, NODE)


def test_what_the_catalog_cannot_hold_is_refused_before_anything_is_stored() -> None:
    bad = NodeTelemetryObserved(telemetry={"x": Known([1, 2])}, storage=[])  # type: ignore[arg-type]
    with pytest.raises(EventValidationError):
        encode_body(bad, STEADY_META, NODE)
    for received_at in ("now", datetime(2026, 12, 3, 8, 0)):
        with pytest.raises(EventValidationError):
            encode_body(
                NodeTelemetryObserved(telemetry={}, storage=[]),
                msgspec.structs.replace(STEADY_META, received_at=received_at),
                NODE,
            )  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(gpu_uuids.filter(lambda u: "\x00" not in u)), max_size=9))
async def test_the_digest_retention_compares_is_postgresqls_of_the_same_gpus(
    pool: asyncpg.Pool, uuids: list[str]
) -> None:
    payload = NodeTelemetryObserved(
        telemetry={},
        storage=[],
        accelerators=[AcceleratorSample(accelerator_id="a", uuid=u, telemetry={}) for u in uuids],
    )
    async with pool.acquire() as conn:
        of_jsonb = await conn.fetchval(
            "SELECT mf_sampled($1::text::jsonb, NULL)", msgspec.json.encode(payload).decode()
        )
        carried = await conn.fetchval("SELECT mf_sampled(NULL, $1)", sampled_digest(payload))
    assert of_jsonb == sampled_digest(payload) == carried
    # the stored set's check computes the same digest of the joined UUIDs
    gpus = gpu_set(payload)
    if gpus.storable:
        async with pool.acquire() as conn:
            tx = conn.transaction()
            await tx.start()
            try:
                await conn.execute(
                    "INSERT INTO gpu_sets (sampled, gpus) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    gpus.sampled,
                    gpus.joined,
                )
            finally:
                await tx.rollback()
