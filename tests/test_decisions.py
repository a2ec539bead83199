"""The pure decisions, with no database: the reconciler and the node fold (`reconcile`,
`evolve`), the decommission preview and its blockers, and the agent plane's token and sequence
checks. Hypothesis drives random node histories through decide -> record -> fold in memory."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.protocol import decode_report
from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation
from domain.decommission import preview_of
from domain.node import CredentialState, NodeState, evolve, node_id_for
from domain.reconcile import reconcile
from domain.report_decisions import (
    RECENT_REPORT_DIGESTS,
    AcceptedReport,
    CredentialRefusal,
    DuplicateReport,
    ReportItem,
    SequenceConflict,
    decide_report,
    sequence_refusal,
    token_refusal,
)
from ledger.events import (
    AcceleratorDiscovered,
    AcceleratorMissing,
    HardwareChanged,
    NewEvent,
    RecordedEvent,
    WorkLeaseAcquired,
    WorkLeaseReleased,
)
from projections.agent import TokenState
from tests.agent_support import report_body
from tests.builders import T0, gpu, host, meta, scan
from tests.test_projection_property import observation_of, steps

IDENTITY = NodeIdentity(key="pure-node", source="configured")
NODE = node_id_for(IDENTITY.key)


class Log:
    """An in-memory stream: records new events as the store would, and folds them."""

    def __init__(self) -> None:
        self.state = NodeState(node_id=NODE)
        self.version = 0
        self.events: list[RecordedEvent] = []

    def append(self, events: list[NewEvent]) -> list[RecordedEvent]:
        recorded = []
        for e in events:
            self.version += 1
            r = RecordedEvent(
                global_position=self.version,
                stream_id=NODE,
                stream_version=self.version,
                event_id=e.event_id,
                event_type=e.event_type,
                event_class=e.event_class,
                schema_version=1,
                payload=e.payload,
                metadata=e.metadata,
                recorded_at=e.metadata.received_at,
            )
            self.state = evolve(self.state, r)
            recorded.append(r)
        self.events.extend(recorded)
        return recorded

    def observe(self, obs: HardwareObservation, at: datetime = T0) -> list[RecordedEvent]:
        payloads = reconcile(obs, self.state, IDENTITY)
        return self.append([NewEvent(payload=p, metadata=meta(at)) for p in payloads])


def lifecycle(events: list[RecordedEvent]) -> list[str]:
    return [e.event_type for e in events if e.event_class == "lifecycle"]


@settings(max_examples=60, deadline=None)
@given(st.lists(steps, min_size=1, max_size=10))
def test_any_history_folds_to_the_same_state_from_the_log(history: list[dict]) -> None:  # type: ignore[type-arg]
    log = Log()
    for step in history:
        log.observe(observation_of(step))
    refolded = NodeState(node_id=NODE)
    for e in log.events:
        refolded = evolve(refolded, e)
    assert refolded == log.state
    # Identities never change: one accelerator per GPU UUID ever seen, ids derived from it.
    seen = {f"GPU-00000000-0000-4000-8000-{n:012d}" for s in history for n in s["gpus"]}
    assert set(log.state.accelerators) <= seen


@settings(max_examples=60, deadline=None)
@given(st.lists(steps, min_size=1, max_size=8))
def test_observing_the_same_host_again_appends_observations_only(history: list[dict]) -> None:  # type: ignore[type-arg]
    log = Log()
    for step in history:
        log.observe(observation_of(step))
    last = observation_of(history[-1])
    fingerprint = log.state.fingerprint
    again = log.observe(last, T0 + timedelta(minutes=1))
    assert lifecycle(again) == []
    assert log.state.fingerprint == fingerprint


@settings(max_examples=60, deadline=None)
@given(first=steps, then=steps)
def test_every_node_fact_that_changes_is_recorded_as_a_hardware_change(first: dict, then: dict) -> None:  # type: ignore[type-arg]
    """Between two scans, the node's own facts (kernel, driver) that differ are named in one
    node-level HardwareChanged, and none that is the same: as an operator reads them in the audit."""
    log = Log()
    log.observe(observation_of(first))
    before = log.state
    events = log.observe(observation_of(then), T0 + timedelta(minutes=1))
    changed = {
        name
        for e in events
        if isinstance(e.payload, HardwareChanged) and e.payload.subject == "node"
        for name in e.payload.changes
    }
    scan_then = observation_of(then)
    expected = {"os.kernel"} if then["kernel"] != first["kernel"] else set()
    if then["status"] != "unavailable":
        if scan_then.nvml.driver_version != before.driver_version:
            expected.add("driver_version")
        if scan_then.nvml.cuda_driver_version != before.cuda_driver_version:
            expected.add("cuda_driver_version")
    assert changed == expected
    assert log.state.os == scan_then.host.os


@settings(max_examples=60, deadline=None)
@given(st.lists(steps, min_size=1, max_size=8))
def test_only_a_complete_enumeration_makes_a_gpu_missing(history: list[dict]) -> None:  # type: ignore[type-arg]
    log = Log()
    for step in history:
        events = log.observe(observation_of(step))
        if step["status"] != "complete":
            assert not any(isinstance(e.payload, AcceleratorMissing) for e in events)


def test_a_missing_gpu_seen_again_is_rediscovered_not_duplicated() -> None:
    log = Log()
    log.observe(HardwareObservation(observed_at=T0, host=host(), nvml=scan([gpu(0), gpu(1)])))
    gone = log.observe(HardwareObservation(observed_at=T0, host=host(), nvml=scan([gpu(0)])))
    assert lifecycle(gone) == ["ACCELERATOR_MISSING"]
    back = log.observe(HardwareObservation(observed_at=T0, host=host(), nvml=scan([gpu(0), gpu(1)])))
    found = [e.payload for e in back if isinstance(e.payload, AcceleratorDiscovered)]
    assert len(found) == 1 and found[0].rediscovered
    assert len(log.state.accelerators) == 2
    assert all(a.status == "active" for a in log.state.accelerators.values())


def lease(log: Log, lease_id: str, at: datetime, expires_at: datetime | None = None) -> None:
    log.append(
        [
            NewEvent(
                payload=WorkLeaseAcquired(lease_id=lease_id, owner="o", reason="r", expires_at=expires_at),
                metadata=meta(at, "operator"),
            )
        ]
    )


def test_preview_blockers_are_the_active_leases_and_the_digest_binds_them() -> None:
    log = Log()
    log.observe(HardwareObservation(observed_at=T0, host=host(), nvml=scan([gpu(0)])))
    now = T0 + timedelta(hours=1)
    clear = preview_of(log.state, now)
    assert clear.can_execute and clear.blockers == []
    assert preview_of(log.state, now).digest == clear.digest  # same state, same digest
    lease(log, "held", T0, None)
    lease(log, "expired", T0, T0 + timedelta(minutes=5))
    blocked = preview_of(log.state, now)
    assert [b.lease_id for b in blocked.blockers] == ["held"]
    assert not blocked.can_execute
    assert blocked.generation == clear.generation + 2
    assert blocked.digest != clear.digest
    log.append([NewEvent(payload=WorkLeaseReleased(lease_id="held"), metadata=meta(now, "operator"))])
    assert preview_of(log.state, now).can_execute


@given(st.integers(1, 50), st.integers(0, 50), st.booleans())
def test_a_sequence_is_refused_only_when_reused_with_other_content(seq: int, last: int, same: bool) -> None:
    recent = {last: "a" * 64}
    digest = "a" * 64 if same else "b" * 64
    refusal = sequence_refusal("inventory", seq, last, recent, digest)
    if seq > last or (seq == last and same):
        assert refusal is None
    else:
        assert refusal is not None and refusal.last_sequence == last and refusal.sequence == seq


AGENT_KEY = "decided-agent"


def agent_node(*, revoked: bool = False) -> NodeState:
    """A node with one credential, `c1`, of the reporting agent."""
    credential = CredentialState(
        credential_id="c1",
        identity_key=AGENT_KEY,
        hostname="h",
        secret_sha256="0" * 64,
        enrollment_token_id="t",
        issued_at=T0,
        position=1,
        revoked_at=T0 if revoked else None,
    )
    return NodeState(node_id=node_id_for(AGENT_KEY), credentials={"c1": credential})


def report_item(seq: int, digest: str) -> ReportItem:
    report = decode_report(report_body(AGENT_KEY, seq))
    return ReportItem(
        credential_id="c1",
        node_id=report.node_id,
        identity=NodeIdentity(key=AGENT_KEY, source="configured"),
        stream=report.stream,
        sequence=report.sequence,
        observed_at=report.observed_at,
        observation=report.observation,
        digest=digest,
        received_at=T0,
        sent_at=None,
    )


@given(
    st.integers(1, 40),
    st.one_of(st.none(), st.integers(1, 40)),
    st.booleans(),
    st.booleans(),
)
def test_a_report_is_refused_a_duplicate_or_accepted_on_its_nodes_state_alone(
    seq: int, last: int | None, same_content: bool, revoked: bool
) -> None:
    """decide_report (the batch's per-report decision): a revoked credential first, then the
    sequence against the stream's position, and an accepted report's events and gap."""
    digest = "d" * 64
    state = agent_node(revoked=revoked)
    item = report_item(seq, digest)
    recent = {} if last is None else {last: digest if same_content else "e" * 64}
    decision = decide_report(state, item, last, recent)
    if revoked:
        assert isinstance(decision, CredentialRefusal) and decision.problem == "credential-revoked"
    elif last is None or seq > last:
        assert isinstance(decision, AcceptedReport)
        assert decision.gap == seq - (last or 0) - 1 and decision.recent[seq] == digest
        assert decision.events and all(e.metadata.agent_sequence == seq for e in decision.events)
    elif seq == last and same_content:
        assert isinstance(decision, DuplicateReport) and decision.last == last
    else:
        assert isinstance(decision, SequenceConflict) and decision.last_sequence == last


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=60), st.data())
def test_a_stream_keeps_the_digests_of_its_last_sequences_to_answer_retries(
    steps: list[int], data: st.DataObject
) -> None:
    """Reports accepted one after another, each decision's kept digests given to the next: the
    kept digests are those of the accepted sequences within RECENT_REPORT_DIGESTS of the last;
    a retry of one of them is a duplicate with the same bytes and a conflict with others."""
    state = agent_node()
    last: int | None = None
    recent: dict[int, str] = {}
    accepted: list[int] = []
    for step in steps:
        seq = (last or 0) + step
        decision = decide_report(state, report_item(seq, f"{seq:064x}"), last, recent)
        assert isinstance(decision, AcceptedReport) and decision.last == last and decision.gap == step - 1
        gaps = {e.metadata.agent_sequence_gap for e in decision.events}
        assert gaps == {step - 1 if step > 1 else None}
        accepted.append(seq)
        last, recent = seq, decision.recent
    assert sorted(recent) == [s for s in accepted if s > accepted[-1] - RECENT_REPORT_DIGESTS]
    retried = data.draw(st.sampled_from(accepted))
    again = decide_report(state, report_item(retried, f"{retried:064x}"), last, recent)
    if retried in recent:
        assert again == DuplicateReport(last)
    else:
        assert isinstance(again, SequenceConflict) and "older than the last accepted" in again.detail
    other = decide_report(state, report_item(retried, "f" * 64), last, recent)
    assert isinstance(other, SequenceConflict) and other.sequence == retried


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.integers(1, 300), st.sampled_from(["a" * 64, "b" * 64]), max_size=50),
    st.integers(1, 120),
)
def test_an_accepted_report_keeps_exactly_the_digests_within_the_window_of_its_sequence(
    recent: dict[int, str], ahead: int
) -> None:
    """Whatever window a decision is given (a stored row's, a kept copy's, or any other), it keeps
    the digests of the sequences above its own sequence minus RECENT_REPORT_DIGESTS, and its own."""
    last = max(recent, default=0)
    seq = last + ahead
    decision = decide_report(agent_node(), report_item(seq, "c" * 64), last or None, recent)
    assert isinstance(decision, AcceptedReport)
    floor = seq - RECENT_REPORT_DIGESTS
    assert decision.recent == {**{k: v for k, v in recent.items() if k > floor}, seq: "c" * 64}
    assert decision.recent is not recent


def test_a_token_is_refused_when_revoked_expired_or_used_up() -> None:
    live = TokenState(token_id=uuid.uuid4().hex, created=True, uses=1, expires_at=T0 + timedelta(hours=1))
    assert token_refusal(live, T0) is None
    revoked = token_refusal(TokenState(**{**_fields(live), "revoked_at": T0}), T0)
    assert revoked is not None and revoked.problem == "enrollment-token-revoked"
    expired = token_refusal(live, T0 + timedelta(hours=2))
    assert expired is not None and expired.problem == "enrollment-token-expired"
    spent = token_refusal(TokenState(**{**_fields(live), "used": 1}), T0)
    assert spent is not None and spent.problem == "enrollment-token-used-up"


def _fields(state: TokenState) -> dict[str, object]:
    return {f: getattr(state, f) for f in state.__struct_fields__}
