"""The downsampling of a telemetry history, pure (domain.telemetry_history): every sample in the
window counted in exactly one bucket and none outside, the availability states kept, a bucket
without a known number carrying none, the mean within min..max, and the window's limits."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from domain.telemetry_history import (
    DEFAULT_POINTS,
    MAX_POINTS,
    MAX_STEP_SECONDS,
    Sample,
    Window,
    WindowRefused,
    bucket_index,
    default_step,
    downsample,
    window,
)

SINCE = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
METRICS = ("temperature_celsius", "power_watts", "performance_state")

facts: st.SearchStrategy[Fact] = st.one_of(
    st.builds(Known, st.integers(-1000, 10**12)),
    st.builds(Known, st.floats(-1e6, 1e6, allow_nan=False)),
    st.builds(Known, st.sampled_from(["P0", "P8"])),
    st.builds(Known, st.booleans()),
    st.just(UNKNOWN),
    st.just(UNSUPPORTED),
    st.builds(Unavailable, st.just("no driver")),
    st.builds(TemporarilyFailed, st.just("timeout")),
)
samples = st.lists(
    st.builds(
        Sample,
        # Some before the window and some after it, to be left out.
        observed_at=st.integers(-600, 4200).map(lambda s: SINCE + timedelta(seconds=s / 2)),
        telemetry=st.dictionaries(st.sampled_from(METRICS), facts),
    ),
    max_size=60,
)
windows = st.builds(
    lambda span, step: Window(since=SINCE, until=SINCE + timedelta(seconds=span), step_seconds=step),
    st.integers(1, 2000),
    st.integers(1, 400),
)


def _number(fact: Fact) -> float | None:
    ok = isinstance(fact, Known) and isinstance(fact.value, int | float) and not isinstance(fact.value, bool)
    return float(fact.value) if ok else None  # type: ignore[union-attr, arg-type]


@given(windows, samples)
def test_every_sample_in_the_window_is_counted_once_with_its_state(
    w: Window, given_samples: list[Sample]
) -> None:
    series = downsample(w, given_samples, METRICS)
    assert [s.metric for s in series] == list(METRICS)
    inside = [s for s in given_samples if w.since <= s.observed_at < w.until]
    for one in series:
        assert len(one.points) == w.points
        seen: Counter[str] = Counter()
        for bucket in one.points:
            seen.update(bucket.states)
            assert sum(bucket.states.values()) == bucket.count
        expected = Counter(
            s.telemetry[one.metric].__struct_config__.tag for s in inside if one.metric in s.telemetry
        )
        assert seen == expected


@given(windows, samples)
def test_buckets_have_their_bounds_and_numbers_only_from_known_values(
    w: Window, given_samples: list[Sample]
) -> None:
    step = timedelta(seconds=w.step_seconds)
    for one in downsample(w, given_samples, METRICS):
        for i, bucket in enumerate(one.points):
            assert bucket.start == w.since + i * step
            end = min(bucket.start + step, w.until)
            numbers = [
                n
                for s in given_samples
                if bucket.start <= s.observed_at < end and one.metric in s.telemetry
                for n in [_number(s.telemetry[one.metric])]
                if n is not None
            ]
            if not numbers:
                assert (bucket.min, bucket.mean, bucket.max) == (None, None, None)
                continue
            assert bucket.min == min(numbers) and bucket.max == max(numbers)
            assert bucket.mean is not None and bucket.min <= bucket.mean <= bucket.max


@given(windows, st.integers(-10_000, 10_000))
def test_a_moment_falls_in_the_bucket_that_holds_it(w: Window, offset: int) -> None:
    at = w.since + timedelta(seconds=offset / 3)
    i = bucket_index(w, at)
    if at < w.since or at >= w.until:
        assert i is None
    else:
        assert i is not None and 0 <= i < w.points
        start = w.since + i * timedelta(seconds=w.step_seconds)
        assert start <= at < start + timedelta(seconds=w.step_seconds)


@given(st.integers(1, 400 * 86400))
def test_the_default_step_keeps_a_series_at_most_500_points(span: int) -> None:
    w = window(SINCE, SINCE + timedelta(seconds=span), None)
    assert 1 <= w.points <= DEFAULT_POINTS and w.step_seconds == default_step(w.since, w.until)


def test_the_window_refuses_naming_the_parameter() -> None:
    hour = SINCE + timedelta(hours=1)
    with pytest.raises(WindowRefused) as backwards:
        window(hour, SINCE, None)
    assert backwards.value.parameter == "since"
    with pytest.raises(WindowRefused) as empty:
        window(SINCE, SINCE, 60)
    assert empty.value.parameter == "since"
    for step in (0, MAX_STEP_SECONDS + 1):
        with pytest.raises(WindowRefused) as refused:
            window(SINCE, hour, step)
        assert refused.value.parameter == "step"
    with pytest.raises(WindowRefused) as too_many:
        window(SINCE, SINCE + timedelta(seconds=MAX_POINTS + 1), 1)
    assert too_many.value.parameter == "step" and str(MAX_POINTS) in too_many.value.detail
    assert window(SINCE, SINCE + timedelta(seconds=MAX_POINTS), 1).points == MAX_POINTS


def test_equal_values_have_that_mean_and_an_empty_bucket_no_number() -> None:
    w = Window(since=SINCE, until=SINCE + timedelta(minutes=2), step_seconds=60)
    same = [Sample(SINCE + timedelta(seconds=s), {"power_watts": Known(0.1)}) for s in range(0, 60, 7)]
    (power,) = downsample(w, same, ["power_watts"])
    assert (power.points[0].min, power.points[0].mean, power.points[0].max) == (0.1, 0.1, 0.1)
    assert power.points[1].count == 0 and power.points[1].mean is None and power.points[1].states == {}


def test_values_whose_sum_overflows_still_have_their_mean() -> None:
    w = Window(since=SINCE, until=SINCE + timedelta(minutes=1), step_seconds=60)
    huge = [Sample(SINCE + timedelta(seconds=s), {"power_watts": Known(1e308)}) for s in (1, 2)]
    (power,) = downsample(w, huge, ["power_watts"])
    assert (power.points[0].min, power.points[0].mean, power.points[0].max) == (1e308, 1e308, 1e308)
