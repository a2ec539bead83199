"""The server's one decode of an agent's report (agent/protocol.py `decode_report`): the
observation's own Structs carry the contract's bounds (collectors/contract.py), so a body an agent
sends is decoded once and checked in the same pass; any other body, and any refusal, is answered
by the wire types and the full duplicate-key check. Whatever the way, the answer is the wire
contract's: these tests hold the two ways to the same answers, value by value."""

from __future__ import annotations

import json
from datetime import timedelta, timezone
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import protocol
from agent.protocol import Report, decode_report, encode_report
from collectors.facts import Known, TemporarilyFailed, Unavailable
from collectors.gpu_health import XidOccurrence
from collectors.observations import CollectorRun
from ledger.events import NodeDiscovered, NodeTelemetryObserved, decode_payload
from tests.agent_support import report_body
from tests.builders import T0, gpu, observation, scan, signals

KEY = "decode-test-node"


def rich_body() -> bytes:
    """A report with a value in every kind of place the contract bounds: health signals with an
    XID, facts in every state, an unlisted GPU's XIDs, a failed collector."""
    gpus = [
        msgspec.structs.replace(gpu(0), health=signals(xids=[XidOccurrence(code=48, at=T0)])),
        msgspec.structs.replace(
            gpu(1, fan=Known(55.5)),
            health=signals(
                ecc_mode=Unavailable("no ECC on this board"), pcie_replay_count=TemporarilyFailed("busy")
            ),
        ),
    ]
    nvml = msgspec.structs.replace(
        scan(gpus),
        unlisted_xids={"GPU-00000000-0000-4000-8000-000000000009": [XidOccurrence(code=79, at=T0)]},
    )
    obs = msgspec.structs.replace(
        observation(nvml=nvml), collectors=[CollectorRun("nvml", False, 0.5, error="one call failed")]
    )
    return report_body(KEY, 7, obs=obs)


