"""The GPU health policy as data (domain/health_policy.py) and its backtest
(domain/health_backtest.py): pure, property-tested, no I/O."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.gpu_health import AcceleratorHealthSignals, XidOccurrence
from collectors.identity import NodeIdentity
from collectors.observations import AcceleratorObservation, HardwareObservation
from domain.health import judge
from domain.health_backtest import backtest, timelines, verdict_at
from domain.health_policy import (
    DEFAULT_POLICY,
    DEFAULT_POLICY_TEXT,
    HealthPolicy,
    PolicyError,
    evaluate,
    load_policy,
)
from domain.node import NodeState, evolve, node_id_for
from domain.reconcile import reconcile
from ledger.events import (
    AcceleratorHealthChanged,
    EventPayload,
    HealthPolicyApplied,
    RecordedEvent,
    event_class_of,
    event_type_of,
)
from tests.builders import T0, gpu, host, meta, pending_remap, scan, signals, uncorrected_ecc
from tests.test_health_rules import signals as any_signals
from tests.test_health_rules import xids as any_xids

IDENTITY = NodeIdentity(key="policy-node", source="configured")

XID_13_THRICE = """version = 1
name = "strict"

[[signal]]
signal = "row_remap_pending"
status = "degraded"
action = "reset_gpu"
detail = "row remapping pending"

[[xid]]
xids = [79]
status = "failed"
action = "service"
detail = "XID 79: fallen off the bus"

