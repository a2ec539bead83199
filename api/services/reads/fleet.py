"""The console's fleet: a filtered page of nodes by hostname, each with its GPU summary, and the
fleet's counts by state, in two queries whatever the fleet's size."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime

import asyncpg
import msgspec

from api.services.reads.bodies import AcceleratorBody, NodeBody
from api.services.reads.cursors import decode_fleet_cursor, encode_fleet_cursor
from api.services.reads.liveness import LIVENESS, LivenessPolicy
from api.services.reads.nodes import NODE_HEALTH, NODE_SELECT, node_body
from api.services.reads.statement import Query, Statement


class FleetQuery(msgspec.Struct, frozen=True):
    """The console's fleet filters: a hostname, node id or identity key prefix; exact states."""

    search: str = ""
    liveness: str = ""
    inventory_status: str = ""
    status: str = ""
    health: str = ""  # the node's worst GPU verdict


class FleetRow(msgspec.Struct):
    node: NodeBody
    gpus_active: int
    gpus_missing: int
    gpu_models: list[str]


class FleetCounts(msgspec.Struct):
    """The fleet's nodes: in all, those in service by liveness, the decommissioned ones, and all
    by inventory status."""

    total: int
    liveness: dict[str, int]
    inventory: dict[str, int]
    decommissioned: int = 0


def like_prefix(text: str) -> str:
    """A LIKE pattern matching `text` as a literal prefix."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


@functools.cache
def _page(
    search: bool, liveness: bool, inventory_status: bool, status: bool, health: bool, after: bool
) -> Statement:
    """The page's statement for the filters given: the nodes' page, then each one's GPUs."""
    query = Query("SELECT p.*, g.gpus_active, g.gpus_missing, g.gpu_models FROM (").add(NODE_SELECT)
    if search:
        query.where(
            "(n.hostname ILIKE {search} OR n.node_id LIKE lower({search}) OR n.identity_key ILIKE {search})"
        )
    if liveness:  # the tiles count nodes in service by liveness: a filter by one lists those
        query.where(LIVENESS + " = {liveness} AND n.status <> 'decommissioned'")
    if inventory_status:
        query.where("n.inventory_status = {inventory_status}")
    if status:
        query.where("n.status = {status}")
    if health:
        query.where(NODE_HEALTH + " = {health}")
    if after:
        query.where("(coalesce(n.hostname, ''), n.node_id) > ({after_hostname}, {after_id})")
    return (
        query.add(" ORDER BY coalesce(n.hostname, ''), n.node_id LIMIT {limit}) p ")
        .add(
            "LEFT JOIN LATERAL (SELECT count(*) FILTER (WHERE a.status = 'active') AS gpus_active, "
            "count(*) FILTER (WHERE a.status = 'missing') AS gpus_missing, "
            "coalesce(jsonb_agg(DISTINCT a.name->>'value') FILTER (WHERE a.status <> 'decommissioned' "
            "AND a.name->>'state' = 'known'), '[]'::jsonb) AS gpu_models "
            "FROM hw_accelerators a WHERE a.node_id = p.node_id) g ON true "
            "ORDER BY coalesce(p.hostname, ''), p.node_id"
        )
        .build()
    )


# A decommissioned node is offline by the liveness rule, but an operator counting offline nodes
# looks for nodes in service that stopped reporting: the retired ones are counted apart.
_COUNTS = Query(
    "SELECT CASE WHEN n.status = 'decommissioned' THEN 'decommissioned' ELSE " + LIVENESS + " END "
    "AS console_liveness, n.inventory_status AS console_inventory, count(*) AS n "
    "FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id GROUP BY 1, 2"
).build()


