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


def _number(fact: Fact) -> float | None:
    if isinstance(fact, Known) and isinstance(fact.value, int | float) and not isinstance(fact.value, bool):
        return float(fact.value)
    return None


def bucket_index(w: Window, at: datetime) -> int | None:
    """The bucket a moment falls in, or None outside [since, until)."""
    if at < w.since or at >= w.until:
        return None
    return int((at - w.since) // timedelta(seconds=w.step_seconds))


def downsample(w: Window, samples: Iterable[Sample], metrics: Sequence[str]) -> list[Series]:
    """Every metric's series over the window, one bucket per step; samples outside are ignored."""
    n = w.points
    counts = {m: [0] * n for m in metrics}
    states: dict[str, list[dict[str, int]]] = {m: [{} for _ in range(n)] for m in metrics}
    values: dict[str, list[list[float]]] = {m: [[] for _ in range(n)] for m in metrics}
    for sample in samples:
        i = bucket_index(w, sample.observed_at)
        if i is None:
            continue
        for metric in metrics:
            fact = sample.telemetry.get(metric)
            if fact is None:
                continue
            counts[metric][i] += 1
            state = fact.__struct_config__.tag
            assert isinstance(state, str)
            seen = states[metric][i]
            seen[state] = seen.get(state, 0) + 1
            number = _number(fact)
            if number is not None:
                values[metric][i].append(number)
    step = timedelta(seconds=w.step_seconds)
    series: list[Series] = []
    for metric in metrics:
        points: list[Bucket] = []
        for i in range(n):
            known = values[metric][i]
            points.append(
                Bucket(
                    start=w.since + i * step,
                    count=counts[metric][i],
                    states=states[metric][i],
                    min=min(known) if known else None,
                    # fsum: the mean of equal values is that value, never one ulp beside it.
                    mean=min(max(math.fsum(known) / len(known), min(known)), max(known)) if known else None,
                    max=max(known) if known else None,
                )
            )
        series.append(Series(metric=metric, points=points))
    return series