[[xid]]
xids = [13]
count = 3
window = "1h"
status = "degraded"
action = "reset_gpu"
detail = "XID 13 three times in an hour"
"""


def test_the_shipped_policy_is_the_rule_table() -> None:
    assert DEFAULT_POLICY.name == "default"
    assert DEFAULT_POLICY.text == DEFAULT_POLICY_TEXT
    assert len(DEFAULT_POLICY.digest) == 64
    assert {r.reason.code for r in DEFAULT_POLICY.xid_rules} >= {"xid_79", "xid_48", "xid_95"}


@given(any_signals, any_xids)
def test_the_shipped_policy_gives_the_verdicts_of_the_rule_table(
    signals_: AcceleratorHealthSignals, xids_: list[XidOccurrence]
) -> None:
    now = max([T0, *(x.at for x in xids_)])
    counted = [x for x in xids_ if now - timedelta(hours=24) < x.at <= now]
    verdict, _ = evaluate(DEFAULT_POLICY, signals_, xids_, now)
    assert verdict == judge(signals_, counted)


def occurrences(code: int, *minutes: int) -> list[XidOccurrence]:
    return [XidOccurrence(code=code, at=T0 + timedelta(minutes=m)) for m in minutes]


def test_a_windowed_count_fires_on_the_third_occurrence_within_the_window_only() -> None:
    policy = load_policy(XID_13_THRICE)
    two = occurrences(13, 0, 10)
    assert evaluate(policy, None, two, T0 + timedelta(minutes=10))[0].status == "healthy"
    three = occurrences(13, 0, 10, 50)
    verdict, evidence = evaluate(policy, None, three, T0 + timedelta(minutes=50))
    assert (verdict.status, verdict.action, [r.code for r in verdict.reasons]) == (
        "degraded",
        "reset_gpu",
        ["xid_13"],
    )
    assert evidence == three
    # An hour after the first, only two count: no reset needed, and none ever was.
    assert evaluate(policy, None, three, T0 + timedelta(minutes=60))[0].status == "healthy"
    spread = occurrences(13, 0, 61, 122)
    assert evaluate(policy, None, spread, T0 + timedelta(minutes=122))[0].status == "healthy"


def test_an_increase_of_the_lifetime_uncorrected_count_is_a_signal() -> None:
    policy = load_policy(
        'version = 1\nname = "ecc"\n\n[[signal]]\nsignal = "ecc_uncorrected_aggregate_increase"\n'
        'status = "failed"\naction = "service"\ndetail = "uncorrected ECC count grew"\n'
    )
    before = uncorrected_ecc(0)
    grown = msgspec.structs.replace(
        before,
        ecc_errors={
            **before.ecc_errors,
            "uncorrected_aggregate": uncorrected_ecc(3).ecc_errors["uncorrected_volatile"],
        },
    )
    assert evaluate(policy, grown, [], T0, before)[0].status == "failed"
    assert evaluate(policy, grown, [], T0, grown)[0].status == "healthy"
    assert evaluate(policy, grown, [], T0, None)[0].status == "healthy"


BAD = [
    (
        'version = 1\nname = "x"\n\n[[signal]]\nsignal = "vibes"\nstatus = "failed"\naction = "service"\ndetail = "d"\n',
        "line 5: signal[0].signal: unknown signal 'vibes'",
    ),
    (
        'version = 1\nname = "x"\n\n[[xid]]\nxids = [79]\nwindow = "-1h"\nstatus = "failed"\naction = "service"\ndetail = "d"\n',
        "line 6: xid[0].window: '-1h' is not a duration",
    ),
    (
        'version = 1\nname = "x"\n\n[[xid]]\nxids = [79]\nwindow = "0h"\nstatus = "failed"\naction = "service"\ndetail = "d"\n',
        "line 6: xid[0].window: must be positive",
    ),
    (
        'version = 1\nname = "x"\n\n[[xid]]\nxids = [79, 4000]\nstatus = "failed"\naction = "service"\ndetail = "d"\n',
        "line 5: xid[0].xids: XID 4000 is out of range",
    ),
    (
        'version = 1\nname = "x"\n\n[[xid]]\nxids = [79]\nstatus = "broken"\naction = "service"\ndetail = "d"\n',
        "line 6: xid[0].status: invalid enum value 'broken' (one of healthy, degraded, failed)",
    ),
    (
        'version = 1\nname = "x"\n\n[[xid]]\nxids = [79]\ncount = 3\nwindow = "2d"\nstatus = "failed"\naction = "service"\ndetail = "d"\n',
        "line 7: xid[0].window: at most 24h",
    ),
    ('version = 1\nname = "x"\ncolour = "red"\n', "line 3: colour: unknown key"),
    ("version = 1\n\n[[xid]]\nxids = [79]\n", "line 3: xid[0].status: required"),
    ('version = 1\nname = "x"\n[[xid]\n', "not TOML"),
]


@pytest.mark.parametrize(("text", "expected"), BAD)
def test_a_bad_policy_is_refused_naming_the_line_and_the_key(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as refused:
        load_policy(text)
    assert str(refused.value).startswith(expected), str(refused.value)


# --- live verdicts and the backtest --------------------------------------------------------

SIGNAL_CHOICES = [signals(), pending_remap(), uncorrected_ecc(1)]
XID_CODES = [13, 31, 48, 79, 94]


class Live:
    """The service's decide-and-fold, in memory, keeping what the log would hold."""

    def __init__(self) -> None:
        self.state = NodeState(node_id=node_id_for(IDENTITY.key))
        self.log: list[RecordedEvent] = []

    def record(self, payload: EventPayload, at: datetime) -> None:
        event = RecordedEvent(
            global_position=len(self.log) + 1,
            stream_id=self.state.node_id if not isinstance(payload, HealthPolicyApplied) else "health-policy",
            stream_version=self.state.stream_version + 1,
            event_id=uuid.uuid4(),
            event_type=event_type_of(payload),
            event_class=event_class_of(payload),
            schema_version=1,
            payload=payload,
            metadata=meta(at),
            recorded_at=at,
        )
        self.log.append(event)
        if not isinstance(payload, HealthPolicyApplied):
            self.state = evolve(self.state, event)

    def refresh(self, observation: HardwareObservation, policy: HealthPolicy) -> None:
        for p in reconcile(observation, self.state, IDENTITY, policy):
            self.record(p, observation.observed_at)


refreshes = st.lists(
    st.tuples(
        st.integers(1, 40),  # minutes since the previous refresh
        st.lists(
            st.tuples(
                st.sampled_from(range(len(SIGNAL_CHOICES))), st.lists(st.sampled_from(XID_CODES), max_size=3)
            ),
            min_size=2,
            max_size=2,
        ),
    ),
    min_size=1,
    max_size=25,
)


def gpus(at: datetime, spec: list[tuple[int, list[int]]]) -> list[AcceleratorObservation]:
    out = []
    for n, (s, codes) in enumerate(spec):
        health = msgspec.structs.replace(
            SIGNAL_CHOICES[s],
            xids=[XidOccurrence(code=c, at=at + timedelta(seconds=k + 1)) for k, c in enumerate(codes)],
        )
        out.append(msgspec.structs.replace(gpu(n), health=health))
    return out


