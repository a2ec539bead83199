"""Console telemetry charts (api/http/console/charts.py): pure, property-tested. A gap is drawn
as a gap (the line stops and starts again), never as a 0; every known bucket is drawn once."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from api.http.console.charts import ChartPoint, line_chart, runs

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def _points(means: list[float | None]) -> list[ChartPoint]:
    return [
        ChartPoint(
            at=T0 + timedelta(minutes=i),
            mean=m,
            low=None if m is None else m - 1,
            high=None if m is None else m + 1,
        )
        for i, m in enumerate(means)
    ]


def _chart(means: list[float | None]) -> str:
    return line_chart(
        _points(means),
        since=T0,
        until=T0 + timedelta(minutes=len(means)),
        title="Power draw",
        unit="W",
        metric="power_watts",
    )


def test_a_gap_splits_the_line_and_nothing_is_drawn_at_zero() -> None:
    svg = _chart([300.0, 310.0, None, None, 305.0, 300.0])
    lines = re.findall(r'<polyline class="line" data-points="(\d+)" points="([^"]+)"', svg)
    assert [int(n) for n, _ in lines] == [2, 2]
    # The axis starts at 0 here, so a 0 would sit on the bottom line (y = 140): none does.
    ys = [float(p.split(",")[1]) for _, pts in lines for p in pts.split()]
    assert all(y < 139 for y in ys), ys


def test_a_window_with_no_known_value_says_so_in_words() -> None:
    html = _chart([None, None])
    assert (
        "<svg" not in html and "no known value in this window" in html and 'data-chart="power_watts"' in html
    )


@given(st.lists(st.one_of(st.none(), st.floats(min_value=-50, max_value=1e6)), max_size=60))
def test_every_known_bucket_is_drawn_once_in_runs_split_at_gaps(means: list[float | None]) -> None:
    svg = _chart(means)
    drawn = [int(n) for n in re.findall(r'<polyline class="line" data-points="(\d+)"', svg)]
    assert sum(drawn) == sum(m is not None for m in means)
    assert len(drawn) == len(runs(_points(means)))
    # Runs never touch: between two runs at least one bucket had no value.
    expected_runs = len([r for r in "".join("x" if m is not None else " " for m in means).split(" ") if r])
    assert len(drawn) == expected_runs
