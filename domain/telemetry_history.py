"""A telemetry history downsampled into buckets of a fixed step: pure, no I/O.

The window [since, until) is cut into buckets of `step` seconds from `since` (the last one ends at
`until`). Each sample falls in exactly one bucket, by its time. Per metric and bucket: how many
samples carry the metric, how many were in each availability state, and min / mean / max over the
known numeric values only. A bucket without a known number has no number at all (None): a GPU
that cannot report its fan is not a fan at 0 %, and a bucket without samples is a gap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import TypeAlias

import msgspec

from collectors.facts import Fact, Known

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
    state = _STATES.get(type(fact))
    if state is None:
        tag = fact.__struct_config__.tag
        assert isinstance(tag, str)
        state = _STATES[type(fact)] = tag
    if type(fact) is Known:
        v = fact.value
        if type(v) is int or type(v) is float:
            return state, float(v)
    return state, None


def bucket_index(w: Window, at: datetime) -> int | None:
    """The bucket a moment falls in, or None outside [since, until)."""
    if at < w.since or at >= w.until:
        return None
    return int((at - w.since) // timedelta(seconds=w.step_seconds))


def downsample(w: Window, samples: Iterable[Sample], metrics: Sequence[str]) -> list[Series]:
    """Every metric's series over the window, one bucket per step; samples outside are ignored."""
    return downsample_readings(
        w,
        (
            (s.observed_at, [None if (f := s.telemetry.get(m)) is None else reading(f) for m in metrics])
            for s in samples
        ),
        metrics,
    )


def downsample_readings(
    w: Window, samples: Iterable[tuple[datetime, Sequence[Reading | None]]], metrics: Sequence[str]
) -> list[Series]:
    """`downsample` of samples already read: each sample's time and its readings in the order of
    `metrics` (None: the sample does not carry that metric). What a history of thousands of
    samples is fed, without a fact object per value."""
    n = w.points
    k = len(metrics)
    counts = [[0] * n for _ in range(k)]
    states: list[list[dict[str, int]]] = [[{} for _ in range(n)] for _ in range(k)]
    values: list[list[list[float]]] = [[[] for _ in range(n)] for _ in range(k)]
    since, until = w.since, w.until
    step_us = w.step_seconds * 1_000_000
    for at, readings in samples:
        if at < since or at >= until:
            continue
        d = at - since
        i = (d.days * 86_400_000_000 + d.seconds * 1_000_000 + d.microseconds) // step_us
        for m, r in enumerate(readings):
            if r is None:
                continue
            counts[m][i] += 1
            seen = states[m][i]
            seen[r[0]] = seen.get(r[0], 0) + 1
            if r[1] is not None:
                values[m][i].append(r[1])
    step = timedelta(seconds=w.step_seconds)
    series: list[Series] = []
    for m, metric in enumerate(metrics):
        points: list[Bucket] = []
        for i in range(n):
            known = values[m][i]
            points.append(
                Bucket(
                    start=w.since + i * step,
                    count=counts[m][i],
                    states=states[m][i],
                    min=min(known) if known else None,
                    # fsum: the mean of equal values is that value, never one ulp beside it.
                    mean=min(max(math.fsum(known) / len(known), min(known)), max(known)) if known else None,
                    max=max(known) if known else None,
                )
            )
        series.append(Series(metric=metric, points=points))
    return series
