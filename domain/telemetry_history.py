"""A telemetry history downsampled into buckets of a fixed step: pure, no I/O.

The window [since, until) is cut into buckets of `step` seconds from `since` (the last one ends at
`until`). Each sample falls in exactly one bucket, by its time. Per metric and bucket: how many
samples carry the metric, how many were in each availability state, and min / mean / max over the
known numeric values only. A bucket without a known number has no number at all (None): a GPU
that cannot report its fan is not a fan at 0 %, and a bucket without samples is a gap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import TypeAlias

import msgspec

from collectors.facts import Fact, Known, Unknown

# A series the default step keeps under this many points; a request for more than the most is
# refused (a chart is a few hundred pixels wide, and every point costs the server a bucket).
DEFAULT_POINTS = 500
MAX_POINTS = 2000
MIN_STEP_SECONDS = 1
# A bucket wider than a year is no history any more (and keeps the arithmetic on dates in range).
MAX_STEP_SECONDS = 366 * 86400


class Sample(msgspec.Struct, frozen=True):
    """One observation's telemetry: its time and its facts by metric name."""

    observed_at: datetime
    telemetry: dict[str, Fact]


class Bucket(msgspec.Struct, frozen=True):
    """One step of one metric. `states` counts every availability state seen (`known` included);
    `min`/`mean`/`max` are over the known numeric values, None where there is none."""

    start: datetime
    count: int
    states: dict[str, int]
    min: float | None
    mean: float | None
    max: float | None


class Series(msgspec.Struct, frozen=True):
    metric: str
    points: list[Bucket]


class Window(msgspec.Struct, frozen=True):
    since: datetime
    until: datetime
    step_seconds: int

    @property
    def points(self) -> int:
        return points_in(self.since, self.until, self.step_seconds)


class WindowRefused(ValueError):
    """A window that cannot be downsampled as asked; `parameter` names the query parameter."""

    def __init__(self, parameter: str, detail: str) -> None:
        super().__init__(detail)
        self.parameter = parameter
        self.detail = detail


def points_in(since: datetime, until: datetime, step_seconds: int) -> int:
    return math.ceil((until - since).total_seconds() / step_seconds)


def default_step(since: datetime, until: datetime) -> int:
    """The smallest whole number of seconds that keeps the series at DEFAULT_POINTS or fewer."""
    return max(MIN_STEP_SECONDS, math.ceil((until - since).total_seconds() / DEFAULT_POINTS))


def window(since: datetime, until: datetime, step_seconds: int | None) -> Window:
    """The window as asked, or the parameter that makes it impossible."""
    if since >= until:
        raise WindowRefused(
            "since", f"since ({since.isoformat()}) must be before until ({until.isoformat()})"
        )
    if step_seconds is None:
        step_seconds = default_step(since, until)
    if not MIN_STEP_SECONDS <= step_seconds <= MAX_STEP_SECONDS:
        raise WindowRefused(
            "step", f"step must be {MIN_STEP_SECONDS} s to {MAX_STEP_SECONDS} s (got {step_seconds})"
        )
    points = points_in(since, until, step_seconds)
    if points > MAX_POINTS:
        raise WindowRefused(
            "step",
            f"step {step_seconds} s makes {points} points per series over this window; at most "
            f"{MAX_POINTS}: raise step or narrow since/until",
        )
    return Window(since=since, until=until, step_seconds=step_seconds)


# One metric of one sample as a bucket counts it: its availability state and, where it is a known
# number, the number (a known text or flag counts as known, without a number).
Reading: TypeAlias = tuple[str, float | None]
_STATES: dict[type, str] = {}


def reading(fact: Fact) -> Reading:
    state = _tag(fact)
    if type(fact) is Known:
        v = fact.value
        if type(v) is int or type(v) is float:
            return state, float(v)
    return state, None


def _tag(fact: object) -> str:
    state = _STATES.get(type(fact))
    if state is None:
        tag = fact.__struct_config__.tag  # type: ignore[attr-defined]
        assert isinstance(tag, str)
        state = _STATES[type(fact)] = tag
    return state


def fact_state(fact: object) -> str | None:
    """A fact's availability state (its tag), None for NOT_CARRIED: the `state_of` of
    `downsample_values` for values made by `fact_value`."""
    return None if fact is NOT_CARRIED else _tag(fact)


# A metric a sample does not carry, among the values of `fact_value`.
NOT_CARRIED: object = object()


def fact_value(fact: Fact | None) -> object:
    """A fact as a value `downsample_values` counts (with `fact_state` as its `state_of`)."""
    if fact is None:
        return NOT_CARRIED
    if type(fact) is Known:
        return fact.value
    if type(fact) is Unknown:
        return None
    return fact


