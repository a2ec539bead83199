"""A node's checkpoint is stored in two parts (projections/framework.py `Projection.split`): what a
report changes, then the rest. Pure: any folded state comes back as it was persisted, and a
steady report changes none of the rest's bytes (so PostgreSQL logs only the first part)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from collectors.identity import NodeIdentity
from collectors.observations import StorageObservation
from domain.node import NodeState, Telemetry, node_id_for
from domain.reconcile import reconcile
from ledger.events import SCHEMA_VERSION, NewEvent, RecordedEvent
from projections.inventory import INVENTORY, InventoryProjection
from tests.builders import T0, meta
from tests.test_projection_property import histories, observation_of


def _fold(state: NodeState, identity: NodeIdentity, step: dict, n: int) -> NodeState:  # type: ignore[type-arg]
    at = T0 + timedelta(seconds=10 * n)
    for payload in reconcile(observation_of(step), state, identity):
        event = NewEvent(payload, meta(at))
        state = INVENTORY.fold(
            state,
            RecordedEvent(
                global_position=state.position + 7,
                stream_id=state.node_id,
                stream_version=state.stream_version + 1,
                event_id=uuid.uuid4(),
                event_type=event.event_type,
                event_class=event.event_class,
                schema_version=SCHEMA_VERSION,
                payload=payload,
                metadata=event.metadata,
                recorded_at=at,
            ),
        )
    return state


def _rest(raw: bytes) -> bytes:
    return raw[5 + int.from_bytes(raw[1:5], "big") :]


@settings(max_examples=60, deadline=None)
@given(history=histories, again=st.booleans())
def test_every_folded_state_decodes_from_its_split_checkpoint(history: list, again: bool) -> None:  # type: ignore[type-arg]
    states: dict[str, NodeState] = {}
    for n, (node_no, step) in enumerate(history):
        identity = NodeIdentity(key=f"split-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        before = states.get(node_id) or INVENTORY.initial(node_id)
        after = _fold(before, identity, step, n)
        raw = INVENTORY.encode_state(after)
        assert raw[:1] == b"\x02"
        assert INVENTORY.decode_state(raw) == INVENTORY.persisted(after)
        if again:  # the same scan once more: telemetry only, the rest byte for byte the same
            steady = _fold(after, identity, step, n + 1000)
            assert steady.stream_version == after.stream_version + 1
            assert _rest(INVENTORY.encode_state(steady)) == _rest(raw)
        states[node_id] = after


@settings(max_examples=30, deadline=None)
@given(history=histories)
def test_a_kept_rest_is_the_bytes_a_fresh_deflate_gives(history: list) -> None:  # type: ignore[type-arg]
    """The projection keeps the deflated rests it wrote (`Projection._deflated`): a checkpoint
    built with them is byte for byte the one a projection that keeps none builds."""
    states: dict[str, NodeState] = {}
    for n, (node_no, step) in enumerate(history):
        identity = NodeIdentity(key=f"kept-rest-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        after = _fold(states.get(node_id) or INVENTORY.initial(node_id), identity, step, n)
        for state in (after, _fold(after, identity, step, n + 1)):  # the second: the rest kept
            assert INVENTORY.encode_state(state) == InventoryProjection().encode_state(state)
        states[node_id] = after


def test_the_host_metrics_and_mounts_of_every_availability_come_back_as_they_were() -> None:
    facts: dict[str, Fact] = {
        "known": Known(3.5),
        "zero": Known(0),
        "flag": Known(False),
        "text": Known("x"),
        "unknown": UNKNOWN,
        "unsupported": UNSUPPORTED,
        "unavailable": Unavailable("no sensor"),
        "failed": TemporarilyFailed("timeout"),
    }
    state = msgspec.structs.replace(
        INVENTORY.initial("node-facts"),
        stream_version=3,
        position=9,
        host_telemetry=Telemetry(metrics=facts, observed_at=None, received_at=T0, position=9),
        storage=[
            StorageObservation("/", Known(1), Unavailable("statvfs failed")),
            StorageObservation("/data", UNKNOWN, TemporarilyFailed("slow")),
        ],
    )
    assert INVENTORY.decode_state(INVENTORY.encode_state(state)) == state
