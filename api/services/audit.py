"""AuditRepository: the inventory as it stood at a moment, folded from the log up to it
(`projections.pointintime`), read with the same filters as the live reads and judged by the same
liveness rule (`api.services.reads.liveness`) at that moment. A past inventory is one fold, so its
lists are one page each (no cursor)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from api.services.reads.accelerators import accelerator_body, accelerator_row
from api.services.reads.bodies import AcceleratorBody, AcceleratorPage, NodeBody, NodePage
from api.services.reads.fleet import FleetCounts, FleetQuery, FleetRow, fleet_rows
from api.services.reads.liveness import LivenessInput, LivenessPolicy, judge
from api.services.reads.nodes import node_body
from projections.pointintime import accelerator_records, inventory_as_of, node_record


class Folded(msgspec.Struct):
    """Nodes and accelerators as they stood at a moment, and the log position folded to."""

    nodes: list[NodeBody]
    accelerators: list[AcceleratorBody]
    position: int


class AuditRepository:
    def __init__(self, pool: asyncpg.Pool, liveness: LivenessPolicy | None = None) -> None:
        self.pool = pool
        self.liveness = liveness or LivenessPolicy()

    async def fold(self, as_of: datetime, *, node_id: str | None = None) -> Folded:
        """The inventory (or one node's) at `as_of`, from ONE fold of the log; accelerators by id."""
        async with self.pool.acquire() as conn:
            folded = await inventory_as_of(conn, as_of, node_id=node_id)
            records = [node_record(s) for s in folded.nodes]
            verdicts = await judge(conn, self.liveness, [_liveness_input(r) for r in records], as_of)
        nodes = []
        for record, verdict in zip(records, verdicts, strict=True):
            node = node_body({**record, "liveness": verdict})
            node.as_of_position = folded.position
            nodes.append(node)
        accelerators = [
            accelerator_body(accelerator_row(r)) for s in folded.nodes for r in accelerator_records(s)
        ]
        return Folded(nodes, sorted(accelerators, key=lambda a: a.id), folded.position)

    async def inventory_as_of(
        self, as_of: datetime, *, node_id: str | None = None
    ) -> tuple[list[NodeBody], list[AcceleratorBody], int]:
        """Nodes and accelerators at `as_of` (the CLI's `replay`)."""
        folded = await self.fold(as_of, node_id=node_id)
        return folded.nodes, folded.accelerators, folded.position

    async def nodes_as_of(
        self,
        as_of: datetime,
        *,
        hostname: str | None = None,
        liveness: str | None = None,
        inventory_status: str | None = None,
        health: str | None = None,
    ) -> NodePage:
        """`GET /hardware/nodes?as_of=`: the list's filters over the nodes at `as_of`."""
        folded = await self.fold(as_of)
        items = [
            n
            for n in folded.nodes
            if (hostname is None or (n.hostname or "").lower() == hostname.lower())
            and (liveness is None or n.liveness == liveness)
            and (inventory_status is None or n.inventory_status == inventory_status)
            and (health is None or n.health.status == health)
        ]
        return NodePage(items=items, next_cursor=None, as_of_position=folded.position)

    async def node_as_of(self, as_of: datetime, node_id: str) -> NodeBody | None:
        """The node at `as_of`; None when it was not known then."""
        folded = await self.fold(as_of, node_id=node_id)
        return folded.nodes[0] if folded.nodes else None

    async def accelerators_as_of(
        self,
        as_of: datetime,
        *,
        node_id: str | None = None,
        status: str | None = None,
        model: str | None = None,
        health: str | None = None,
    ) -> AcceleratorPage:
        """`GET /hardware/accelerators?as_of=`: the list's filters over the accelerators at `as_of`."""
        folded = await self.fold(as_of, node_id=node_id)
        items = [
            a
            for a in folded.accelerators
            if (status is None or a.status == status)
            and (model is None or a.name == model)
            and (health is None or a.health.status == health)
        ]
        return AcceleratorPage(items=items, next_cursor=None, as_of_position=folded.position)

    async def accelerator_as_of(self, as_of: datetime, accelerator_id: str) -> AcceleratorBody | None:
        """The accelerator at `as_of` (its node's stream folded); None when it was not known then."""
        async with self.pool.acquire() as conn:
            node_id = await conn.fetchval(
                "SELECT node_id FROM hw_accelerators WHERE accelerator_id = $1", accelerator_id
            )
        if node_id is None:
            return None
        folded = await self.fold(as_of, node_id=node_id)
        return next((a for a in folded.accelerators if a.id == accelerator_id), None)

    async def fleet_as_of(
        self, as_of: datetime, query: FleetQuery
    ) -> tuple[list[FleetRow], FleetCounts, int]:
        """The console's fleet at `as_of`, filtered as the live page is (one page: not paged)."""
        folded = await self.fold(as_of)
        rows, counts = fleet_rows(folded.nodes, folded.accelerators, query)
        return rows, counts, folded.position


def _liveness_input(record: dict[str, Any]) -> LivenessInput:
    return LivenessInput(
        status=record["status"], source=record["source"], received_at=record["last_received_at"]
    )