def bucket_index(w: Window, at: datetime) -> int | None:
    """The bucket a moment falls in, or None outside [since, until)."""
    if at < w.since or at >= w.until:
        return None
    return int((at - w.since) // timedelta(seconds=w.step_seconds))


def downsample(w: Window, samples: Iterable[Sample], metrics: Sequence[str]) -> list[Series]:
    """Every metric's series over the window, one bucket per step; samples outside are ignored."""
    return downsample_values(
        w,
        ((s.observed_at, [fact_value(s.telemetry.get(m)) for m in metrics]) for s in samples),
        metrics,
        fact_state,
    )


_NUMBERS = frozenset({int, float})
_KNOWN_ONLY = frozenset({str, bool})


def _tally(
    column: Sequence[object], state_of: Callable[[object], str | None]
) -> tuple[dict[str, int], Sequence[float]]:
    """One metric's values in one bucket, in time order: how many in each state (in the order
    first seen) and the known numbers. A column of numbers, of one non-numeric state or of equal
    values (a fan that is unsupported all day) is told by a few calls into C, not a call per value."""
    kinds = set(map(type, column))
    if kinds <= _NUMBERS:
        return {"known": len(column)}, column  # type: ignore[return-value]
    if kinds <= _KNOWN_ONLY:
        return {"known": len(column)}, ()
    first = column[0]
    if first is None and kinds == {type(None)}:
        return {"unknown": len(column)}, ()
    if len(kinds) == 1 and column.count(first) == len(column):
        state = state_of(first)
        return ({} if state is None else {state: len(column)}), ()
    states: dict[str, int] = {}
    numbers: list[float] = []
    for v in column:
        t = type(v)
        if t is int or t is float:
            s = "known"
            numbers.append(v)  # type: ignore[arg-type]
        elif t is str or t is bool:
            s = "known"
        elif v is None:
            s = "unknown"
        else:
            told = state_of(v)
            if told is None:
                continue
            s = told
        states[s] = states.get(s, 0) + 1
    return states, numbers


def _mean(numbers: Sequence[float], low: float, high: float) -> float:
    """The mean, exact (fsum: the mean of equal values is that value, never one ulp beside it) and
    within low..high."""
    try:
        total = math.fsum(numbers) / len(numbers)
    except OverflowError:  # finite values whose sum is not: their fractions' sum is
        total = math.fsum(float(v) / len(numbers) for v in numbers)
    except ValueError:  # both infinities: no mean
        return math.nan
    return min(max(total, low), high)


def downsample_values(
    w: Window,
    samples: Iterable[tuple[datetime, Sequence[object]]],
    metrics: Sequence[str],
    state_of: Callable[[object], str | None],
) -> list[Series]:
    """`downsample` of samples given as each one's time and its values of `metrics`, one each in
    that order, in the order the samples are counted (time order: a bucket's `states` list the
    states in the order first seen). A value that is an int or a float (not a bool) is a known
    number, another str or bool is known without a number, None is unknown, and anything else is
    in the state `state_of` tells (None: the sample does not carry the metric). A compact
    snapshot's facts are these values as stored (ledger/compact.py), so a history of thousands of
    samples is bucketed without an object per value."""
    n = w.points
    k = len(metrics)
    groups: list[list[Sequence[object]]] = [[] for _ in range(n)]
    since, until = w.since, w.until
    step_us = w.step_seconds * 1_000_000
    for at, values in samples:
        if at < since or at >= until:
            continue
        if len(values) != k:
            raise ValueError(f"a sample of {len(values)} values for {k} metrics")
        d = at - since
        groups[(d.days * 86_400_000_000 + d.seconds * 1_000_000 + d.microseconds) // step_us].append(values)
    step = timedelta(seconds=w.step_seconds)
    points: list[list[Bucket]] = [[] for _ in range(k)]
    for i, group in enumerate(groups):
        start = since + i * step
        if not group:
            for m in range(k):
                points[m].append(Bucket(start, 0, {}, None, None, None))
            continue
        for m, column in enumerate(zip(*group, strict=True)):
            states, numbers = _tally(column, state_of)
            count = sum(states.values())
            if numbers:
                low, high = float(min(numbers)), float(max(numbers))
                points[m].append(Bucket(start, count, states, low, _mean(numbers, low, high), high))
            else:
                points[m].append(Bucket(start, count, states, None, None, None))
    return [Series(metric=metric, points=points[m]) for m, metric in enumerate(metrics)]
