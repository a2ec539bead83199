"""Telemetry charts drawn on the server as inline SVG: no script, no CDN, readable with the page's
own stylesheet. A bucket without a known value is a gap in the line, never a 0; a metric the GPU
does not support is said in words instead of drawn."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from html import escape

import msgspec

from api.services.reads.telemetry import TelemetryHistoryBody

WIDTH, HEIGHT = 640, 160
_LEFT, _RIGHT, _TOP, _BOTTOM = 48, 8, 8, 20


class ChartPoint(msgspec.Struct, frozen=True):
    """One bucket: its start, and the min / mean / max of its known values (None: none known)."""

    at: datetime
    mean: float | None
    low: float | None = None
    high: float | None = None


def runs(points: Sequence[ChartPoint]) -> list[list[ChartPoint]]:
    """The points with a value, split where a bucket has none: each run is drawn as one line."""
    out: list[list[ChartPoint]] = []
    current: list[ChartPoint] = []
    for p in points:
        if p.mean is None:
            if current:
                out.append(current)
            current = []
        else:
            current.append(p)
    if current:
        out.append(current)
    return out


def _fmt(value: float) -> str:
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.1f}"


def line_chart(
    points: Sequence[ChartPoint], *, since: datetime, until: datetime, title: str, unit: str, metric: str
) -> str:
    """An SVG line of the means with a band from min to max; the axis spans since..until."""
    known = [p for p in points if p.mean is not None]
    label = escape(f"{title} ({unit})" if unit else title)
    if not known:
        return (
            f'<p class="chart-empty" data-chart="{escape(metric)}">{label}: no known value in this window</p>'
        )
    values = [v for p in known for v in (p.low, p.mean, p.high) if v is not None]
    lo, hi = min(0.0, min(values)), max(values)
    if hi == lo:
        hi = lo + 1.0
    span = max((until - since).total_seconds(), 1.0)
    plot_w, plot_h = WIDTH - _LEFT - _RIGHT, HEIGHT - _TOP - _BOTTOM

    def x(at: datetime) -> float:
        return _LEFT + plot_w * min(max((at - since).total_seconds() / span, 0.0), 1.0)

    def y(v: float) -> float:
        return _TOP + plot_h * (1 - (v - lo) / (hi - lo))

    parts = [
        f'<svg class="chart" data-chart="{escape(metric)}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'role="img" aria-label="{label}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{label}</title>",
        f'<line class="axis" x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{WIDTH - _RIGHT}" y2="{_TOP + plot_h}"/>',
        f'<text class="tick" x="{_LEFT - 4}" y="{_TOP + 10}" text-anchor="end">{_fmt(hi)}</text>',
        f'<text class="tick" x="{_LEFT - 4}" y="{_TOP + plot_h}" text-anchor="end">{_fmt(lo)}</text>',
        f'<text class="tick" x="{_LEFT}" y="{HEIGHT - 4}">{since:%H:%M}</text>',
        f'<text class="tick" x="{WIDTH - _RIGHT}" y="{HEIGHT - 4}" text-anchor="end">'
        f"{until:%H:%M} UTC</text>",
    ]
    for run in runs(points):
        band = [p for p in run if p.low is not None and p.high is not None]
        if len(band) > 1:
            top = " ".join(f"{x(p.at):.1f},{y(p.high):.1f}" for p in band if p.high is not None)
            bottom = " ".join(f"{x(p.at):.1f},{y(p.low):.1f}" for p in reversed(band) if p.low is not None)
            parts.append(f'<polygon class="band" points="{top} {bottom}"/>')
        line = " ".join(f"{x(p.at):.1f},{y(p.mean):.1f}" for p in run if p.mean is not None)
        parts.append(f'<polyline class="line" data-points="{len(run)}" points="{line}"/>')
        if len(run) == 1:  # a lone bucket between gaps is a dot, not an invisible line
            p = run[0]
            assert p.mean is not None
            parts.append(f'<circle class="dot" cx="{x(p.at):.1f}" cy="{y(p.mean):.1f}" r="2"/>')
    parts.append("</svg>")
    return "".join(parts)


class Chart(msgspec.Struct, frozen=True):
    """One metric's chart on a page: the drawn SVG, or why there is nothing to draw."""

    metric: str
    svg: str  # the SVG, or a sentence saying why nothing is drawn
    unit: str = ""  # of the axis' values, for the caption: "Memory used (GiB)"

    @property
    def drawn(self) -> bool:
        return self.svg.startswith("<svg")


# The metrics a page charts, in the order an operator scans them, with how values are shown.
GPU_CHARTS: tuple[tuple[str, str, float], ...] = (
    ("utilization_gpu_percent", "%", 1.0),
    ("memory_used_bytes", "GiB", 2.0**30),
    ("temperature_celsius", "°C", 1.0),
    ("power_watts", "W", 1.0),
    ("clock_sm_mhz", "MHz", 1.0),
    ("clock_memory_mhz", "MHz", 1.0),
)
HOST_CHARTS: tuple[tuple[str, str, float], ...] = (("memory_available_bytes", "GiB", 2.0**30),)

# Buckets per chart: 30 s over an hour, 3 min over 6 h, 12 min over a day. An agent reports every
# 10 s by default, so a bucket without a sample (a gap in the line) is a real silence.
CHART_BUCKETS = 120

WINDOWS: dict[str, timedelta] = {
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
}


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value / scale


def charts_of(
    history: TelemetryHistoryBody, wanted: tuple[tuple[str, str, float], ...], label: Callable[[str], str]
) -> list[Chart]:
    """The charts of `wanted` metrics from one history answer. A metric the device reported only as
    unsupported is said to be so; one never reported in the window says that."""
    series = {s.metric: s for s in history.series}
    out: list[Chart] = []
    for metric, unit, scale in wanted:
        s = series.get(metric)
        states: dict[str, int] = {}
        for b in s.points if s else []:
            for state, n in b.states.items():
                states[state] = states.get(state, 0) + n
        title = escape(label(metric))
        if states and set(states) == {"unsupported"}:
            note = f'<p class="chart-empty" data-chart="{metric}">{title}: not supported</p>'
            out.append(Chart(metric, note))
            continue
        points = [
            ChartPoint(
                at=b.start, mean=_scaled(b.mean, scale), low=_scaled(b.min, scale), high=_scaled(b.max, scale)
            )
            for b in (s.points if s else [])
        ]
        svg = line_chart(
            points, since=history.since, until=history.until, title=label(metric), unit=unit, metric=metric
        )
        out.append(Chart(metric, svg, unit))
    return out
