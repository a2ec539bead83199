"""Prometheus HTTP service discovery (docs/integrations.md): the fleet's nodes as `http_sd_configs`
target groups. Operator and viewer scope, so Prometheus holds a token that cannot change the fleet."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import get
from litestar.di import NamedDependency
from litestar.params import QueryParameter

from api.services.reads.discovery import DEFAULT_PORT, TargetGroup
from api.services.reads.liveness import Liveness
from api.services.reads.repository import HardwareRepository
from ledger.events import HealthStatus


@get(
    "/sd/prometheus",
    summary="Prometheus http_sd targets: every node not decommissioned (port, liveness, health)",
)
async def list_prometheus_targets(
    repository: NamedDependency[HardwareRepository],
    port: Annotated[
        int,
        QueryParameter(
            ge=1,
            le=65535,
            description=f"the exporter's port on each node; default {DEFAULT_PORT} (dcgm-exporter), "
            "9100 for node_exporter",
        ),
    ] = DEFAULT_PORT,
    liveness: Annotated[Liveness | None, QueryParameter(description="as on /hardware/nodes")] = None,
    health: Annotated[
        HealthStatus | None,
        QueryParameter(description="the node's worst GPU verdict, as on /hardware/nodes"),
    ] = None,
) -> list[TargetGroup]:
    return await repository.discovery.prometheus(port=port, liveness=liveness, health=health)


DISCOVERY_ROUTES: list[Any] = [list_prometheus_targets]
