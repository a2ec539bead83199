"""Compact observation bodies (ledger/compact.py): exact round trips, a frozen format, the size a
steady eight-GPU snapshot costs, and the digest retention compares agreeing with PostgreSQL's."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.observations import StorageObservation
from domain.telemetry_history import reading
from ledger.compact import (
    GPU_TELEMETRY_1,
    HOST_TELEMETRY_1,
    UndecodableBody,
    decode_body,
    encode_body,
    gpu_values,
    host_values,
    sampled_digest,
    value_state,
)
from ledger.events import AcceleratorSample, EventMetadata, EventValidationError, NodeTelemetryObserved
from tests.builders import signals

T0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)

names = st.one_of(st.sampled_from(GPU_TELEMETRY_1), st.text(min_size=1, max_size=12))
values = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
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
metadata = st.builds(
    EventMetadata,
    received_at=times,
    source=st.sampled_from(["local", "agent", "operator", "system"]),
    observed_at=st.one_of(st.none(), times),
    agent_stream=st.one_of(st.none(), st.sampled_from(["telemetry", "inventory"])),
    agent_sequence=st.one_of(st.none(), st.integers(0, 2**62)),
    agent_sent_at=st.one_of(st.none(), times),
    agent_report_sha256=st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex), st.text()),
    agent_sequence_gap=st.one_of(st.none(), st.integers(0, 1000)),
    actor=st.one_of(st.none(), st.text(max_size=8)),
    correlation_id=st.one_of(st.none(), st.text(max_size=8)),
)


def as_json(value: object) -> object:
    """What the jsonb form would hold: the comparison that sees a lost state or a changed type."""
    return msgspec.json.decode(msgspec.json.encode(value))


@settings(max_examples=300, deadline=None)
@given(snapshots, metadata)
def test_every_snapshot_comes_back_exactly(payload: NodeTelemetryObserved, meta: EventMetadata) -> None:
    body, decoded, decoded_meta = encode_body(payload, meta)
    assert decode_body(body) == (decoded, decoded_meta)
    assert decoded == payload and decoded_meta == meta
    # the same JSON an auditor reads off /events, states, types and names included
    assert as_json(decoded) == as_json(payload) and as_json(decoded_meta) == as_json(meta)


def as_reading(value: object) -> tuple[str, float | None] | None:
    """A stored fact value as a history counts it: (state, the known number), None if ABSENT."""
    if type(value) is int or type(value) is float:
        return "known", float(value)
    if type(value) is str or type(value) is bool:
        return "known", None
    if value is None:
        return "unknown", None
    state = value_state(value)
    return None if state is None else (state, None)


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
@given(st.lists(st.tuples(snapshots, metadata), max_size=4))
def test_a_history_reads_one_gpu_or_the_host_as_the_whole_decode_does(
    events: list[tuple[NodeTelemetryObserved, EventMetadata]],
) -> None:
    bodies = [encode_body(payload, meta)[0] for payload, meta in events]
    decoded = [decode_body(b) for b in bodies]
    every_gpu = {a.uuid for payload, _ in decoded for a in payload.accelerators}
    for gpu in [*sorted(every_gpu), "GPU-not-sampled"]:
        carried = [
            n for payload, _ in decoded for a in payload.accelerators if a.uuid == gpu for n in a.telemetry
        ]
        # the codebook's names as the read asks them, and names outside it too
        for names in (list(GPU_TELEMETRY_1), [*GPU_TELEMETRY_1, *carried, "never_sampled"]):
            got = [
                (i, at, [as_reading(v) for v in values]) for i, at, values in gpu_values(bodies, gpu, names)
            ]
            assert got == expected_values(decoded, gpu, names)
    carried = [n for payload, _ in decoded for n in payload.telemetry]
    for names in (list(HOST_TELEMETRY_1), [*HOST_TELEMETRY_1, *carried, "never_sampled"]):
        got = [(i, at, [as_reading(v) for v in values]) for i, at, values in host_values(bodies, names)]
        assert got == expected_values(decoded, None, names)


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


def test_a_steady_eight_gpu_snapshot_is_a_fifth_of_its_json() -> None:
    payload = steady_snapshot()
    body, _, _ = encode_body(payload, STEADY_META)
    as_jsonb = len(msgspec.json.encode(payload)) + len(msgspec.json.encode(STEADY_META))
    # health signals included: 40 facts a GPU
    assert len(body) < 1_700 and len(body) * 5 < as_jsonb, (len(body), as_jsonb)


def test_format_1_is_frozen() -> None:
    # A stored body must decode forever: a change to the encoding of format 1 fails here (a new
    # encoding takes a new format number instead).
    body, _, _ = encode_body(steady_snapshot(1), STEADY_META)
    assert body.hex() == FORMAT_1_STEADY_ONE_GPU
    assert decode_body(bytes.fromhex(FORMAT_1_STEADY_ONE_GPU))[0] == steady_snapshot(1)


FORMAT_1_STEADY_ONE_GPU = (
    "930197d6ff6b112180a56167656e74d7ffe4e1c0006b11217fa974656c656d65747279cd21c0d7ffe9a674006b11217f"
    "c420abababababababababababababababababababababababababababababababab9392cf000001632265b1f5cf0000"
    "0200000000009193a12fcf0000001480000000cf000000df800000009194c4101684789bc49e5f87aba271c94bccbf94"
    "c410fcf3eedb19f555d6a50742652e30ce549bcf00000007ed500000cf0000001400000000612938cb4079c849ba5e35"
    "3fcd07bccd07bccd0a3b9102a250309799c2c2c2c2c2c2c2c2c2a7656e61626c65649400000000940000c2c2930000c2"
    "00c3"
)


@pytest.mark.parametrize(
    "body",
    [b"", b"\x00", bytes.fromhex("93029090"), bytes.fromhex("9301") + b"\xc1", b"{}"],
    ids=["empty", "not msgpack", "another format", "truncated", "json"],
)
def test_bytes_that_are_no_body_are_refused_by_name(body: bytes) -> None:
    with pytest.raises(UndecodableBody):
        decode_body(body)


def test_what_the_catalog_cannot_hold_is_refused_before_anything_is_stored() -> None:
    bad = NodeTelemetryObserved(telemetry={"x": Known([1, 2])}, storage=[])  # type: ignore[arg-type]
    with pytest.raises(EventValidationError):
        encode_body(bad, STEADY_META)
    with pytest.raises(EventValidationError):
        encode_body(
            NodeTelemetryObserved(telemetry={}, storage=[]),
            msgspec.structs.replace(STEADY_META, received_at="now"),
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
