"""The wire contract (agent/protocol.py, docs/NODE_AGENT_PROTOCOL.md section 6 "Bounds"): what a
report may carry, refusal by refusal, without I/O. The server answering 400 with nothing appended
is tested through a real server in tests/agent_acceptance/test_bad_input.py."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from agent import protocol
from agent.protocol import (
    EnrollRequest,
    Report,
    decode_report,
    encode_report,
    observation_problems_after_decode,
    sent_at_of,
)
from agent.sanitize import sanitize_observation, validate_observation
from collectors.contract import (
    ACCELERATOR_METRIC_TYPES,
    HOST_METRIC_TYPES,
    MAX_MEMORY_BYTES,
    MAX_SEQUENCE,
    MAX_STORAGE_BYTES,
)
from collectors.facts import Known, TemporarilyFailed
from collectors.nvml import NvidiaNvmlCollector
from collectors.observations import CollectorRun, HardwareObservation
from collectors.system import SystemHostCollector
from tests.agent_support import observation, report_body
from tests.fakes.fake_pynvml import FakeNvml
from tests.fixtures_nvml import CAPTURES, multi_gpu_scenario

KEY = "protocol-test-node"


def doc() -> dict[str, Any]:
    return json.loads(report_body(KEY, 1))  # type: ignore[no-any-return]


def put(document: dict[str, Any], path: tuple[Any, ...], value: Any) -> bytes:
    target: Any = document
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return json.dumps(document).encode()


def refused(raw: bytes) -> str:
    with pytest.raises(msgspec.ValidationError) as info:
        decode_report(raw)
    return str(info.value)


HOST = ("observation", "host")
GPU0 = ("observation", "nvml", "accelerators", 0)


def test_a_report_the_agent_builds_is_accepted_unchanged() -> None:
    raw = report_body(KEY, 1, obs=observation(gpus=8))
    report = decode_report(raw)
    assert encode_report(report) == raw and validate_observation(report.observation) == []


def test_a_body_encoded_otherwise_gets_the_full_check_and_the_same_report() -> None:
    """decode_report spares the duplicate-key pass only when the body is msgspec's own encoding of
    what it decoded; an indented body (another encoder) is checked in full and means the same."""
    raw = report_body(KEY, 1, obs=observation(gpus=8))
    indented = json.dumps(json.loads(raw), indent=2).encode()
    assert indented != raw and decode_report(indented) == decode_report(raw)


def test_the_same_gpu_twice_is_what_the_server_checks_after_the_decode() -> None:
    document = doc()
    gpus = document["observation"]["nvml"]["accelerators"]
    gpus.append(gpus[0])
    report = decode_report(json.dumps(document).encode())  # every value is within the types
    problem = "nvml.accelerators: the same GPU UUID appears twice"
    assert observation_problems_after_decode(report.observation) == [problem]
    assert problem in validate_observation(report.observation)
    assert observation_problems_after_decode(decode_report(report_body(KEY, 1)).observation) == []


# --- NUL in any string ------------------------------------------------------------------------------

STRING_PATHS: list[tuple[tuple[Any, ...], Any]] = [
    (("identity_key",), lambda s: s),
    (("node_id",), lambda s: s),
    (("stream",), lambda s: s),
    ((*HOST, "hostname"), lambda s: s),
    ((*HOST, "os", "name"), lambda s: {"state": "known", "value": s}),
    ((*HOST, "os", "kernel"), lambda s: {"state": "unavailable", "reason": s}),
    ((*HOST, "cpu", "model"), lambda s: {"state": "known", "value": s}),
    ((*HOST, "storage", 0, "mount"), lambda s: s),
    ((*GPU0, "uuid"), lambda s: s),
    ((*GPU0, "name"), lambda s: {"state": "known", "value": s}),
    ((*GPU0, "pci_bus_id"), lambda s: {"state": "temporarily_failed", "reason": s}),
    (("observation", "nvml", "driver_version"), lambda s: {"state": "known", "value": s}),
    (("observation", "nvml", "reason"), lambda s: s),
]


@settings(max_examples=60)
@given(
    where=st.sampled_from(STRING_PATHS),
    before=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8),
    after=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8),
)
def test_every_string_refuses_nul(where: tuple[tuple[Any, ...], Any], before: str, after: str) -> None:
    path, shape = where
    message = refused(put(doc(), path, shape(f"{before}\x00{after}")))
    assert "regex" in message or "NUL" in message, message


def _outcome(decoder: msgspec.json.Decoder[Any], raw: bytes) -> tuple[str, Any]:
    try:
        return "decoded", msgspec.to_builtins(decoder.decode(raw))
    except msgspec.DecodeError as exc:  # a ValidationError too
        return type(exc).__name__, str(exc)


VALUE_PATHS: list[tuple[Any, ...]] = [
    *(path for path, _shape in STRING_PATHS),
    ("sequence",),
    ("observed_at",),
    (*HOST, "memory_total_bytes"),
    (*HOST, "storage", 0, "used_bytes"),
    (*GPU0, "telemetry", "temperature_celsius"),
    (*GPU0, "telemetry", "performance_state"),
    (*GPU0, "index"),
    (*GPU0, "mig_mode"),
    ("observation", "nvml", "accelerators"),
]
NUL_FREE_TEXT = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=1100
)
VALUES = st.one_of(
    NUL_FREE_TEXT,
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.fixed_dictionaries({"state": st.sampled_from(["known", "unknown", "unavailable", "x"])}),
    st.fixed_dictionaries({"state": st.just("known"), "value": st.one_of(NUL_FREE_TEXT, st.integers())}),
    st.fixed_dictionaries({"state": st.just("unavailable"), "reason": NUL_FREE_TEXT}),
)


@settings(max_examples=200)
@given(path=st.sampled_from(VALUE_PATHS), value=VALUES)
def test_a_body_without_a_nul_is_judged_alike_without_the_nul_patterns(
    path: tuple[Any, ...], value: Any
) -> None:
    """decode_report decodes a body that holds no NUL (neither raw nor as `\\u0000`) against the
    wire types with their NUL patterns left out: it must accept and refuse exactly what the full
    types do, with the same words."""
    raw = put(doc(), path, value)
    assume(b"\\u0000" not in raw)  # text that reads `\u0000` once escaped: the full types decode it
    assert _outcome(protocol._nul_free_report_decoder, raw) == _outcome(protocol._wire_report_decoder, raw)


def test_a_body_that_writes_a_nul_is_decoded_against_the_full_types() -> None:
    raw = put(doc(), (*HOST, "hostname"), "gpu\x00host")
    assert b"\\u0000" in raw
    assert "regex" in refused(raw)
    # An escaped backslash before `u0000` is text, not a NUL: the full types accept it.
    text = put(doc(), (*HOST, "hostname"), "gpu\\u0000host")
    assert b"\\\\u0000" in text
    assert decode_report(text).observation.host.hostname == "gpu\\u0000host"


@pytest.mark.parametrize(
    "where", STRING_PATHS[:5], ids=lambda w: ".".join(map(str, w[0])) if isinstance(w, tuple) else ""
)
def test_a_lone_surrogate_is_malformed_json(where: tuple[tuple[Any, ...], Any]) -> None:
    """PostgreSQL (UTF-8) cannot store half of a surrogate pair either: msgspec refuses it."""
    path, shape = where
    with pytest.raises(msgspec.DecodeError):
        decode_report(put(doc(), path, shape("a\ud800b")))


def test_a_nul_in_an_enrollment_is_refused() -> None:
    good = {"identity_key": "k", "identity_source": "configured", "hostname": "h"}
    msgspec.json.decode(json.dumps(good), type=EnrollRequest)
    for field in ("identity_key", "hostname", "agent_version"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(json.dumps({**good, field: "a\x00b"}), type=EnrollRequest)


# --- times ------------------------------------------------------------------------------------------


def test_the_issue_s_times_are_refused() -> None:
    for path in (("observed_at",), ("observation", "observed_at")):
        for moment in ("9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59"):
            assert path[-1] in refused(put(doc(), path, moment))


@given(
    year=st.one_of(st.integers(1, 1999), st.integers(2101, 9999)),
    path=st.sampled_from([("observed_at",), ("observation", "observed_at")]),
)
def test_times_outside_2000_to_2100_are_refused(year: int, path: tuple[str, ...]) -> None:
    assert "years 2000 to 2100" in refused(put(doc(), path, f"{year:04d}-06-01T00:00:00Z"))


@given(minutes=st.integers(16 * 60, 24 * 60 - 1), sign=st.sampled_from([1, -1]))
def test_utc_offsets_beyond_what_postgresql_stores_are_refused(minutes: int, sign: int) -> None:
    moment = datetime(2026, 6, 1, tzinfo=timezone(timedelta(minutes=sign * minutes))).isoformat()
    assert "UTC offset" in refused(put(doc(), ("observed_at",), moment))


@given(
    moment=st.datetimes(
        min_value=datetime(2000, 1, 2), max_value=datetime(2100, 12, 30), timezones=st.just(UTC)
    ),
    minutes=st.integers(-(16 * 60 - 1), 16 * 60 - 1),
)
def test_times_within_the_range_are_accepted(moment: datetime, minutes: int) -> None:
    local = moment.astimezone(timezone(timedelta(minutes=minutes)))
    decode_report(put(doc(), ("observed_at",), local.isoformat()))


# --- numbers, typed per metric ----------------------------------------------------------------------

BOUNDED: list[tuple[str, tuple[Any, ...], Any, Any]] = [
    # (what, path, the largest accepted value, the smallest refused one above it)
    ("host memory", (*HOST, "memory_total_bytes"), MAX_MEMORY_BYTES, MAX_MEMORY_BYTES + 1),
    ("available memory", (*HOST, "telemetry", "memory_available_bytes"), MAX_MEMORY_BYTES, 2**64 + 1),
    ("storage", (*HOST, "storage", 0, "total_bytes"), MAX_STORAGE_BYTES, MAX_STORAGE_BYTES + 1),
    ("GPU memory", (*GPU0, "memory_total_bytes"), MAX_MEMORY_BYTES, MAX_MEMORY_BYTES + 1),
    ("GPU index", (*GPU0, "index"), 255, 2**63),
    ("cores", (*HOST, "cpu", "logical_cores"), 2**20, 2**20 + 1),
    ("utilization", (*GPU0, "telemetry", "utilization_gpu_percent"), 100, 100.5),
    ("memory utilization", (*GPU0, "telemetry", "utilization_memory_percent"), 100.0, 101),
    ("fan", (*GPU0, "telemetry", "fan_speed_percent"), 200, 201),
    ("temperature", (*GPU0, "telemetry", "temperature_celsius"), 200, 10**100),
    ("power", (*GPU0, "telemetry", "power_watts"), 10_000.0, 10_000.5),
    ("graphics clock", (*GPU0, "telemetry", "clock_graphics_mhz"), 100_000, 100_001),
    ("memory clock", (*GPU0, "telemetry", "clock_memory_mhz"), 0, -1),
]


@pytest.mark.parametrize(("what", "path", "largest", "beyond"), BOUNDED, ids=[b[0] for b in BOUNDED])
def test_numbers_have_bounds(what: str, path: tuple[Any, ...], largest: Any, beyond: Any) -> None:
    decode_report(put(doc(), path, {"state": "known", "value": largest}))
    assert "value" in refused(put(doc(), path, {"state": "known", "value": beyond})), what


@settings(max_examples=80)
@given(
    path=st.sampled_from([b[1] for b in BOUNDED]),
    value=st.one_of(st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=2), st.none()),
)
def test_a_number_is_never_a_bool_a_string_a_list_or_null(path: tuple[Any, ...], value: Any) -> None:
    refused(put(doc(), path, {"state": "known", "value": value}))


@given(value=st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.booleans()))
def test_a_string_fact_is_never_a_number(value: Any) -> None:
    refused(put(doc(), (*GPU0, "name"), {"state": "known", "value": value}))


def test_enumerated_facts_and_metric_names() -> None:
    for path, value in (
        ((*GPU0, "mig_mode"), "maybe"),
        ((*GPU0, "telemetry", "performance_state"), "P16"),
        ((*GPU0, "telemetry", "performance_state"), 3),
    ):
        refused(put(doc(), path, {"state": "known", "value": value}))
    decode_report(put(doc(), (*GPU0, "telemetry", "performance_state"), {"state": "known", "value": "P15"}))
    refused(put(doc(), (*GPU0, "telemetry", "joy_percent"), {"state": "known", "value": 1}))
    refused(put(doc(), (*HOST, "telemetry", "memory_available_bytes"), None))
    assert set(HOST_METRIC_TYPES) and set(ACCELERATOR_METRIC_TYPES) >= {"power_watts", "memory_used_bytes"}


def test_sequences_stay_below_2_to_the_53() -> None:
    decode_report(put(doc(), ("sequence",), MAX_SEQUENCE))
    for bad in (MAX_SEQUENCE + 1, 2**63 - 1, 0, True, 1.0):
        assert "sequence" in refused(put(doc(), ("sequence",), bad))


# --- duplicate keys -----------------------------------------------------------------------------------


def _objects(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    """(path of an object, one of its keys) for every key of every object in a document."""
    found: list[tuple[tuple[Any, ...], str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.append((path, key))
            found += _objects(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _objects(value, (*path, i))
    return found


def _dumps_twice(node: Any, target: tuple[Any, ...], key: str, path: tuple[Any, ...] = ()) -> str:
    """JSON of `node` with `key` of the object at `target` written twice, same value both times."""
    if isinstance(node, dict):
        pairs = [f"{json.dumps(k)}:{_dumps_twice(v, target, key, (*path, k))}" for k, v in node.items()]
        if path == target:
            pairs.append(f"{json.dumps(key)}:{_dumps_twice(node[key], target, key, (*path, key))}")
        return "{" + ",".join(pairs) + "}"
    if isinstance(node, list):
        return "[" + ",".join(_dumps_twice(v, target, key, (*path, i)) for i, v in enumerate(node)) + "]"
    return json.dumps(node)


@settings(max_examples=40)
@given(data=st.data())
def test_a_duplicate_key_anywhere_is_refused(data: st.DataObject) -> None:
    document = doc()
    target, key = data.draw(st.sampled_from(_objects(document)))
    duplicated = _dumps_twice(document, target, key)
    assert json.loads(duplicated) == document  # the same document to a last-key-wins reader
    assert f"{key!r} appears twice" in refused(duplicated.encode())


# --- the agent's side: whatever a sensor says, the report goes through ----------------------------------

GARBAGE = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.booleans(),
    st.text(max_size=20),
)


@settings(max_examples=60)
@given(
    host_values=st.dictionaries(st.sampled_from(sorted(HOST_METRIC_TYPES)), GARBAGE),
    gpu_values=st.dictionaries(
        st.sampled_from([*sorted(ACCELERATOR_METRIC_TYPES), "made_up_metric"]), GARBAGE
    ),
    index=GARBAGE,
    hostname=st.one_of(st.text(min_size=1, max_size=20), st.just("gpu\x00\udc80host")),
    odd_text=st.text(max_size=12).map(lambda t: t + "\x00\udcff"),
)
def test_sanitize_turns_any_reading_into_a_report_the_server_accepts(
    host_values: dict[str, Any], gpu_values: dict[str, Any], index: Any, hostname: str, odd_text: str
) -> None:
    obs = observation()
    gpu0 = msgspec.structs.replace(
        obs.nvml.accelerators[0],
        index=Known(index),
        telemetry={name: Known(value) for name, value in gpu_values.items()},
    )
    host = msgspec.structs.replace(
        obs.host,
        hostname=hostname,
        telemetry={name: Known(value) for name, value in host_values.items()},
        storage=[msgspec.structs.replace(obs.host.storage[0], mount="/mnt/" + odd_text)],
        os=msgspec.structs.replace(obs.host.os, name=Known(odd_text)),
    )
    dirty = msgspec.structs.replace(
        obs,
        host=host,
        nvml=msgspec.structs.replace(
            obs.nvml, accelerators=[gpu0, *obs.nvml.accelerators[1:]], reason=odd_text
        ),
        collectors=[
            CollectorRun("nvml", False, -1.0, odd_text),
            CollectorRun("system" + odd_text, True, 0.1),
        ],
    )
    clean = sanitize_observation(dirty)
    assert validate_observation(clean) == []
    raw = encode_report(
        Report(
            protocol=1,
            node_id="n",
            identity_key=KEY,
            identity_source="configured",
            stream="telemetry",
            sequence=1,
            observed_at=clean.observed_at,
            observation=clean,
        )
    )
    decoded = decode_report(raw)
    # A good reading is kept as it was; a bad one becomes temporarily_failed, never a substitute.
    for name, value in gpu_values.items():
        if name == "made_up_metric":
            assert name not in decoded.observation.nvml.accelerators[0].telemetry
            continue
        fact = decoded.observation.nvml.accelerators[0].telemetry[name]
        ok = msgspec.convert(value, ACCELERATOR_METRIC_TYPES[name]) if _fits(value, name) else None
        if ok is not None:
            assert fact == Known(value) or (isinstance(value, float) and math.isclose(fact.value, value))  # type: ignore[union-attr]
        else:
            assert isinstance(fact, TemporarilyFailed) and "invalid reading" in fact.reason


def _fits(value: Any, name: str) -> bool:
    try:
        msgspec.convert(value, ACCELERATOR_METRIC_TYPES[name])
    except msgspec.ValidationError:
        return False
    return True


@pytest.mark.parametrize("capture", sorted(CAPTURES))
def test_the_real_collectors_report_within_the_contract(capture: str, tmp_path: Path) -> None:
    """Real captures of NVML and this machine's own host facts: nothing is out of bounds, so
    sanitize changes nothing."""
    scans = [
        NvidiaNvmlCollector(nvml=FakeNvml(CAPTURES[capture]()), timeout_seconds=5).collect(),
        NvidiaNvmlCollector(nvml=FakeNvml(multi_gpu_scenario(8)), timeout_seconds=5).collect(),
    ]
    host = SystemHostCollector(tmp_path, Path("/"), timeout_seconds=10).collect()
    for scan in scans:
        obs = HardwareObservation(observed_at=datetime.now(UTC), host=host, nvml=scan)
        assert validate_observation(obs) == []
        assert sanitize_observation(obs) == obs


def health_doc() -> dict[str, Any]:
    """A report whose GPU was read by the collector, health signals included."""
    collector = NvidiaNvmlCollector(nvml=FakeNvml(multi_gpu_scenario(1)), timeout_seconds=5)
    try:
        obs = observation(gpus=0)
        obs = HardwareObservation(observed_at=obs.observed_at, host=obs.host, nvml=collector.collect())
    finally:
        collector.close()
    return json.loads(report_body(KEY, 1, obs=obs))  # type: ignore[no-any-return]


def test_health_signals_and_xids_of_an_unlisted_gpu_cross_the_wire() -> None:
    document = health_doc()
    health = document["observation"]["nvml"]["accelerators"][0]["health"]
    assert health["ecc_mode"] == {"state": "known", "value": "enabled"}
    health["xids"] = [{"code": 48, "at": "2026-11-30T12:00:00Z"}]
    lost = [{"code": 79, "at": "2026-11-30T12:00:01Z"}]
    report = decode_report(put(document, ("observation", "nvml", "unlisted_xids"), {"GPU-lost": lost}))
    gpu = report.observation.nvml.accelerators[0]
    assert gpu.health is not None and [x.code for x in gpu.health.xids] == [48]
    assert [x.code for x in report.observation.nvml.unlisted_xids["GPU-lost"]] == [79]
    # Out of the contract: a negative XID code, a count that is text, too many XIDs.
    assert "code" in refused(
        put(
            health_doc(),
            ("observation", "nvml", "unlisted_xids"),
            {"GPU-lost": [{"code": -1, "at": lost[0]["at"]}]},
        )
    )
    bad = health_doc()
    bad["observation"]["nvml"]["accelerators"][0]["health"]["pcie_replay_count"] = {
        "state": "known",
        "value": "7",
    }
    assert "pcie_replay_count" in refused(json.dumps(bad).encode())
    assert "xids" in refused(put(health_doc(), (*GPU0, "health", "xids"), lost * 257))
    # An agent that collects no health signals still reports within the contract.
    old = health_doc()
    del old["observation"]["nvml"]["accelerators"][0]["health"]
    assert decode_report(json.dumps(old).encode()).observation.nvml.accelerators[0].health is None


def test_the_send_time_header_is_read_only_as_an_aware_time() -> None:
    """Advisory: a send time without a UTC offset or not a time at all is dropped, not refused."""
    assert sent_at_of("2026-12-05T03:10:11.5+01:00") == datetime(2026, 12, 5, 2, 10, 11, 500000, tzinfo=UTC)
    assert sent_at_of("2026-12-05T03:10:11") is None
    assert sent_at_of("yesterday") is None
    assert sent_at_of("") is None
    assert sent_at_of(None) is None
