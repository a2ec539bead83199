"""A telemetry history downsampled into buckets of a fixed step: pure, no I/O.

The window [since, until) is cut into buckets of `step` seconds from `since` (the last one ends at
`until`). Each sample falls in exactly one bucket, by its time. Per metric and bucket: how many
samples carry the metric, how many were in each availability state, and min / mean / max over the
known numeric values only. A bucket without a known number has no number at all (None): a GPU
that cannot report its fan is not a fan at 0 %, and a bucket without samples is a gap.

Here: the window and the shapes of what a history answers, and how one fact is counted; the
counting of many samples at once is domain/telemetry_buckets.py.
"""

from __future__ import annotations

import math
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


class Bucket(msgspec.Struct, frozen=True, gc=False):
    """One step of one metric. `states` counts every availability state seen (`known` included);
    `min`/`mean`/`max` are over the known numeric values, None where there is none. Untracked by
    the garbage collector (it holds no container that could lead back to it): a day's history is
    thousands of them, which the young generation's collections would otherwise walk."""

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
