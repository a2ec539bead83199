"""Compute nodes as the API shows them: a page by id (with the list's filters), one node, and
one node rendered with until when its liveness verdict holds."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, LiteralString

import asyncpg
import msgspec

from api.services.reads.bodies import CpuBody, NodeBody, NodeHealthBody, OsBody, StorageBody
from api.services.reads.cursors import decode_id_cursor, id_page
from api.services.reads.facts import plain, stored_fact, stored_facts
from api.services.reads.liveness import LIVENESS, LIVENESS_UNTIL, LivenessPolicy
from api.services.reads.rendering import Loaded, render
from api.services.reads.statement import Query, Statement
from collectors.facts import Fact
from ledger.events import HealthStatus

# A node row: hw_nodes with its telemetry, its storage, its liveness by the one rule (and until
# when that verdict holds), and its GPUs by verdict: decommissioned ones are no longer the node's
# to take work. Its slots are the liveness rule's.
NODE_SELECT: LiteralString = (
    "SELECT n.*, t.metrics AS host_metrics, t.observed_at AS telemetry_observed_at, "
    "coalesce(t.received_at, n.final_received_at) AS last_received_at, t.observed_at AS last_observed_at, "
    "t.clock_skew_seconds, greatest(n.first_seen_at, t.received_at, n.final_received_at) AS last_seen_at, "
    + LIVENESS
    + " AS liveness, "
    + LIVENESS_UNTIL
    + " AS liveness_until, "
    "coalesce((SELECT jsonb_agg(jsonb_build_object('mount', s.mount, 'used_bytes', s.used_bytes, "
    "'total_bytes', s.total_bytes) ORDER BY s.mount) "
    "FROM hw_node_storage s WHERE s.node_id = n.node_id), '[]'::jsonb) AS storage, "
    "h.health_healthy, h.health_degraded, h.health_failed "
    "FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id "
    "LEFT JOIN LATERAL ("
    "SELECT count(*) FILTER (WHERE a.health_status = 'healthy') AS health_healthy, "
    "count(*) FILTER (WHERE a.health_status = 'degraded') AS health_degraded, "
    "count(*) FILTER (WHERE a.health_status = 'failed') AS health_failed "
    "FROM hw_accelerators a WHERE a.node_id = n.node_id AND a.status <> 'decommissioned'"
    ") h ON true"
)
# `node_health` in SQL, so the lists filter by the node's worst verdict on the server.
NODE_HEALTH: LiteralString = (
    "(CASE WHEN h.health_failed > 0 THEN 'failed' WHEN h.health_degraded > 0 THEN 'degraded' "
    "ELSE 'healthy' END)"
)

_ONE_NODE = Query(NODE_SELECT).where("n.node_id = {node_id}").build()


@functools.cache
def _page(hostname: bool, liveness: bool, inventory_status: bool, health: bool) -> Statement:
    """The page's statement for the filters given (the keyset goes first)."""
    query = Query(NODE_SELECT).where("n.node_id > {after}")
    if hostname:
        query.where("lower(n.hostname) = lower({hostname})")  # hostnames are case-insensitive (DNS)
    if liveness:
        query.where(LIVENESS + " = {liveness}")
    if inventory_status:
        query.where("n.inventory_status = {inventory_status}")
    if health:
        query.where(NODE_HEALTH + " = {health}")
    return query.add(" ORDER BY n.node_id LIMIT {limit}").build()


def node_health(healthy: int, degraded: int, failed: int) -> NodeHealthBody:
    """The node's summary from its GPUs' counts by verdict: the worst verdict present."""
    worst: HealthStatus = "failed" if failed else "degraded" if degraded else "healthy"
    return NodeHealthBody(status=worst, healthy=healthy, degraded=degraded, failed=failed)


