"""Samples counted into a history's buckets a column at a time: pure, no I/O
(domain/telemetry_history.py says what a bucket holds).

A history's samples are held as columns (`SampleColumns`): their times as whole microseconds
since the epoch and, per metric, their values. A column whose values are all finite numbers is a
float64 array (`as_column`): its buckets' min, max and sum are numpy reductions over the whole
window, with no Python object per value and no Python call per bucket. Any other column (a
metric unsupported, unknown, a text, an infinity) is a list, counted value by value.

A bucket's mean is math.fsum's correctly rounded sum over the count, kept within min..max: the
mean of equal values is that value, never one ulp beside it, whichever way the samples were
stored. For a column of whole numbers whose sums stay below 2**53 every order of adding them is
exact, so numpy's sums are fsum's; the others are summed by fsum a bucket at a time.

Values as `downsample_values` takes them: an int or a float (not a bool) is a known number,
another str or bool is known without a number, None is unknown, and anything else is in the
state `state_of` tells (None: the sample does not carry the metric).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from operator import truediv
from typing import TYPE_CHECKING, TypeAlias, cast

import msgspec
import numpy as np

from domain.telemetry_history import Bucket, Sample, Series, Window, fact_state, fact_value
from runtime.micros import micros, micros_of

if TYPE_CHECKING:
    import numpy.typing as npt

    Micros: TypeAlias = npt.NDArray[np.int64]  # runtime/micros.py
    Numbers: TypeAlias = npt.NDArray[np.float64]
    # A metric's values over samples: numbers as an array (`as_column`), or values as they are.
    Column: TypeAlias = Numbers | Sequence[object]

# Whole numbers below this in size, and every sum of them, are exact in a float64.
_EXACT = 2.0**53

_NUMBERS = frozenset({int, float})
_KNOWN_ONLY = frozenset({str, bool})
_NONE_ONLY = frozenset({type(None)})


def _plain(numbers: Numbers) -> bool:
    """Finite, and no -0.0: numpy's min and max of these agree with Python's, which keeps the
    first of equal values (0.0 and -0.0 are equal, and told apart in JSON)."""
    return bool(np.isfinite(numbers).all()) and not bool((np.signbit(numbers) & (numbers == 0)).any())


def as_column(values: Sequence[object]) -> Column:
    """The values as a column: a float64 array where every one is a finite int or float (a bool
    is no number) other than -0.0, else as they are."""
    if not values:
        return np.empty(0)
    if not set(map(type, values)) <= _NUMBERS:
        return values
    try:
        numbers = np.array(values, dtype=np.float64)
    except OverflowError:  # an int beyond a float's range: counted as it is
        return values
    return numbers if _plain(numbers) else values


def join(columns: Sequence[Column]) -> Column:
    """Columns one after another: an array where every one is, else a list."""
    arrays = [c for c in columns if isinstance(c, np.ndarray)]
    if len(arrays) == len(columns):
        return np.concatenate(arrays) if arrays else np.empty(0)
    out: list[object] = []
    for c in columns:
        out.extend(c.tolist() if isinstance(c, np.ndarray) else c)
    return out


def take(column: Column, index: npt.NDArray[np.intp]) -> Column:
    """The column's values at `index`, in that order."""
    if isinstance(column, np.ndarray):
        return column[index]
    return [column[i] for i in index.tolist()]


class SampleColumns(msgspec.Struct):
    """Samples inside a window in the order they are counted (time order): their times, whole
    microseconds since the epoch, and one column of values per metric asked (none at all where
    there is no sample)."""

    times: Micros
    columns: list[Column]


def downsample(w: Window, samples: Iterable[Sample], metrics: Sequence[str]) -> list[Series]:
    """Every metric's series over the window, one bucket per step; samples outside are ignored."""
    return downsample_values(
        w,
        ((s.observed_at, [fact_value(s.telemetry.get(m)) for m in metrics]) for s in samples),
        metrics,
        fact_state,
    )


def downsample_values(
    w: Window,
    samples: Iterable[tuple[datetime, Sequence[object]]],
    metrics: Sequence[str],
    state_of: Callable[[object], str | None],
) -> list[Series]:
    """`downsample` of samples given as each one's time and its values of `metrics`, one each in
    that order, in the order the samples are counted (time order: a bucket's `states` list the
    states in the order first seen)."""
    since, until = w.since, w.until
    times: list[datetime] = []
    rows: list[Sequence[object]] = []
    for at, values in samples:
        if since <= at < until:
            times.append(at)
            rows.append(values)
    k = len(metrics)
    if set(map(len, rows)) - {k}:
        raise ValueError(f"a sample of {next(len(r) for r in rows if len(r) != k)} values for {k} metrics")
    columns = [as_column(c) for c in zip(*rows, strict=True)]
    return downsample_columns(w, SampleColumns(micros_of(times), columns), metrics, state_of)


def downsample_columns(
    w: Window, samples: SampleColumns, metrics: Sequence[str], state_of: Callable[[object], str | None]
) -> list[Series]:
    """`downsample_values` of samples inside the window, held as columns."""
    return list(series_of_columns(w, samples, metrics, state_of))


