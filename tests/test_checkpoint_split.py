"""A node's checkpoint is stored in two parts (projections/framework.py `Projection.split`): what a
report changes, then the rest. Pure: any folded state comes back as it was persisted, and a
steady report changes none of the rest's bytes (so PostgreSQL logs only the first part)."""

from __future__ import annotations

import uuid
import zlib
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
from tests.test_projection_property import histories, observation_of, plain_step


def _fold(state: NodeState, identity: NodeIdentity, step: dict, n: int, *, whole: bool = False) -> NodeState:  # type: ignore[type-arg]
    at = T0 + timedelta(seconds=10 * n)
    fold = INVENTORY.fold_whole if whole else INVENTORY.fold
    for payload in reconcile(observation_of(step), state, identity):
        event = NewEvent(payload, meta(at))
        state = fold(
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


@settings(max_examples=60, deadline=None)
@given(history=histories)
def test_the_rows_after_a_fold_are_the_rows_built_from_the_state_it_folded(history: list) -> None:  # type: ignore[type-arg]
    """`rows_after` takes the accelerator rows of the state before wherever the fold left its
    accelerators as they were (a steady report): whatever the change, they are the rows built
    afresh."""
    states: dict[str, NodeState] = {}
    taken = 0
    for n, (node_no, step) in enumerate(history):
        identity = NodeIdentity(key=f"rows-after-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        before = states.get(node_id) or INVENTORY.initial(node_id)
        after = _fold(before, identity, step, n)
        steady = _fold(after, identity, step, n + 1000)
        for was, state in ((before, after), (after, steady)):
            old = INVENTORY.rows(was)
            rows = INVENTORY.rows_after(was, old, state)
            assert rows == INVENTORY.rows(state)
            taken += rows.get("hw_accelerators") is old.get("hw_accelerators") is not None
        states[node_id] = after
    assert taken > 0  # every history has a steady report of a discovered node


def _checkpoint(projection: InventoryProjection, node_id: str, before: NodeState, after: NodeState) -> bytes:
    """The checkpoint a folded append writes for `after` (`Projection.row_changes`)."""
    written = projection.row_changes([(node_id, projection.persisted(before), after)])
    states = written.args[3]
    assert isinstance(states, list)
    return bytes(states[0])


@settings(max_examples=60, deadline=None)
@given(history=histories)
def test_a_kept_rest_is_the_bytes_a_fresh_encoding_gives(history: list) -> None:  # type: ignore[type-arg]
    """The projection keeps each stream's last rest with its bytes (`Projection._rest_bytes`): a
    checkpoint written with them is byte for byte the one a projection that keeps none writes,
    and what it decodes to is the state folded."""
    projection = InventoryProjection()
    states: dict[str, NodeState] = {}
    for n, (node_no, step) in enumerate(history):
        identity = NodeIdentity(key=f"kept-rest-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        before = states.get(node_id) or INVENTORY.initial(node_id)
        after = _fold(before, identity, step, n)
        steady = _fold(after, identity, step, n + 1)  # its rest kept from `after`
        for was, state in ((before, after), (after, steady)):
            raw = _checkpoint(projection, node_id, was, state)
            assert raw == InventoryProjection().encode_state(state)
            assert projection.decode_state(raw) == INVENTORY.persisted(state)
        states[node_id] = after


@settings(max_examples=60, deadline=None)
@given(history=histories)
def test_a_projection_that_keeps_what_it_wrote_writes_what_one_that_keeps_nothing_writes(
    history: list,  # type: ignore[type-arg]
) -> None:
    """A folded append starts from the state its projection last checkpointed for the stream
    (the kept copy): the projection keeps that state's rows and rest (`row_changes`), and what it
    sends, rows and checkpoints, is what a projection that keeps nothing sends for the same
    change; a state it did not write (here every third) is read afresh."""
    keeping = InventoryProjection()
    kept: dict[str, NodeState] = {}
    folded: dict[str, NodeState] = {}
    for n, (node_no, step) in enumerate(history):
        identity = NodeIdentity(key=f"kept-rows-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        before = folded.get(node_id) or INVENTORY.initial(node_id)
        start = kept[node_id] if node_id in kept and n % 3 else INVENTORY.persisted(before)
        for after in (_fold(before, identity, step, n), _fold(before, identity, plain_step(temp=n), n)):
            written = keeping.row_changes([(node_id, start, after)])
            fresh = InventoryProjection().row_changes([(node_id, start, after)])
            assert (written.ops, written.args, written.expected) == (fresh.ops, fresh.args, fresh.expected)
        kept[node_id] = written.persisted[0]
        folded[node_id] = after


def test_a_rest_that_changed_is_encoded_again() -> None:
    """A kept rest is used only where the new one equals it: a change of anything in it (here a
    GPU's name, then back) is written as it is."""
    projection = InventoryProjection()
    identity = NodeIdentity(key="kept-rest-change", source="configured")
    node_id = node_id_for(identity.key)
    step = plain_step()
    first = _fold(INVENTORY.initial(node_id), identity, step, 0)
    renamed = msgspec.structs.replace(
        first,
        stream_version=first.stream_version + 1,
        accelerators={
            u: msgspec.structs.replace(a, name=Known("NVIDIA H200 renamed"))
            for u, a in first.accelerators.items()
        },
    )
    for was, state in ((INVENTORY.initial(node_id), first), (first, renamed), (renamed, first)):
        raw = _checkpoint(projection, node_id, was, state)
        assert projection.decode_state(raw) == INVENTORY.persisted(state)
        assert raw == InventoryProjection().encode_state(state)


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


@settings(max_examples=60, deadline=None)
@given(history=histories)
def test_the_projection_folds_what_its_checkpoint_keeps(history: list) -> None:  # type: ignore[type-arg]
    """`fold` leaves each GPU sample's metrics out, as the checkpoint does; `fold_whole` keeps
    them for as-of reads. Report after report, the one is the other as persisted (the decisions
    read no metric), and only the whole fold holds the metrics the reports brought."""
    slim: dict[str, NodeState] = {}
    whole: dict[str, NodeState] = {}
    for n, (node_no, step) in enumerate(history):
        identity = NodeIdentity(key=f"slim-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        initial = INVENTORY.initial(node_id)
        slim[node_id] = _fold(slim.get(node_id) or initial, identity, step, n)
        whole[node_id] = _fold(whole.get(node_id) or initial, identity, step, n, whole=True)
        assert slim[node_id] == INVENTORY.persisted(whole[node_id])
        assert INVENTORY.encode_state(slim[node_id]) == INVENTORY.encode_state(whole[node_id])
        for sample in slim[node_id].accelerator_telemetry.values():
            assert sample.metrics == {}
        for observed in observation_of(step).nvml.accelerators:
            sample = whole[node_id].accelerator_telemetry.get(observed.uuid)
            assert sample is not None and sample.metrics == observed.telemetry


def _as_version_7(state: dict) -> dict:  # type: ignore[type-arg]
    """A state's builtins as inventory version 7 kept it: each GPU's sample in its accelerator."""
    samples = state.pop("accelerator_telemetry")
    for u, a in state["accelerators"].items():
        a["telemetry"] = samples.get(u)
    return state


@settings(max_examples=40, deadline=None)
@given(history=histories)
def test_a_checkpoint_of_inventory_version_7_decodes_with_each_sample_beside_its_gpu(history: list) -> None:  # type: ignore[type-arg]
    """A read model a refused rebuild left as it was (docs/upgrades.md) is served from checkpoints
    an earlier release wrote: split ones (each GPU's sample in the first part, null in its
    accelerator) and whole ones (the sample in the accelerator) decode into the state the fold
    keeps now."""
    states: dict[str, NodeState] = {}
    for n, (node_no, step) in enumerate(history):
        identity = NodeIdentity(key=f"v7-{node_no}", source="configured")
        node_id = node_id_for(identity.key)
        state = _fold(states.get(node_id) or INVENTORY.initial(node_id), identity, step, n)
        states[node_id] = state
        kept = INVENTORY.persisted(state)
        volatile, rest = INVENTORY.split(kept)
        head = msgspec.msgpack.encode(volatile)
        old_rest = msgspec.msgpack.encode(_as_version_7(msgspec.to_builtins(rest)))
        split = b"\x02" + len(head).to_bytes(4, "big") + head + zlib.compress(old_rest, 6, -15)
        whole = b"\x01" + zlib.compress(
            msgspec.msgpack.encode(_as_version_7(msgspec.to_builtins(kept))), 1, -15
        )
        for raw in (split, whole):
            decoded = INVENTORY.decode_state(raw)
            assert decoded == kept
            assert all(a.legacy_telemetry is None for a in decoded.accelerators.values())