def node_body(r: asyncpg.Record | Mapping[str, Any]) -> NodeBody:
    """A node row (`NODE_SELECT`'s, or an as-of record of the same shape) as its body."""
    os_facts = stored_facts(r["os"])
    cpu_facts = stored_facts(r["cpu"])
    memory = stored_fact(r["memory_total_bytes"])
    driver = stored_fact(r["driver_version"])
    cuda = stored_fact(r["cuda_driver_version"])
    facts: dict[str, Fact] = {f"os.{k}": v for k, v in os_facts.items()}
    facts.update({f"cpu.{k}": v for k, v in cpu_facts.items()})
    facts.update(memory_total_bytes=memory, driver_version=driver, cuda_driver_version=cuda)
    return NodeBody(
        id=r["node_id"],
        identity_key=r["identity_key"],
        identity_source=r["identity_source"],
        hostname=r["hostname"],
        display_name=r["display_name"],
        status=r["status"],
        liveness=r["liveness"],
        inventory_status=r["inventory_status"],
        inventory_reasons=list(r["inventory_reasons"] or []),
        accelerator_capability=r["accelerator_capability"],
        fingerprint=r["fingerprint"],
        fingerprint_position=r["fingerprint_position"],
        os=OsBody(
            **{
                k: plain(os_facts[k]) if k in os_facts else None
                for k in ("name", "version", "kernel", "architecture")
            }
        ),
        cpu=CpuBody(
            **{
                k: plain(cpu_facts[k]) if k in cpu_facts else None
                for k in ("model", "sockets", "physical_cores", "logical_cores")
            }
        ),
        memory_total_bytes=plain(memory),
        driver_version=plain(driver),
        cuda_driver_version=plain(cuda),
        storage=msgspec.convert(r["storage"], list[StorageBody]),
        telemetry=stored_facts(r["host_metrics"]),
        telemetry_observed_at=r["telemetry_observed_at"],
        facts=facts,
        source=r["source"],
        first_seen_at=r["first_seen_at"],
        last_seen_at=r["last_seen_at"],
        last_observed_at=r["last_observed_at"],
        last_received_at=r["last_received_at"],
        clock_skew_seconds=r["clock_skew_seconds"],
        decommissioned_at=r["decommissioned_at"],
        generation=r["lifecycle_version"],
        health=node_health(r["health_healthy"], r["health_degraded"], r["health_failed"]),
    )


class NodeReads:
    def __init__(self, pool: asyncpg.Pool, liveness: LivenessPolicy, clock: Callable[[], datetime]) -> None:
        self.pool = pool
        self.liveness = liveness
        self.clock = clock

    async def page(
        self,
        *,
        cursor: str | None,
        limit: int,
        hostname: str | None = None,
        liveness: str | None = None,
        inventory_status: str | None = None,
        health: str | None = None,
    ) -> tuple[list[NodeBody], str | None]:
        """A page of nodes by id; the filters narrow the keyset, so a cursor pages the filtered set."""
        statement = _page(
            hostname is not None, liveness is not None, inventory_status is not None, health is not None
        )
        values = {
            **self.liveness.values(self.clock()),
            "after": decode_id_cursor(cursor) if cursor else "",
            "hostname": hostname,
            "liveness": liveness,
            "inventory_status": inventory_status,
            "health": health,
            "limit": limit + 1,
        }
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(statement.sql, *statement.args(values))
        return id_page(rows, limit, node_body)

    async def _row(self, node_id: str) -> asyncpg.Record | None:
        values = {**self.liveness.values(self.clock()), "node_id": node_id}
        async with self.pool.acquire() as conn:
            row: asyncpg.Record | None = await conn.fetchrow(_ONE_NODE.sql, *_ONE_NODE.args(values))
        return row

    async def get(self, node_id: str) -> NodeBody | None:
        row = await self._row(node_id)
        return None if row is None else node_body(row)

    async def render(self, node_id: str) -> Loaded | None:
        """`get` rendered, with until when its liveness verdict holds (`RenderedReads`)."""
        row = await self._row(node_id)
        return None if row is None else (render(node_body(row)), row["liveness_until"])
