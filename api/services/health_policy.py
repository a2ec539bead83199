"""The GPU health policy in force (docs/health-policy.md): which one the decisions of this process
use, applying another (an audited HEALTH_POLICY_APPLIED in the stream `health-policy`), and the
backtest of a candidate on the log (domain/health_backtest.py), which writes nothing.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta

import asyncpg
import msgspec
import structlog

from api.services.clock import central_now
from api.services.errors import Conflict, InvalidRequest, Unavailable
from domain.health_backtest import BACKTEST_EVENT_TYPES, Backtest, BacktestSummary, GpuDifference, backtest
from domain.health_policy import DEFAULT_POLICY, HealthPolicy, PolicyError, load_policy
from ledger.events import (
    HEALTH_POLICY_STREAM,
    EventMetadata,
    HealthPolicyApplied,
    NewEvent,
    RecordedEvent,
)
from ledger.reading import EVENT_COLUMNS, event_from_row
from ledger.store import EventStore, StreamVersionConflict

log = structlog.get_logger(__name__)

# A policy applied through another server process reaches this one's decisions within this long
# (each verdict names the digest it used, so the audit is exact either way).
RECHECK_SECONDS = 5.0
# A backtest reads at most this many health events and runs at most this long.
MAX_BACKTEST_EVENTS = 5_000_000
BACKTEST_SECONDS = 120.0
BACKTEST_PAGE = 20_000
MAX_POLICY_BYTES = 256 * 1024

# The health history in log order, a page after a global position. The health events are lifecycle
# events, all in the permanent segment, the one with an index by type (events_permanent_type_idx).
_HEALTH_EVENTS = (
    "SELECT " + EVENT_COLUMNS + " FROM events "
    "WHERE events.segment = 'infinity' AND events.event_type = ANY($1::text[]) "
    "AND events.global_position > $2 ORDER BY events.global_position LIMIT $3"
)


# The newest health event, by type (each a backward scan of events_permanent_type_idx): a
# backtest's pages share one fold while it does not move.
_HEALTH_HEAD = (
    "SELECT greatest("
    "(SELECT max(global_position) FROM events WHERE segment = 'infinity' AND event_type = $1), "
    "(SELECT max(global_position) FROM events WHERE segment = 'infinity' AND event_type = $2), "
    "(SELECT max(global_position) FROM events WHERE segment = 'infinity' AND event_type = $3), "
    "(SELECT max(global_position) FROM events WHERE segment = 'infinity' AND event_type = $4))"
)
# How long the pages of one backtest are answered from its fold.
KEEP_BACKTEST_SECONDS = 300.0


class PolicyBody(msgspec.Struct, frozen=True):
    """The policy in force: `since_position` is the HEALTH_POLICY_APPLIED that put it in force
    (None: the shipped default, never applied)."""

    name: str
    digest: str
    default: bool
    since_position: int | None
    applied_at: datetime | None
    actor: str | None
    policy: str


class ApplyRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: str  # the TOML document
    actor: str | None = None


class BacktestRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    policy: str  # the candidate TOML document
    since_seconds: int = 30 * 86400  # the window compared: this long before now
    cursor: str | None = None  # the last accelerator id of the previous page
    limit: int = 100


class BacktestBody(msgspec.Struct, frozen=True):
    in_force: str  # digest of the policy in force now
    candidate: str  # digest of the candidate
    since: datetime
    until: datetime
    events: int  # health events folded
    summary: BacktestSummary
    unobservable: list[str]
    items: list[GpuDifference]
    next_cursor: str | None
    elapsed_seconds: float


def _policy_or_refusal(text: str, field: str) -> HealthPolicy:
    if len(text.encode("utf-8")) > MAX_POLICY_BYTES:
        raise InvalidRequest(
            "invalid-health-policy", "Invalid health policy", f"{field}: larger than {MAX_POLICY_BYTES} bytes"
        )
    try:
        return load_policy(text)
    except PolicyError as exc:
        raise InvalidRequest(
            "invalid-health-policy", "Invalid health policy", str(exc), field=field, where=exc.where
        ) from None


def _body(policy: HealthPolicy, event: RecordedEvent | None) -> PolicyBody:
    return PolicyBody(
        name=policy.name,
        digest=policy.digest,
        default=event is None,
        since_position=None if event is None else event.global_position,
        applied_at=None if event is None else event.metadata.received_at,
        actor=None if event is None else event.metadata.actor,
        policy=policy.text,
    )


class _Kept(msgspec.Struct, frozen=True):
    made: float
    since: datetime
    until: datetime
    events: int
    result: Backtest


class HealthPolicies:
    """The policy in force, as this process's decisions see it: read from the log at most every
    RECHECK_SECONDS (`fresh`), at once after an apply through this process."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._policy = DEFAULT_POLICY
        self._event: RecordedEvent | None = None
        self._version = 0
        self._checked = float("-inf")
        self._lock = asyncio.Lock()
        self._backtests: dict[tuple[str, int, int], _Kept] = {}

    @property
    def current(self) -> HealthPolicy:
        return self._policy

    async def fresh(self, *, force: bool = False) -> HealthPolicy:
        if not force and time.monotonic() - self._checked < RECHECK_SECONDS:
            return self._policy
        async with self._lock:
            events = await self.store.read_stream(HEALTH_POLICY_STREAM, after_version=self._version)
            for event in events:
                self._version = event.stream_version
                if isinstance(event.payload, HealthPolicyApplied):
                    try:
                        self._policy = load_policy(event.payload.policy)
                        self._event = event
                    except PolicyError as exc:  # applying validates; a newer release's format
                        log.error("health_policy.unreadable", position=event.global_position, error=str(exc))
            self._checked = time.monotonic()
        return self._policy

    async def in_force(self) -> PolicyBody:
        policy = await self.fresh(force=True)
        return _body(policy, self._event)

    async def apply(self, text: str, actor: str) -> PolicyBody:
        """Validate and put a policy in force: nothing is written unless it is valid."""
        policy = _policy_or_refusal(text, "policy")
        await self.fresh(force=True)
        event = NewEvent(
            payload=HealthPolicyApplied(name=policy.name, digest=policy.digest, policy=policy.text),
            metadata=EventMetadata(received_at=central_now(), source="operator", actor=actor),
        )
        try:
            await self.store.append(HEALTH_POLICY_STREAM, self._version, [event])
        except StreamVersionConflict:
            raise Conflict(
                "health-policy-changed",
                "Health policy changed",
                "another policy was applied at the same time; show the policy in force and apply again",
            ) from None
        log.info("health_policy.applied", name=policy.name, digest=policy.digest, actor=actor)
        return await self.in_force()

    async def backtest(self, request: BacktestRequest, now: datetime) -> BacktestBody:
        """Fold the log's health history with the policy in force and with the candidate; a page
        of the GPUs whose verdict would differ (by accelerator id, after `cursor`). Nothing is
        written."""
        started = time.perf_counter()
        candidate = _policy_or_refusal(request.policy, "policy")
        if not 1 <= request.limit <= 1000:
            raise InvalidRequest("invalid-limit", "Invalid limit", "limit: must be 1..1000", field="limit")
        if not 3600 <= request.since_seconds <= 400 * 86400:
            raise InvalidRequest(
                "invalid-since",
                "Invalid window",
                "since_seconds: must be 1 hour to 400 days",
                field="since_seconds",
            )
        in_force = await self.fresh(force=True)
        async with self.store.pool.acquire() as conn:
            head: int = await conn.fetchval(_HEALTH_HEAD, *BACKTEST_EVENT_TYPES) or 0
        key = (candidate.digest, request.since_seconds, head)
        kept = self._backtests.get(key)
        if kept is not None and time.monotonic() - kept.made < KEEP_BACKTEST_SECONDS:
            # The next page of a backtest of the same log: the same fold, not another.
            since, now, events, result = kept.since, kept.until, kept.events, kept.result
        else:
            since = now - timedelta(seconds=request.since_seconds)
            history = await self._history(started)
            events = len(history)
            result = await asyncio.to_thread(backtest, history, candidate, since=since, until=now)
            self._backtests = {key: _Kept(time.monotonic(), since, now, events, result)}
        after = [d for d in result.differences if request.cursor is None or d.accelerator_id > request.cursor]
        page = after[: request.limit]
        more = len(after) > len(page)
        return BacktestBody(
            in_force=in_force.digest,
            candidate=candidate.digest,
            since=since,
            until=now,
            events=events,
            summary=result.summary,
            unobservable=result.unobservable,
            items=page,
            next_cursor=page[-1].accelerator_id if more and page else None,
            elapsed_seconds=round(time.perf_counter() - started, 3),
        )

    async def _history(self, started: float, page: int = BACKTEST_PAGE) -> list[RecordedEvent]:
        history: list[RecordedEvent] = []
        after = 0
        async with self.store.pool.acquire() as conn:
            while True:
                rows: list[asyncpg.Record] = await conn.fetch(
                    _HEALTH_EVENTS, list(BACKTEST_EVENT_TYPES), after, page
                )
                history.extend(event_from_row(r) for r in rows)
                if len(rows) < page:
                    return history
                after = rows[-1]["global_position"]
                if len(history) > MAX_BACKTEST_EVENTS or time.perf_counter() - started > BACKTEST_SECONDS:
                    raise Unavailable(
                        "backtest-too-large",
                        "Backtest too large",
                        f"the log's health history is larger than a backtest reads "
                        f"({MAX_BACKTEST_EVENTS} events, {BACKTEST_SECONDS:.0f} s)",
                    )
