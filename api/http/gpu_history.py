"""A GPU's history by UUID across every node it was in, and the fleet's lemon GPUs
(docs/lemons.md): operator and viewer scope, like the other hardware reads."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, QueryParameter

from api.services.reads.bodies import MAX_LIMIT
from api.services.reads.gpu_history import GpuHistoryBody
from api.services.reads.lemons import LemonsBody
from api.services.reads.repository import HardwareRepository
from domain.lemons import DEFAULT_SINCE

DEFAULT_LEMONS = 50


@get(
    "/hardware/gpus/{gpu_uuid:str}/history",
    summary="One GPU's lifecycle and health events by UUID, across every node it was in (paged)",
)
async def get_gpu_history(
    repository: NamedDependency[HardwareRepository],
    gpu_uuid: FromPath[str],
    cursor: FromQuery[str | None] = None,
    limit: Annotated[int, QueryParameter(ge=1, le=MAX_LIMIT)] = 100,
) -> GpuHistoryBody:
    return await repository.gpu_history.page(gpu_uuid, cursor=cursor, limit=limit)


@get(
    "/hardware/health/lemons",
    summary="GPUs ranked by failures per day of service over a window, with the evidence",
)
async def list_lemons(
    repository: NamedDependency[HardwareRepository],
    since: Annotated[
        datetime | None,
        QueryParameter(description=f"start of the window (RFC 3339); default now - {DEFAULT_SINCE}"),
    ] = None,
    limit: Annotated[int, QueryParameter(ge=1, le=MAX_LIMIT)] = DEFAULT_LEMONS,
) -> LemonsBody:
    return await repository.lemons.ranked(since=since, limit=limit)


GPU_HISTORY_ROUTES: list[Any] = [get_gpu_history, list_lemons]
