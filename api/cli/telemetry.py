"""`modelforge-hw gpu telemetry` and `node telemetry`: a GPU's or a host's telemetry history over
the HTTP API, one row per metric with its range over the window and a sparkline of the bucket
means (`-` for a bucket without samples, a gap; `·` for one whose samples have no number: a
metric the device does not report, a performance state).
The table reads as the console does (a metric's label, values with their units); `-o json` is
the API's document, with the metrics' API names and raw values."""

from __future__ import annotations

import enum
import math
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from api.cli.errors import CliError
from api.cli.moments import parse_moment
from api.cli.remote import Api, Server, Token, TokenFile, connect, resolve_gpu, resolve_node
from api.cli.rendering import Output as Documents
from api.cli.rendering import emit, table, when
from api.services.wording import fact_label, known_text

if TYPE_CHECKING:
    from collections.abc import Sequence

    from api.services.reads.telemetry import TelemetryHistoryBody
    from domain.telemetry_history import Bucket, Series

# A sparkline of this many buckets fits a 100-column terminal beside the metric and its range.
CLI_POINTS = 40
SPARKS = "▁▂▃▄▅▆▇█"
GAP = "-"
NO_NUMBER = "·"


class HistoryOutput(enum.StrEnum):
    table = "table"
    json = "json"


OutputOpt = Annotated[HistoryOutput, typer.Option("--output", "-o", help="table or json.")]
SinceOpt = Annotated[
    str, typer.Option("--since", help="Start: a duration before now (6h, 2d) or an ISO 8601 time.")
]
UntilOpt = Annotated[
    str | None,
    typer.Option("--until", help="End (exclusive): a duration before now or an ISO 8601 time; default now."),
]
StepOpt = Annotated[
    int | None,
    typer.Option(
        "--step", min=1, help=f"Bucket width in seconds; default: {CLI_POINTS} buckets.", show_default=False
    ),
]


def sparkline(points: Sequence[Bucket]) -> str:
    """One character per bucket, its mean scaled from the lowest mean to the highest. Without a
    mean: `·` where the bucket has samples without a number (an unsupported metric, a performance
    state), `-` where it has none (a gap), so that a gap reads as one on every row."""
    known = [b.mean for b in points if b.mean is not None]
    low, high = (min(known), max(known)) if known else (0.0, 0.0)
    top = len(SPARKS) - 1
    return "".join(
        (NO_NUMBER if b.count else GAP)
        if b.mean is None
        else SPARKS[0 if high == low else round((b.mean - low) / (high - low) * top)]
        for b in points
    )


def reading(metric: str, value: float | None) -> str:
    """A value of the metric with its unit (`70 °C`, `22.6 GiB`), `-` for none."""
    if value is None:
        return "-"
    return known_text(metric, int(value) if value.is_integer() else value)


def overall(series: Series) -> tuple[float | None, float | None, float | None]:
    """The window's min, mean (weighted by each bucket's known values) and max."""
    buckets = [b for b in series.points if b.mean is not None]
    if not buckets:
        return None, None, None
    weights = [b.states.get("known", 1) for b in buckets]
    mean = math.fsum((b.mean or 0.0) * w for b, w in zip(buckets, weights, strict=True)) / sum(weights)
    lows = [b.min for b in buckets if b.min is not None]
    highs = [b.max for b in buckets if b.max is not None]
    return min(lows), min(max(mean, min(lows)), max(highs)), max(highs)


def seen(series: Series) -> str:
    """The availability states other than `known` seen over the window (`unsupported ×3`), and
    known values that are not numbers (a performance state, `P0`), which have no range to show."""
    states: dict[str, int] = {}
    for bucket in series.points:
        for state, count in bucket.states.items():
            states[state] = states.get(state, 0) + count
    known = states.pop("known", 0)
    words = [f"{state} ×{count}" for state, count in sorted(states.items())]
    if known and all(b.mean is None for b in series.points):
        words.insert(0, f"known ×{known}, not numbers")
    return ", ".join(words)


def history_table(body: TelemetryHistoryBody) -> None:
    print(
        f"{body.subject} {body.uuid or body.id}: {when(body.since)} .. {when(body.until)}, "
        f"{body.step_seconds} s per bucket, {body.samples} samples"
    )
    rows = []
    for series in body.series:
        low, mean, high = overall(series)
        rows.append(
            [
                fact_label(series.metric),
                reading(series.metric, low),
                reading(series.metric, mean),
                reading(series.metric, high),
                sparkline(series.points),
                seen(series),
            ]
        )
    table(["METRIC", "MIN", "MEAN", "MAX", "HISTORY", "OTHER STATES"], rows, ids=(0, 4))


def fetch(api: Api, path: str, since: str, until: str | None, step: int | None) -> TelemetryHistoryBody:
    """The history over the window the flags name (durations counted back from now)."""
    import msgspec

    from api.services.reads.telemetry import TelemetryHistoryBody

    now = datetime.now(UTC)
    end = parse_moment(until, now) if until is not None else now
    start = parse_moment(since, now)
    if start >= end:
        raise CliError(f"--since ({when(start)}) must be before --until ({when(end)})")
    if step is None:
        step = max(1, math.ceil((end - start).total_seconds() / CLI_POINTS))
    params = [("since", start.isoformat()), ("until", end.isoformat()), ("step", str(step))]
    return msgspec.json.decode(api.get(path, params), type=TelemetryHistoryBody)


def show(body: TelemetryHistoryBody, output: HistoryOutput) -> None:
    if output is HistoryOutput.json:
        emit(body, Documents.json)
    else:
        history_table(body)


def gpu_telemetry(
    gpu: Annotated[str, typer.Argument(help="GPU UUID, UUID prefix or id prefix.", show_default=False)],
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    since: SinceOpt = "1h",
    until: UntilOpt = None,
    step: StepOpt = None,
    output: OutputOpt = HistoryOutput.table,
) -> None:
    """One GPU's telemetry history: per metric its min, mean and max and a sparkline."""
    api = connect(server, token, token_file)
    found = resolve_gpu(api.accelerators(), gpu)
    show(fetch(api, f"/hardware/accelerators/{found.id}/telemetry", since, until, step), output)


def node_telemetry(
    node: Annotated[
        str, typer.Argument(help="Node id, identity key, id prefix or hostname.", show_default=False)
    ],
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    since: SinceOpt = "1h",
    until: UntilOpt = None,
    step: StepOpt = None,
    output: OutputOpt = HistoryOutput.table,
) -> None:
    """One node's host telemetry history: per metric its min, mean and max and a sparkline."""
    api = connect(server, token, token_file)
    found = resolve_node(api.nodes(), node)
    show(fetch(api, f"/hardware/nodes/{found.id}/telemetry", since, until, step), output)
