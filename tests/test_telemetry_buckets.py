"""The downsampling of a telemetry history, pure (domain.telemetry_buckets): every sample in the
window counted in exactly one bucket and none outside, the availability states kept, a bucket
without a known number carrying none, the mean within min..max, and the window's limits."""

from __future__ import annotations

import math
import random
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from domain.telemetry_buckets import downsample
from domain.telemetry_history import (
    DEFAULT_POINTS,
    MAX_POINTS,
    MAX_STEP_SECONDS,
    Sample,
    Window,
    WindowRefused,
    bucket_index,
    default_step,
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


def _one_bucket(*values: float | int) -> tuple[float | None, float | None, float | None]:
    w = Window(since=SINCE, until=SINCE + timedelta(minutes=1), step_seconds=60)
    given = [Sample(SINCE + timedelta(seconds=s), {"power_watts": Known(v)}) for s, v in enumerate(values)]
    (power,) = downsample(w, given, ["power_watts"])
    bucket = power.points[0]
    return bucket.min, bucket.mean, bucket.max


def test_the_mean_is_the_exact_sum_over_the_count_where_adding_in_order_loses_digits() -> None:
    # 1e16 + 1 rounds back to 1e16: a plain sum says 0, the exact one 1
    assert _one_bucket(1e16, 1.0, -1e16) == (-1e16, 1 / 3, 1e16)
    assert _one_bucket(2**53, 1, -(2**53)) == (-(2.0**53), 1 / 3, 2.0**53)
    # whole numbers whose sums stay below 2**53 are added by numpy, exactly
    assert _one_bucket(2**51, 3, 2**51 + 2) == (3.0, (2**52 + 5) / 3, 2.0**51 + 2)


def test_zero_and_negative_zero_keep_which_came_first() -> None:
    # equal values: min and max are the first of them, as Python's min and max say
    for values in ((0.0, -0.0, 1.0), (-0.0, 0.0, 1.0)):
        low, mean, high = _one_bucket(*values)
        assert math.copysign(1.0, low) == math.copysign(1.0, values[0]) and (mean, high) == (1 / 3, 1.0)


def test_a_large_fleet_day_of_numbers_matches_the_plain_count() -> None:
    """A column of numbers long enough to be counted by numpy gives what a plain loop over the
    same values gives, bucket for bucket."""
    rng = random.Random(5)
    w = Window(since=SINCE, until=SINCE + timedelta(hours=24), step_seconds=173)
    values = [rng.choice([rng.randint(30, 90), round(rng.uniform(60, 700), 3)]) for _ in range(8640)]
    given = [
        Sample(SINCE + timedelta(seconds=10 * i + 5), {"power_watts": Known(v)}) for i, v in enumerate(values)
    ]
    (power,) = downsample(w, given, ["power_watts"])
    step = timedelta(seconds=w.step_seconds)
    for i, bucket in enumerate(power.points):
        inside = [
            float(v)
            for s, v in zip(given, values, strict=True)
            if bucket.start <= s.observed_at < bucket.start + step
        ]
        if not inside:
            assert bucket.count == 0 and bucket.mean is None
            continue
        mean = min(max(math.fsum(inside) / len(inside), min(inside)), max(inside))
        assert (bucket.count, bucket.min, bucket.mean, bucket.max) == (
            len(inside),
            min(inside),
            mean,
            max(inside),
        ), i


def test_samples_given_out_of_bucket_order_keep_their_order_within_a_bucket() -> None:
    """The states of a bucket are listed in the order its samples were given, however the
    buckets' samples interleave (the sort by bucket is stable)."""
    w = Window(since=SINCE, until=SINCE + timedelta(minutes=4), step_seconds=60)
    kinds: list[Fact] = [UNSUPPORTED, Known(3), UNKNOWN, Unavailable("no driver"), Known("P0")]
    # bucket 3, 2, 1, 0, 3, 2, ...: each bucket's samples far apart in the list, states varied
    given = [
        Sample(SINCE + timedelta(seconds=60 * (3 - i % 4) + i % 50), {"power_watts": kinds[(i // 4) % 5]})
        for i in range(80)
    ]
    (power,) = downsample(w, given, ["power_watts"])
    for b, bucket in enumerate(power.points):
        mine = [s.telemetry["power_watts"] for s in given if bucket_index(w, s.observed_at) == b]
        first_seen = list(dict.fromkeys(type(f).__struct_config__.tag for f in mine))
        assert list(bucket.states) == first_seen