class FleetReads:
    def __init__(self, pool: asyncpg.Pool, liveness: LivenessPolicy, clock: Callable[[], datetime]) -> None:
        self.pool = pool
        self.liveness = liveness
        self.clock = clock

    async def page(
        self, query: FleetQuery, *, cursor: str | None, limit: int
    ) -> tuple[list[FleetRow], FleetCounts, str | None]:
        """One page of nodes (by hostname, then id) matching the query, each with its GPU summary,
        and the counts by state over the whole fleet: two queries, whatever the fleet's size."""
        judged = self.liveness.values(self.clock())
        after_hostname, after_id = decode_fleet_cursor(cursor) if cursor else ("", "")
        statement = _page(
            bool(query.search),
            bool(query.liveness),
            bool(query.inventory_status),
            bool(query.status),
            bool(query.health),
            bool(cursor),
        )
        values = {
            **judged,
            "search": like_prefix(query.search),
            "liveness": query.liveness,
            "inventory_status": query.inventory_status,
            "status": query.status,
            "health": query.health,
            "after_hostname": after_hostname,
            "after_id": after_id,
            "limit": limit + 1,
        }
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(statement.sql, *statement.args(values))
            count_rows = await conn.fetch(_COUNTS.sql, *_COUNTS.args(judged))
        items = [
            FleetRow(
                node=node_body(r),
                gpus_active=r["gpus_active"] or 0,
                gpus_missing=r["gpus_missing"] or 0,
                gpu_models=sorted(r["gpu_models"] or []),
            )
            for r in rows[:limit]
        ]
        liveness: dict[str, int] = {}
        inventory: dict[str, int] = {}
        for r in count_rows:
            liveness[r["console_liveness"]] = liveness.get(r["console_liveness"], 0) + r["n"]
            inventory[r["console_inventory"]] = inventory.get(r["console_inventory"], 0) + r["n"]
        retired = liveness.pop("decommissioned", 0)
        next_cursor = None
        if len(rows) > limit and items:
            last = items[-1].node
            next_cursor = encode_fleet_cursor(last.hostname or "", last.id)
        return (
            items,
            FleetCounts(
                total=sum(liveness.values()) + retired,
                liveness=liveness,
                inventory=inventory,
                decommissioned=retired,
            ),
            next_cursor,
        )


def fleet_rows(
    nodes: list[NodeBody], accelerators: list[AcceleratorBody], query: FleetQuery
) -> tuple[list[FleetRow], FleetCounts]:
    """The page's rows and the counts from nodes and accelerators already read (an as-of fold),
    filtered and ordered as `FleetReads.page` filters and orders them in SQL."""
    by_node: dict[str, list[AcceleratorBody]] = {}
    for a in accelerators:
        by_node.setdefault(a.node_id, []).append(a)
    liveness: dict[str, int] = {}
    inventory: dict[str, int] = {}
    rows: list[FleetRow] = []
    needle = query.search.lower()
    retired = 0
    for n in sorted(nodes, key=lambda n: (n.hostname or "", n.id)):
        if n.status == "decommissioned":
            retired += 1
        else:
            liveness[n.liveness] = liveness.get(n.liveness, 0) + 1
        inventory[n.inventory_status] = inventory.get(n.inventory_status, 0) + 1
        if needle and not any(
            (x or "").lower().startswith(needle) for x in (n.hostname, n.id, n.identity_key)
        ):
            continue
        if query.liveness and (n.liveness != query.liveness or n.status == "decommissioned"):
            continue
        if query.inventory_status and n.inventory_status != query.inventory_status:
            continue
        if query.status and n.status != query.status:
            continue
        if query.health and n.health.status != query.health:
            continue
        gpus = by_node.get(n.id, [])
        rows.append(
            FleetRow(
                node=n,
                gpus_active=sum(1 for a in gpus if a.status == "active"),
                gpus_missing=sum(1 for a in gpus if a.status == "missing"),
                gpu_models=sorted({a.name for a in gpus if a.name and a.status != "decommissioned"}),
            )
        )
    return rows, FleetCounts(total=len(nodes), liveness=liveness, inventory=inventory, decommissioned=retired)