def series_of_columns(
    w: Window, samples: SampleColumns, metrics: Sequence[str], state_of: Callable[[object], str | None]
) -> Iterator[Series]:
    """`downsample_columns` one series at a time, in the order of `metrics`: a caller that shares
    its thread with other work (an event loop) lets it run in between."""
    times, columns = samples.times, samples.columns
    n, k = len(times), len(metrics)
    if not columns and not n:
        columns = [np.empty(0)] * k
    if len(columns) != k:
        raise ValueError(f"{len(columns)} columns for {k} metrics")
    if any(len(c) != n for c in columns):
        raise ValueError(f"a column of another length than the {n} samples' times")
    since = micros(w.since)
    if n and (int(times.min()) < since or int(times.max()) >= micros(w.until)):
        raise ValueError("a sample outside the window")
    index = (times - since) // (w.step_seconds * 1_000_000)
    if n > 1 and not bool((index[1:] >= index[:-1]).all()):
        order = np.argsort(index, kind="stable")  # stable: the given order within a bucket
        index = index[order]
        columns = [take(c, order) for c in columns]
    held = np.bincount(index, minlength=w.points)
    filled = np.flatnonzero(held)
    counts = held[filled]
    firsts = np.cumsum(counts) - counts
    cuts = list(map(slice, firsts.tolist(), (firsts + counts).tolist()))
    step = timedelta(seconds=w.step_seconds)
    starts = [w.since + i * step for i in range(w.points)]
    filled_at = filled.tolist()
    full = [starts[i] for i in filled_at]
    for metric, column in zip(metrics, columns, strict=True):
        buckets = _buckets(column, firsts, counts, cuts, full, state_of) if n else []
        if len(buckets) < len(starts):
            by_index = dict(zip(filled_at, buckets, strict=True))
            buckets = [
                by_index.get(i) or Bucket(start, 0, {}, None, None, None) for i, start in enumerate(starts)
            ]
        yield Series(metric=metric, points=buckets)


def _whole(numbers: Numbers, most: int) -> bool:
    """Whole numbers that `most` of them add up below 2**53 in size: numpy's sums of them, in
    whatever order it adds, are exact."""
    return float(np.abs(numbers).max()) * most < _EXACT and bool((numbers == np.trunc(numbers)).all())


def _buckets(
    column: Column,
    firsts: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    cuts: list[slice],
    starts: list[datetime],
    state_of: Callable[[object], str | None],
) -> list[Bucket]:
    """One metric's buckets that have samples: `counts[i]` values from `firsts[i]` (the slice
    `cuts[i]`), starting at `starts[i]`."""
    n = counts.tolist()
    if isinstance(column, np.ndarray) and _plain(column):
        lows, highs = np.minimum.reduceat(column, firsts), np.maximum.reduceat(column, firsts)
        with np.errstate(over="ignore"):
            sums = np.add.reduceat(column, firsts)
        low, high = lows.tolist(), highs.tolist()
        if _whole(column, int(counts.max())):
            means = np.minimum(np.maximum(sums / counts, lows), highs).tolist()
        else:
            values = column.tolist()
            parts = list(map(values.__getitem__, cuts))
            means = _means(parts, n, low, high)
        return list(map(Bucket, starts, n, [{"known": c} for c in n], low, means, high))
    values = column.tolist() if isinstance(column, np.ndarray) else column
    return _listed_buckets(values, cuts, n, starts, state_of)


def _means(
    parts: list[Sequence[float]], counts: list[int], lows: list[float], highs: list[float]
) -> list[float]:
    """`_mean` of each part, a few calls into C per part where no sum overflows."""
    try:
        return list(map(min, map(max, map(truediv, map(math.fsum, parts), counts), lows), highs))
    except (OverflowError, ValueError):
        return list(map(_mean, parts, lows, highs))


def _listed_buckets(
    column: Sequence[object],
    cuts: list[slice],
    counts: list[int],
    starts: list[datetime],
    state_of: Callable[[object], str | None],
) -> list[Bucket]:
    """`_buckets` of a column held as a list: each `cuts` of it, starting at `starts`."""
    kinds = set(map(type, column))
    if kinds <= _NUMBERS:  # numbers with an infinity or a -0.0
        parts: list[Sequence[float]] = list(map(cast("Sequence[float]", column).__getitem__, cuts))
        lows = list(map(float, map(min, parts)))
        highs = list(map(float, map(max, parts)))
        means = _means(parts, counts, lows, highs)
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


def _tally(
    column: Sequence[object], state_of: Callable[[object], str | None]
) -> tuple[dict[str, int], Sequence[float]]:
    """One metric's values in one bucket, in time order: how many in each state (in the order
    first seen) and the known numbers. A bucket of numbers, of one non-numeric state or of equal
    values is told by a few calls into C, not a call per value."""
    kinds = set(map(type, column))
    if kinds <= _NUMBERS:
        return {"known": len(column)}, column  # type: ignore[return-value]
    if kinds <= _KNOWN_ONLY:
        return {"known": len(column)}, ()
    first = column[0]
    if first is None and kinds == _NONE_ONLY:
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
    """The mean, exact (fsum) and within low..high."""
    try:
        total = math.fsum(numbers) / len(numbers)
    except OverflowError:  # finite values whose sum is not: their fractions' sum is
        total = math.fsum(float(v) / len(numbers) for v in numbers)
    except ValueError:  # both infinities: no mean
        return math.nan
    return min(max(total, low), high)
