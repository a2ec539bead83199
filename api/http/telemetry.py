"""The telemetry history of one GPU or one host, downsampled (docs/telemetry.md): operator and
viewer scope, like the other hardware reads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromPath, QueryParameter

from api.services.reads.repository import HardwareRepository
from api.services.reads.telemetry import TelemetryHistoryBody, checked_window, invalid_parameter
from domain.telemetry_history import DEFAULT_POINTS, MAX_POINTS, MAX_STEP_SECONDS, MIN_STEP_SECONDS, Window

DEFAULT_SPAN = timedelta(hours=1)

Since = Annotated[
    datetime | None, QueryParameter(description="start of the window (RFC 3339); default until - 1 h")
]
Until = Annotated[datetime | None, QueryParameter(description="end of the window, exclusive; default now")]
Step = Annotated[
    int | None,
    QueryParameter(
        ge=MIN_STEP_SECONDS,
        le=MAX_STEP_SECONDS,
        description=f"bucket width in seconds, at least 1; default: at most {DEFAULT_POINTS} points. "
        f"More than {MAX_POINTS} points per series is refused",
    ),
]


def _aware(moment: datetime) -> datetime:
    """A moment without an offset is taken as UTC (the ledger's clock), never as server-local."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _window(
    repository: HardwareRepository, since: datetime | None, until: datetime | None, step: int | None
) -> Window:
    end = _aware(until) if until is not None else repository.clock()
    try:
        start = _aware(since) if since is not None else end - DEFAULT_SPAN
    except OverflowError as exc:
        raise invalid_parameter("until", "until is too early for the default since (until - 1 h)") from exc
    return checked_window(start, end, step)


@get(
    "/hardware/accelerators/{accelerator_id:str}/telemetry",
    summary="One accelerator's telemetry history, downsampled (since, until, step)",
)
async def get_accelerator_telemetry(
    repository: NamedDependency[HardwareRepository],
    accelerator_id: FromPath[str],
    since: Since = None,
    until: Until = None,
    step: Step = None,
) -> TelemetryHistoryBody:
    return await repository.telemetry.accelerator(accelerator_id, _window(repository, since, until, step))


@get(
    "/hardware/nodes/{node_id:str}/telemetry",
    summary="One node's host telemetry history, downsampled (since, until, step)",
)
async def get_node_telemetry(
    repository: NamedDependency[HardwareRepository],
    node_id: FromPath[str],
    since: Since = None,
    until: Until = None,
    step: Step = None,
) -> TelemetryHistoryBody:
    return await repository.telemetry.node(node_id, _window(repository, since, until, step))


TELEMETRY_ROUTES: list[Any] = [get_accelerator_telemetry, get_node_telemetry]
