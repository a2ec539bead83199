"""Backtest a GPU health policy on the log: pure, `backtest(events, candidate, since)`.

The input is the log's health history in commit order (ACCELERATOR_DISCOVERED,
ACCELERATOR_XID_OBSERVED, ACCELERATOR_HEALTH_CHANGED, HEALTH_POLICY_APPLIED). Both the policy in
force (as it changed over time) and the candidate are evaluated the same way, at the same
moments: every GPU event, every moment an XID stops counting under either policy's windows, and
every change of policy. XIDs come from the log exactly. Signals (ECC, row remapping, clocks) are
telemetry, retention-bounded, so their conditions are read from the recorded verdicts: a signal
reason of a recorded verdict says its condition held until the GPU's next verdict. A candidate
rule on a condition no policy in force watched cannot be backtested and is named in
`unobservable`. docs/health-policy.md has the reasoning.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

import msgspec

from collectors.gpu_health import XidOccurrence
from domain.health_policy import (
    DEFAULT_POLICY,
    HEALTHY,
    MAX_XID_COUNT,
    MAX_XID_WINDOW,
    HealthPolicy,
    HealthVerdict,
    PolicyError,
    load_policy,
    verdict_of,
    xid_reasons,
)
from ledger.events import (
    AcceleratorDiscovered,
    AcceleratorHealthChanged,
    AcceleratorXidObserved,
    HealthAction,
    HealthPolicyApplied,
    HealthStatus,
    RecordedEvent,
)

# The event types a backtest reads.
BACKTEST_EVENT_TYPES = (
    "ACCELERATOR_DISCOVERED",
    "ACCELERATOR_XID_OBSERVED",
    "ACCELERATOR_HEALTH_CHANGED",
    "HEALTH_POLICY_APPLIED",
)

Condition = tuple[str, int | None]  # (signal, at_least)


class VerdictChange(msgspec.Struct, frozen=True):
    at: datetime
    status: HealthStatus
    action: HealthAction
    reasons: list[str]


class GpuDifference(msgspec.Struct, frozen=True):
    """One GPU whose verdict under the candidate differs at some moment of the window."""

    accelerator_id: str
    uuid: str
    node_id: str
    first_difference_at: datetime
    in_force: list[VerdictChange]  # its verdict changes in the window under the policy in force
    candidate: list[VerdictChange]  # and under the candidate
    drained_in_force_at: datetime | None  # first moment not healthy, in the window
    drained_candidate_at: datetime | None
    serviced_in_force_at: datetime | None  # first moment its action is `service`
    serviced_candidate_at: datetime | None


class BacktestSummary(msgspec.Struct, frozen=True):
    gpus: int
    differing: int
    drained_earlier: int  # drained under the candidate before (or without) the policy in force
    drained_later: int  # drained later, or not at all, under the candidate
    serviced_earlier: int
    serviced_later: int
    changes_in_force: int
    changes_candidate: int


class Backtest(msgspec.Struct, frozen=True):
    summary: BacktestSummary
    differences: list[GpuDifference]  # by accelerator id
    unobservable: list[str]  # candidate reason codes whose condition no policy in force watched


class GpuTimeline:
    __slots__ = ("accelerator_id", "batch", "cand", "conditions", "live", "node_id", "t", "uuid", "xids")

    def __init__(self, accelerator_id: str, uuid: str, node_id: str) -> None:
        self.accelerator_id = accelerator_id
        self.uuid = uuid
        self.node_id = node_id
        self.xids: list[XidOccurrence] = []
        self.conditions: frozenset[Condition] = frozenset()
        self.t: datetime | None = None
        self.live: list[tuple[datetime, HealthVerdict]] = []
        self.cand: list[tuple[datetime, HealthVerdict]] = []
        self.batch: tuple[datetime, datetime] | None = None  # (received_at, latest XID at) of the last XIDs


def _remember(xids: list[XidOccurrence], new: XidOccurrence) -> list[XidOccurrence]:
    # As the node fold remembers them (domain/node.py): 24 hours of the newest, at most 64.
    kept = sorted([*xids, new], key=lambda x: (x.at, x.code))
    newest = kept[-1].at
    return [x for x in kept if x.at > newest - MAX_XID_WINDOW][-MAX_XID_COUNT:]


def conditions_of(event: AcceleratorHealthChanged, deciding: HealthPolicy) -> frozenset[Condition]:
    """The signal conditions a recorded verdict says held: its signal reasons, read by the rules
    of the policy that decided it."""
    rules = deciding.signal_codes()
    out: set[Condition] = set()
    for reason in event.reasons:
        rule = rules.get(reason.code)
        if rule is not None:
            out.add((rule.signal, rule.at_least))
    return frozenset(out)


def judge_at(
    policy: HealthPolicy, conditions: frozenset[Condition], xids: Sequence[XidOccurrence], at: datetime
) -> HealthVerdict:
    """A verdict from signal conditions and remembered XIDs at `at`."""
    if not conditions and not xids:
        return HEALTHY
    signal = [r.reason for r in policy.signal_rules if (r.signal, r.at_least) in conditions]
    reasons, _ = xid_reasons(policy, xids, at)
    return verdict_of([*signal, *reasons])


class _Policies:
    """The policy in force over time: the default, then each HEALTH_POLICY_APPLIED from its
    receive time."""

    def __init__(self, events: Sequence[RecordedEvent]) -> None:
        self.times: list[datetime] = []
        self.policies: list[HealthPolicy] = [DEFAULT_POLICY]
        self.by_digest: dict[str, HealthPolicy] = {DEFAULT_POLICY.digest: DEFAULT_POLICY}
        for e in events:
            if isinstance(e.payload, HealthPolicyApplied):
                try:
                    policy = load_policy(e.payload.policy)
                except PolicyError:
                    continue  # applying validates; a policy this release cannot read leaves the last one
                self.times.append(e.metadata.received_at)
                self.policies.append(policy)
                self.by_digest[policy.digest] = policy

    def at(self, t: datetime) -> HealthPolicy:
        return self.policies[bisect.bisect_right(self.times, t)]

    def deciding(self, digest: str | None) -> HealthPolicy:
        return self.by_digest.get(digest or "", DEFAULT_POLICY)


_WINDOWS: dict[str, dict[int, frozenset[timedelta]]] = {}


def _windows(policy: HealthPolicy, code: int) -> frozenset[timedelta]:
    """The windows the policy counts XID `code` in (cached per policy digest)."""
    by_code = _WINDOWS.get(policy.digest)
    if by_code is None:
        by_code = {}
        for r in policy.xid_rules:
            for c in r.codes:
                by_code[c] = by_code.get(c, frozenset()) | {r.window}
        _WINDOWS[policy.digest] = by_code
    return by_code.get(code, frozenset())


class _Run:
    def __init__(self, policies: _Policies, candidate: HealthPolicy) -> None:
        self.policies = policies
        self.candidate = candidate

    def judge(self, gpu: GpuTimeline, at: datetime) -> None:
        live = judge_at(self.policies.at(at), gpu.conditions, gpu.xids, at)
        cand = judge_at(self.candidate, gpu.conditions, gpu.xids, at)
        for timeline, verdict in ((gpu.live, live), (gpu.cand, cand)):
            if timeline and timeline[-1][0] == at:
                timeline.pop()  # moments judged twice (an XID, then its refresh's verdict): the last
            previous = timeline[-1][1] if timeline else HEALTHY
            if verdict != previous:
                timeline.append((at, verdict))
        gpu.t = at

    def advance(self, gpu: GpuTimeline, until: datetime) -> None:
        """Judge the GPU at every moment before `until` when an XID stops counting or a policy
        comes into force."""
        if gpu.t is None:
            return
        start = gpu.t
        moments: set[datetime] = {t for t in self.policies.times if start < t < until}
        for x in gpu.xids:
            for w in _windows(self.candidate, x.code) | _windows(self.policies.at(x.at), x.code):
                if start < x.at + w < until:
                    moments.add(x.at + w)
        for t in sorted(moments):
            self.judge(gpu, t)

    def fold(self, gpu: GpuTimeline, event: RecordedEvent) -> None:
        p = event.payload
        at = event.metadata.observed_at or event.metadata.received_at
        if isinstance(p, AcceleratorXidObserved):
            at = p.at
            received = event.metadata.received_at
            latest = max(p.at, gpu.batch[1]) if gpu.batch is not None and gpu.batch[0] == received else p.at
            gpu.batch = (received, latest)
        elif isinstance(p, AcceleratorHealthChanged) and gpu.batch is not None:
            if gpu.batch[0] == event.metadata.received_at:
                at = max(at, gpu.batch[1])  # judged at the latest XID of its own refresh
        if gpu.t is not None:
            self.advance(gpu, at)
            at = max(at, gpu.t)
        if isinstance(p, AcceleratorXidObserved):
            gpu.xids = _remember(gpu.xids, XidOccurrence(code=p.code, at=p.at))
        elif isinstance(p, AcceleratorHealthChanged):
            gpu.conditions = conditions_of(p, self.policies.deciding(p.policy_digest))
        elif isinstance(p, AcceleratorDiscovered):
            gpu.conditions = frozenset()  # judged afresh by the same refresh
        self.judge(gpu, at)


def timelines(
    events: Iterable[RecordedEvent], candidate: HealthPolicy, until: datetime | None = None
) -> dict[str, GpuTimeline]:
    """Every GPU's verdict timeline under the policy in force and under `candidate`."""
    history = list(events)
    run = _Run(_Policies(history), candidate)
    gpus: dict[str, GpuTimeline] = {}
    for event in history:
        p = event.payload
        if not isinstance(p, AcceleratorDiscovered | AcceleratorXidObserved | AcceleratorHealthChanged):
            continue
        gpu = gpus.get(p.accelerator_id)
        if gpu is None:
            gpu = gpus[p.accelerator_id] = GpuTimeline(p.accelerator_id, p.uuid, event.stream_id)
        run.fold(gpu, event)
    if until is not None:
        for gpu in gpus.values():
            run.advance(gpu, until)
    return gpus


