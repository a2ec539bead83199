"""The lemon ranking without I/O (domain/lemons.py), by hypothesis: the time in service is the
union of a GPU's times on its nodes cut to the window; every GPU that failed in the window is
ranked once, by failures per day of at least a day's service; moving a GPU between nodes does not
change its record; the window's start as typed is refused when it names no window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.lemons import (
    MAX_SPAN,
    MIN_SERVICE_DAYS,
    Failure,
    SinceRefused,
    Tenure,
    checked_since,
    rank,
    service_days,
    since_of,
)

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
SINCE = NOW - timedelta(days=90)
UUIDS = [f"GPU-{n}" for n in range(4)]

moments = st.integers(min_value=-200 * 86400, max_value=10 * 86400).map(lambda s: NOW + timedelta(seconds=s))


@st.composite
def tenures(draw: st.DrawFn, node: str | None = None) -> Tenure:
    start = draw(moments)
    length = timedelta(seconds=draw(st.integers(min_value=0, max_value=120 * 86400)))
    return Tenure(
        node_id=node or draw(st.sampled_from("abc")), first_seen_at=start, last_seen_at=start + length
    )


@st.composite
def failures(draw: st.DrawFn) -> list[Failure]:
    out = []
    for k in range(draw(st.integers(min_value=0, max_value=12))):
        out.append(
            Failure(
                global_position=k + 1,
                event_type="ACCELERATOR_HEALTH_CHANGED",
                at=draw(moments),
                node_id=draw(st.sampled_from("abc")),
                accelerator_id="acc",
                uuid=draw(st.sampled_from(UUIDS)),
                reasons=["xid_79"],
            )
        )
    return draw(st.permutations(out))


@given(st.lists(tenures(), max_size=6))
def test_service_is_the_union_of_the_times_cut_to_the_window(spans: list[Tenure]) -> None:
    days = service_days(spans, SINCE, NOW)
    assert 0 <= days <= 90 + 1e-9
    clipped = [
        max(timedelta(0), min(t.last_seen_at, NOW) - max(t.first_seen_at, SINCE)) / timedelta(days=1)
        for t in spans
    ]
    # never more than the times added up, never less than the longest of them
    assert max(clipped, default=0) - 1e-9 <= days <= sum(clipped) + 1e-9


@given(tenures(node="a"), st.floats(min_value=0, max_value=1))
def test_a_gpu_moved_keeps_its_time_in_service(whole: Tenure, cut: float) -> None:
    # The same time on one node, or split between two at any moment: the same days.
    middle = whole.first_seen_at + (whole.last_seen_at - whole.first_seen_at) * cut
    moved = [
        Tenure(node_id="a", first_seen_at=whole.first_seen_at, last_seen_at=middle),
        Tenure(node_id="b", first_seen_at=middle, last_seen_at=whole.last_seen_at),
    ]
    assert abs(service_days(moved, SINCE, NOW) - service_days([whole], SINCE, NOW)) < 1e-6


@given(failures(), st.dictionaries(st.sampled_from(UUIDS), st.lists(tenures(), max_size=3)))
def test_every_gpu_that_failed_is_ranked_once_by_failures_per_day(
    found: list[Failure], spans: dict[str, list[Tenure]]
) -> None:
    ranked = rank(found, spans, SINCE, NOW)
    in_window = [f for f in found if SINCE <= f.at < NOW]
    assert sorted(g.uuid for g in ranked) == sorted({f.uuid for f in in_window})
    for g in ranked:
        mine = sorted((f for f in in_window if f.uuid == g.uuid), key=lambda f: f.global_position)
        assert g.evidence == mine and g.failures == len(mine) > 0
        assert g.service_days == service_days(spans.get(g.uuid, []), SINCE, NOW)
        assert g.failures_per_day == g.failures / max(g.service_days, MIN_SERVICE_DAYS)
        assert g.failures_per_day <= g.failures
    keys = [(-g.failures_per_day, -g.failures, g.uuid) for g in ranked]
    assert keys == sorted(keys)


@given(failures(), st.dictionaries(st.sampled_from(UUIDS), st.lists(tenures(), max_size=3)))
def test_the_ranking_does_not_depend_on_the_order_it_is_given(
    found: list[Failure], spans: dict[str, list[Tenure]]
) -> None:
    assert rank(found, spans, SINCE, NOW) == rank(list(reversed(found)), spans, SINCE, NOW)


def test_the_window_start_as_typed() -> None:
    assert since_of("90d", NOW) == NOW - timedelta(days=90)
    assert since_of(" 12h ", NOW) == NOW - timedelta(hours=12)
    assert since_of("2w", NOW) == NOW - timedelta(weeks=2)
    assert since_of("2026-12-01T00:00:00", NOW) == datetime(2026, 12, 1, tzinfo=UTC)
    assert since_of("2026-12-01T01:00:00+01:00", NOW) == datetime(2026, 12, 1, tzinfo=UTC)
    for text in ("0d", "yesterday", "90", "-3d", "3y", "99999999d", "2026-12-04T00:00:00Z", "2010-01-01"):
        with pytest.raises(SinceRefused):
            since_of(text, NOW)


@given(st.integers(min_value=-20 * 366 * 86400, max_value=86400))
def test_a_start_is_a_window_only_before_now_and_within_ten_years(seconds: int) -> None:
    moment = NOW + timedelta(seconds=seconds)
    if moment < NOW and NOW - moment <= MAX_SPAN:
        assert checked_since(moment, NOW) == moment
    else:
        with pytest.raises(SinceRefused):
            checked_since(moment, NOW)