def whole_way(raw: bytes) -> tuple[str, Any]:
    """The answer of the wire types, the time bounds and the full duplicate-key check alone."""
    try:
        wire = protocol._wire_report_decoder.decode(raw)
        for where, moment in (
            ("$.observed_at", wire.observed_at),
            ("$.observation.observed_at", wire.observation.observed_at),
        ):
            problem = protocol.time_problem(moment)
            if problem is not None:
                raise msgspec.ValidationError(f"{problem} - at `{where}`")
        protocol.refuse_duplicate_keys(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return type(exc).__name__, str(exc)
    # What the wire accepts, the observation's types must accept too (this decode raising here
    # would be the two drifting apart).
    return "accepted", msgspec.json.decode(raw, type=Report)


def answer(raw: bytes) -> tuple[str, Any]:
    try:
        return "accepted", decode_report(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return type(exc).__name__, str(exc)


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if at else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


RICH = json.loads(rich_body())
PATHS = _paths(RICH)


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        node = node[step]
    return node


CONTAINERS = [p for p in PATHS if isinstance(_get(RICH, p), dict | list)] + [()]

_INTS = [-51, -50, -1, 0, 1, 15, 16, 100, 101, 199, 200, 201, 255, 256, 10_000, 10_001, 86_400, 86_401]
_INTS += [100_000, 100_001, 2**20, 2**20 + 1, 2**32 - 1, 2**32, 2**53 - 1, 2**53, 2**53 + 1]
_INTS += [2**60, 2**60 + 1, 2**63 - 1, 2**63]
_FLOATS = [-50.5, -50.0, 0.0, 0.5, 100.0, 100.5, 200.0, 200.5, 10_000.0, 10_000.5, 86_400.0, 86_400.5, 1e300]
_STRINGS = [
    "",
    "x",
    "P0",
    "P15",
    "P16",
    "p1",
    "enabled",
    "disabled",
    "weird",
    "known",
    "complete",
    "incomplete",
]
_STRINGS += ["unavailable", "telemetry", "inventory", "configured", "GPU-x"]
_STRINGS += ["x" * n for n in (63, 64, 65, 127, 128, 129, 255, 256, 257, 1024, 1025)]
_TIMES = ["2026-11-30T12:00:00Z", "2026-11-30T12:00:00", "1999-12-31T23:59:59Z", "2000-01-01T00:00:00Z"]
_TIMES += [
    "2100-12-31T23:59:59Z",
    "2101-01-01T00:00:00Z",
    "2026-11-30T12:00:00+15:59",
    "2026-11-30T12:00:00+16:00",
]
SCALARS = [*_INTS, *_FLOATS, *_STRINGS, *_TIMES, True, False, None]
FACTS = [{"state": "known", "value": v} for v in SCALARS] + [
    {"state": "unknown"},
    {"state": "unsupported"},
    {"state": "unavailable", "reason": "x" * 1024},
    {"state": "unavailable", "reason": "x" * 1025},
    {"state": "temporarily_failed", "reason": ""},
    {"state": "temporarily_failed"},
    {"state": "known"},
    {"state": "bogus"},
    {"state": "known", "value": 1, "extra": 2},
]
VALUES = [*SCALARS, *FACTS, [], {}, [{"code": 79, "at": "2026-11-30T12:00:00Z"}], {"x": {"state": "unknown"}}]


def _mutated(document: Any, path: tuple[Any, ...], operation: str, value: Any) -> bytes:
    doc = json.loads(json.dumps(document))
    if not path:
        doc[str(value)[:70] if operation == "add" else "extra"] = value
        return msgspec.json.encode(doc)
    parent, last = _get(doc, path[:-1]), path[-1]
    target = parent[last]
    if operation == "replace":
        parent[last] = value
    elif operation == "drop" and isinstance(parent, dict):
        del parent[last]
    elif operation == "add" and isinstance(target, dict):
        target[str(value)[:70]] = {"state": "known", "value": value} if "telemetry" in path else value
    elif operation == "key" and isinstance(target, dict):  # a new key, its value like the first's
        target[value] = next(iter(target.values()), {"state": "unknown"})
    elif operation == "lengthen" and isinstance(target, list) and target:
        target.extend([target[0]] * value)
    elif operation == "lengthen" and isinstance(target, dict) and target:  # keys of its own
        first = next(iter(target.values()))
        target.update({f"k{i}": first for i in range(value)})
    else:
        parent[last] = value
    return msgspec.json.encode(doc)


def test_every_value_in_every_place_is_answered_as_the_wire_contract_answers_it() -> None:
    """Each of the values above put in place of each value of the report, each value left out, and
    an entry added to each object: one decode or the whole way, the answer is the wire's."""
    differ = []
    for path in PATHS:
        cases = [("replace", v) for v in VALUES] + [("drop", None)]
        if isinstance(_get(RICH, path), dict):
            cases += [("add", v) for v in ("x", "x" * 65, "temperature_celsius", 5, True)]
            cases += [("key", k) for k in ("", "x", "x" * 64, "x" * 65, "x" * 128, "x" * 129, "power_watts")]
        for operation, value in cases:
            raw = _mutated(RICH, path, operation, value)
            if answer(raw) != whole_way(raw):
                differ.append((path, operation, value))
    assert differ == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    changes=st.lists(
        st.tuples(
            st.sampled_from(PATHS), st.sampled_from(["replace", "drop", "add"]), st.sampled_from(VALUES)
        ),
        min_size=2,
        max_size=4,
    )
)
def test_several_changes_at_once_are_answered_as_the_wire_contract_answers_them(
    changes: list[tuple[tuple[Any, ...], str, Any]],
) -> None:
    document = RICH
    for path, operation, value in changes:
        try:
            document = json.loads(_mutated(document, path, operation, value))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change took the place away
    raw = msgspec.json.encode(document)
    assert answer(raw) == whole_way(raw), changes


def test_a_list_or_object_at_and_past_each_bound_is_answered_as_the_wire_contract_answers_it() -> None:
    differ = []
    for path in CONTAINERS:
        size = len(_get(RICH, path))
        for bound in (8, 16, 32, 64, 256):
            for more in (bound - size, bound - size + 1):
                raw = _mutated(RICH, path, "lengthen", more) if more > 0 and path else None
                if raw is not None and answer(raw) != whole_way(raw):
                    differ.append((path, size + more))
    assert differ == []


def test_the_rich_report_is_accepted_in_one_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's body (msgspec's encoding of a Report) is decoded once: the wire types are not
    consulted at all."""
    raw = rich_body()

    class Refusing:
        def decode(self, _raw: bytes) -> Any:
            raise AssertionError("the wire types decoded an agent's body")

    monkeypatch.setattr(protocol, "_nul_free_report_decoder", Refusing())
    monkeypatch.setattr(protocol, "_wire_report_decoder", Refusing())
    report = decode_report(raw)
    assert encode_report(report) == raw
    assert report.observation.nvml.accelerators[0].health is not None
    assert report.observation.nvml.accelerators[0].health.xids == [XidOccurrence(code=48, at=T0)]


def test_what_one_decode_yields_is_the_classes_the_ledger_compares() -> None:
    """The decoded facts, OS, CPU, storage and XIDs are the very classes the ledger stores and reads
    back, so they compare equal to what a fold or a checkpoint holds."""
    report = decode_report(rich_body())
    built = observation()
    assert report.observation.host.os == built.host.os and report.observation.host.cpu == built.host.cpu
    assert report.observation.host.storage == built.host.storage
    assert report.observation.nvml.accelerators[0].name == Known("NVIDIA H200")
    stored = msgspec.json.decode(
        msgspec.json.encode(report.observation.nvml.unlisted_xids), type=dict[str, list[XidOccurrence]]
    )
    assert stored == report.observation.nvml.unlisted_xids


def test_a_duplicate_key_in_an_agent_shaped_body_is_refused() -> None:
    raw = rich_body().replace(b'"stream":"telemetry"', b'"stream":"inventory","stream":"telemetry"', 1)
    assert answer(raw) == ("ValidationError", "the key 'stream' appears twice in one object")
    assert whole_way(raw) == answer(raw)


def test_an_unknown_metric_in_an_agent_shaped_body_is_refused_with_the_wire_words() -> None:
    raw = rich_body().replace(b'"telemetry":{', b'"telemetry":{"bogus_metric":{"state":"unknown"},', 1)
    refused = answer(raw)
    assert refused[0] == "ValidationError" and "bogus_metric" in refused[1]
    assert whole_way(raw) == refused


def test_a_time_out_of_range_is_refused_on_either_way() -> None:
    late = T0.replace(year=2101)
    for at in (late, T0.replace(tzinfo=None), T0.astimezone(timezone(timedelta(hours=16)))):
        raw = rich_body().replace(msgspec.json.encode(T0), msgspec.json.encode(at), 1)
        assert answer(raw) == whole_way(raw), at


def test_what_the_ledger_stored_is_read_back_whatever_the_contract_bounds() -> None:
    """Events are read with the classes' defaults, not the agent protocol's bounds: a snapshot or a
    discovery a collector wrote with values the wire would refuse still reads back."""
    long = "x" * 2000
    over = {"state": "known", "value": 2**64}
    reason = {"state": "unavailable", "reason": long}
    health = {
        "clock_event_reasons": {long: {"state": "known", "value": 7}},
        "ecc_mode": {"state": "known", "value": "weird"},
        "ecc_errors": {"corrected_volatile": over},
        "remapped_rows": {},
        "retired_pages": {},
        "pcie_replay_count": reason,
        "xid_events": {"state": "known", "value": True},
        "xids": [{"code": 2**40, "at": "2026-11-30T12:00:00"}],
    }
    snapshot = {
        "event_type": "NODE_TELEMETRY_OBSERVED",
        "telemetry": {"bogus_metric": over},
        "storage": [{"mount": long, "used_bytes": over, "total_bytes": reason}],
        "accelerators": [
            {
                "accelerator_id": "a",
                "uuid": long,
                "telemetry": {"temperature_celsius": over},
                "health": health,
            }
        ],
    }
    payload = decode_payload(msgspec.json.encode(snapshot))
    assert isinstance(payload, NodeTelemetryObserved)
    assert payload.storage[0].mount == long and payload.accelerators[0].health is not None
    assert payload.accelerators[0].health.xids[0].code == 2**40
    discovered = {
        "event_type": "NODE_DISCOVERED",
        "node_id": "n",
        "identity_key": "k",
        "identity_source": "configured",
        "hostname": long,
        "os": {"name": reason, "version": over, "kernel": over, "architecture": over},
        "cpu": {
            "model": over,
            "sockets": {"state": "known", "value": "many"},
            "physical_cores": over,
            "logical_cores": over,
        },
        "memory_total_bytes": over,
        "driver_version": over,
        "cuda_driver_version": over,
    }
    assert isinstance(decode_payload(msgspec.json.encode(discovered)), NodeDiscovered)
