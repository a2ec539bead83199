"""A telemetry history downsampled into buckets of a fixed step: pure, no I/O.

The window [since, until) is cut into buckets of `step` seconds from `since` (the last one ends at
`until`). Each sample falls in exactly one bucket, by its time. Per metric and bucket: how many
samples carry the metric, how many were in each availability state, and min / mean / max over the
known numeric values only. A bucket without a known number has no number at all (None): a GPU
that cannot report its fan is not a fan at 0 %, and a bucket without samples is a gap.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from itertools import accumulate, islice
from operator import le, truediv
from typing import TypeAlias, cast

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


class SampleColumns(msgspec.Struct):
    """Samples inside a window in the order they are counted (time order): their times and, one
    list each, their values of the metrics asked (`downsample_values`)."""

    times: list[datetime]
    values: list[Sequence[object]]


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
_NONE_ONLY = frozenset({type(None)})


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
    since, until = w.since, w.until
    inside = SampleColumns(times=[], values=[])
    for at, values in samples:
        if since <= at < until:
            inside.times.append(at)
            inside.values.append(values)
    return downsample_columns(w, inside, metrics, state_of)


def _bounds(
    w: Window, times: list[datetime], rows: list[Sequence[object]]
) -> tuple[list[int], list[Sequence[object]]]:
    """Where each bucket's samples end among the rows, and the rows with each bucket's together
    in the order given. Rows in time order stay as they are and their bounds are found by
    bisection; others are put in bucket order first (a stable sort keeps the order within one)."""
    n = w.points
    since = w.since
    step = timedelta(seconds=w.step_seconds)
    if all(map(le, times, islice(times, 1, None))):
        return [bisect_left(times, since + i * step) for i in range(1, n)] + [len(times)], rows
    step_us = w.step_seconds * 1_000_000
    index = [
        (d.days * 86_400_000_000 + d.seconds * 1_000_000 + d.microseconds) // step_us
        for d in (at - since for at in times)
    ]
    order = sorted(range(len(rows)), key=index.__getitem__)
    ends = [0] * n
    for i in index:
        ends[i] += 1
    return list(accumulate(ends)), [rows[i] for i in order]


def _buckets(
    column: tuple[object, ...],
    cuts: list[slice],
    counts: list[int],
    starts: list[datetime],
    state_of: Callable[[object], str | None],
) -> list[Bucket]:
    """One metric's buckets that have samples: each `cuts` of the column, starting at `starts`."""
    kinds = set(map(type, column))
    if kinds <= _NUMBERS:
        parts: list[Sequence[float]] = list(map(cast("tuple[float, ...]", column).__getitem__, cuts))
        lows = list(map(float, map(min, parts)))
        highs = list(map(float, map(max, parts)))
        try:  # _mean's arithmetic, a call into C per step
            sums = map(math.fsum, parts)
            means = list(map(min, map(max, map(truediv, sums, counts), lows), highs))
        except (OverflowError, ValueError):
            means = list(map(_mean, parts, lows, highs))
        return list(map(Bucket, starts, counts, [{"known": n} for n in counts], lows, means, highs))
    if kinds <= _KNOWN_ONLY or kinds == _NONE_ONLY:
        state: str | None = "unknown" if kinds == _NONE_ONLY else "known"
    elif len(kinds) == 1 and column.count(column[0]) == len(column):  # e.g. a fan unsupported all day
        state = state_of(column[0])
    else:
        state = ""
    if state is None:  # not carried at all
        return [Bucket(t, 0, {}, None, None, None) for t in starts]
    if state:
        return [Bucket(t, n, {state: n}, None, None, None) for t, n in zip(starts, counts, strict=True)]
    out: list[Bucket] = []
    for start, cut in zip(starts, cuts, strict=True):
        states, numbers = _tally(column[cut], state_of)
        count = sum(states.values())
        if numbers:
            low, high = float(min(numbers)), float(max(numbers))
            out.append(Bucket(start, count, states, low, _mean(numbers, low, high), high))
        else:
            out.append(Bucket(start, count, states, None, None, None))
    return out


def downsample_columns(
    w: Window, samples: SampleColumns, metrics: Sequence[str], state_of: Callable[[object], str | None]
) -> list[Series]:
    """`downsample_values` of samples inside the window. A metric is tallied a column at a time:
    where the column holds numbers only (a GPU's usual day), or only one kind of non-number,
    every bucket is a few calls into C."""
    return list(series_of_columns(w, samples, metrics, state_of))


def series_of_columns(
    w: Window, samples: SampleColumns, metrics: Sequence[str], state_of: Callable[[object], str | None]
) -> Iterator[Series]:
    """`downsample_columns` one series at a time, in the order of `metrics`: a caller that shares
    its thread with other work (an event loop) lets it run in between."""
    since, until = w.since, w.until
    times, rows = samples.times, samples.values
    k = len(metrics)
    if times and (min(times) < since or max(times) >= until):
        raise ValueError("a sample outside the window")
    if set(map(len, rows)) - {k}:
        raise ValueError(f"a sample of {next(len(r) for r in rows if len(r) != k)} values for {k} metrics")
    ends, rows = _bounds(w, times, rows)
    step = timedelta(seconds=w.step_seconds)
    starts = [since + i * step for i in range(w.points)]
    spans = [(i, a, b) for i, (a, b) in enumerate(zip([0, *ends], ends, strict=False)) if b > a]
    full = [starts[i] for i, _, _ in spans]
    cuts = [slice(a, b) for _, a, b in spans]
    counts = [b - a for _, a, b in spans]
    columns: list[tuple[object, ...]] = list(zip(*rows, strict=True)) if rows else [() for _ in metrics]
    for metric, column in zip(metrics, columns, strict=True):
        buckets = _buckets(column, cuts, counts, full, state_of)
        if len(buckets) < len(starts):
            filled = dict(zip([i for i, _, _ in spans], buckets, strict=True))
            buckets = [
                filled.get(i) or Bucket(start, 0, {}, None, None, None) for i, start in enumerate(starts)
            ]
        yield Series(metric=metric, points=buckets)