def verdict_at(timeline: Sequence[tuple[datetime, HealthVerdict]], at: datetime) -> HealthVerdict:
    """The verdict a timeline gives at `at` (healthy before its first change)."""
    k = bisect.bisect_right([t for t, _v in timeline], at)
    return timeline[k - 1][1] if k else HEALTHY


def _window(
    timeline: list[tuple[datetime, HealthVerdict]], since: datetime | None
) -> list[tuple[datetime, HealthVerdict]]:
    if since is None:
        return timeline
    before = verdict_at(timeline, since)
    inside = [(t, v) for t, v in timeline if t > since]
    return [(since, before), *inside] if before != HEALTHY else inside


def _first(timeline: list[tuple[datetime, HealthVerdict]], test: str) -> datetime | None:
    for t, v in timeline:
        if (v.status != "healthy") if test == "drained" else (v.action == "service"):
            return t
    return None


def _change(t: datetime, v: HealthVerdict) -> VerdictChange:
    return VerdictChange(at=t, status=v.status, action=v.action, reasons=[r.code for r in v.reasons])


def _earlier(a: datetime | None, b: datetime | None) -> bool:
    """Whether moment `a` (candidate) comes before `b` (in force), never counting as infinitely late."""
    return a is not None and (b is None or a < b)


def unobservable(events: Sequence[RecordedEvent], candidate: HealthPolicy) -> list[str]:
    policies = _Policies(events)
    watched = {(r.signal, r.at_least) for p in policies.policies for r in p.signal_rules}
    return [r.reason.code for r in candidate.signal_rules if (r.signal, r.at_least) not in watched]


