"""The fleet as Prometheus' HTTP service discovery reads it (docs/integrations.md): one target group
per node that is not decommissioned and has a hostname to scrape, its `__meta_modelforge_*`
labels from the same liveness rule and the same worst-GPU verdict as `/hardware/nodes`.

Always the whole list, never a page: Prometheus replaces its targets with every answer. So it is
one statement whatever the fleet's size, a row of a few short strings per node (about 300 bytes
of JSON): the nodes joined to their GPUs' summary grouped in one pass over `hw_accelerators`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from typing import LiteralString

import asyncpg
import msgspec

from api.services.reads.liveness import LIVENESS, LivenessPolicy
from api.services.reads.nodes import NODE_HEALTH
from api.services.reads.statement import Query, Statement

META_PREFIX = "__meta_modelforge_"
DEFAULT_PORT = 9400  # dcgm-exporter's; node_exporter's is 9100


class TargetLabels(msgspec.Struct, frozen=True, rename=lambda name: META_PREFIX + name):
    """A node's discovery labels: Prometheus label values are strings, an unknown one is empty
    (which Prometheus treats as the label's absence)."""

    node_id: str
    hostname: str
    liveness: str
    inventory_status: str
    health: str  # the worst verdict of the node's GPUs; healthy without GPUs
    gpu_count: str  # its GPUs that are not decommissioned (active and missing)
    gpu_models: str  # their known model names, distinct, sorted, comma-joined
    driver_version: str  # the node's NVIDIA driver, when known


class TargetGroup(msgspec.Struct, frozen=True):
    """One entry of the http_sd answer: `HOST:PORT` and its labels."""

    targets: list[str]
    labels: TargetLabels


# `h` carries the names NODE_HEALTH reads; a node without GPUs has no `h` row (NULLs: healthy).
# `driver_text`, `worst_health`: expressions named apart from the jsonb/text columns they read.
_SELECT: LiteralString = (
    "SELECT n.node_id, n.hostname, "
    + LIVENESS
    + " AS node_liveness, n.inventory_status, "
    + NODE_HEALTH
    + " AS worst_health, coalesce(h.gpu_count, 0) AS gpu_count, h.gpu_models, "
    "CASE WHEN n.driver_version->>'state' = 'known' THEN n.driver_version->>'value' END AS driver_text "
    "FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id "
    "LEFT JOIN (SELECT a.node_id, count(*) AS gpu_count, "
    "count(*) FILTER (WHERE a.health_status = 'degraded') AS health_degraded, "
    "count(*) FILTER (WHERE a.health_status = 'failed') AS health_failed, "
    "array_agg(DISTINCT a.name->>'value') FILTER (WHERE a.name->>'state' = 'known') AS gpu_models "
    "FROM hw_accelerators a WHERE a.status <> 'decommissioned' GROUP BY a.node_id) h "
    "ON h.node_id = n.node_id"
)


@functools.cache
def _statement(liveness: bool, health: bool) -> Statement:
    query = Query(_SELECT).where("n.status <> 'decommissioned'")
    query.where("coalesce(n.hostname, '') <> ''")  # nothing to scrape without one
    if liveness:
        query.where(LIVENESS + " = {liveness}")
    if health:
        query.where(NODE_HEALTH + " = {health}")
    return query.add(" ORDER BY n.node_id").build()


def target_group(r: asyncpg.Record, port: int) -> TargetGroup:
    return TargetGroup(
        targets=[f"{r['hostname']}:{port}"],
        labels=TargetLabels(
            node_id=r["node_id"],
            hostname=r["hostname"],
            liveness=r["node_liveness"],
            inventory_status=r["inventory_status"],
            health=r["worst_health"],
            gpu_count=str(r["gpu_count"]),
            gpu_models=",".join(sorted(r["gpu_models"] or [])),
            driver_version=r["driver_text"] or "",
        ),
    )


class DiscoveryReads:
    def __init__(self, pool: asyncpg.Pool, liveness: LivenessPolicy, clock: Callable[[], datetime]) -> None:
        self.pool = pool
        self.liveness = liveness
        self.clock = clock

    async def prometheus(
        self, *, port: int = DEFAULT_PORT, liveness: str | None = None, health: str | None = None
    ) -> list[TargetGroup]:
        """Every scrapable node's target group, by node id; the filters as `/hardware/nodes`'."""
        statement = _statement(liveness is not None, health is not None)
        values = {**self.liveness.values(self.clock()), "liveness": liveness, "health": health}
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(statement.sql, *statement.args(values))
        return [target_group(r, port) for r in rows]