@settings(max_examples=60, deadline=None)
@given(refreshes, st.booleans(), st.integers(0, 24))
def test_the_backtest_with_the_policy_in_force_reproduces_the_live_verdicts(
    plan: list[tuple[int, list[tuple[int, list[int]]]]], strict: bool, switch_at: int
) -> None:
    live = Live()
    policy = DEFAULT_POLICY
    at = T0
    checks: list[tuple[str, datetime, object]] = []
    for k, (minutes, spec) in enumerate(plan):
        at += timedelta(minutes=minutes)
        if strict and k == switch_at:
            policy = load_policy(XID_13_THRICE)
            live.record(HealthPolicyApplied(name=policy.name, digest=policy.digest, policy=policy.text), at)
            at += timedelta(seconds=1)
        observation = HardwareObservation(observed_at=at, host=host(), nvml=scan(gpus(at, spec)))
        live.refresh(observation, policy)
        for n, (_s, codes) in enumerate(spec):
            acc = live.state.accelerators[gpu(n).uuid]
            judged = at + timedelta(seconds=len(codes)) if codes else at
            checks.append((acc.accelerator_id, judged, acc.health))
    for event in live.log:
        if isinstance(event.payload, AcceleratorHealthChanged):
            assert event.payload.policy_digest in {DEFAULT_POLICY.digest, load_policy(XID_13_THRICE).digest}
    gpus_ = timelines(live.log, policy)
    for accelerator_id, judged, verdict in checks:
        assert verdict_at(gpus_[accelerator_id].live, judged) == verdict
    if not strict:  # the policy in force as the candidate: nothing differs
        assert backtest(live.log, DEFAULT_POLICY).differences == []


def test_the_backtest_reports_earlier_drains_under_a_stricter_policy() -> None:
    live = Live()
    at = T0
    for minutes in (0, 10, 10, 10):
        at += timedelta(minutes=minutes)
        live.refresh(
            HardwareObservation(observed_at=at, host=host(), nvml=scan(gpus(at, [(0, [13]), (0, [])]))),
            DEFAULT_POLICY,
        )
    strict = load_policy(XID_13_THRICE)
    result = backtest(live.log, strict, until=at + timedelta(hours=2))
    assert result.summary.differing == 1 and result.summary.drained_earlier == 1
    (diff,) = result.differences
    assert diff.uuid == gpu(0).uuid
    assert diff.drained_in_force_at is None
    assert diff.drained_candidate_at == T0 + timedelta(minutes=20, seconds=1)
    assert [c.status for c in diff.candidate] == ["degraded", "healthy"]
    # Back to the shipped rules: the same GPU, drained later (never).
    back = backtest(live.log, DEFAULT_POLICY)
    assert back.differences == []


def test_a_stricter_policy_judges_remembered_xids_at_the_next_report_even_without_signals() -> None:
    # Three XID 13s in ten minutes: healthy by the shipped rules. The GPU's next reports carry no
    # health signals at all (its agent lost them); under a policy that counts three XID 13s an
    # hour, the XIDs the ledger remembers degrade it at the next report, not never.
    live = Live()
    at = T0
    for minutes in (0, 5, 5):
        at += timedelta(minutes=minutes)
        live.refresh(
            HardwareObservation(observed_at=at, host=host(), nvml=scan(gpus(at, [(0, [13])]))),
            DEFAULT_POLICY,
        )
    quiet = HardwareObservation(observed_at=at + timedelta(minutes=1), host=host(), nvml=scan([gpu(0)]))
    live.refresh(quiet, DEFAULT_POLICY)
    assert live.state.accelerators[gpu(0).uuid].health.status == "healthy"
    assert len(live.state.accelerators[gpu(0).uuid].xids) == 3
    strict = load_policy(XID_13_THRICE)
    live.refresh(msgspec.structs.replace(quiet, observed_at=at + timedelta(minutes=2)), strict)
    verdict = live.state.accelerators[gpu(0).uuid].health
    assert (verdict.status, [r.code for r in verdict.reasons]) == ("degraded", ["xid_13"])


def test_a_candidate_rule_on_a_condition_never_watched_is_named_unobservable() -> None:
    candidate = load_policy(
        'version = 1\nname = "x"\n\n[[signal]]\nsignal = "retired_pages"\nat_least = 10\n'
        'status = "failed"\naction = "service"\ndetail = "ten retired pages"\n'
    )
    assert backtest([], candidate).unobservable == ["retired_pages"]