def backtest(
    events: Iterable[RecordedEvent],
    candidate: HealthPolicy,
    *,
    since: datetime | None = None,
    until: datetime | None = None,
) -> Backtest:
    """Fold the health history with the policy in force and with `candidate`; report the GPUs
    whose verdict (status or action) differs at some moment at or after `since`."""
    history = list(events)
    gpus = timelines(history, candidate, until)
    differences: list[GpuDifference] = []
    counts = dict.fromkeys(("de", "dl", "se", "sl", "ci", "cc"), 0)
    for aid in sorted(gpus):
        gpu = gpus[aid]
        live, cand = _window(gpu.live, since), _window(gpu.cand, since)
        counts["ci"] += len(live)
        counts["cc"] += len(cand)
        moments = sorted({t for t, _v in live} | {t for t, _v in cand})
        first = next(
            (
                t
                for t in moments
                if (verdict_at(live, t).status, verdict_at(live, t).action)
                != (verdict_at(cand, t).status, verdict_at(cand, t).action)
            ),
            None,
        )
        if first is None:
            continue
        d_live, d_cand = _first(live, "drained"), _first(cand, "drained")
        s_live, s_cand = _first(live, "serviced"), _first(cand, "serviced")
        counts["de"] += _earlier(d_cand, d_live)
        counts["dl"] += _earlier(d_live, d_cand)
        counts["se"] += _earlier(s_cand, s_live)
        counts["sl"] += _earlier(s_live, s_cand)
        differences.append(
            GpuDifference(
                accelerator_id=aid,
                uuid=gpu.uuid,
                node_id=gpu.node_id,
                first_difference_at=first,
                in_force=[_change(t, v) for t, v in live],
                candidate=[_change(t, v) for t, v in cand],
                drained_in_force_at=d_live,
                drained_candidate_at=d_cand,
                serviced_in_force_at=s_live,
                serviced_candidate_at=s_cand,
            )
        )
    summary = BacktestSummary(
        gpus=len(gpus),
        differing=len(differences),
        drained_earlier=counts["de"],
        drained_later=counts["dl"],
        serviced_earlier=counts["se"],
        serviced_later=counts["sl"],
        changes_in_force=counts["ci"],
        changes_candidate=counts["cc"],
    )
    return Backtest(summary=summary, differences=differences, unobservable=unobservable(history, candidate))
