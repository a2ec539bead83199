"""HardwareRepository: the read side as the one object the routes and the console take, each
read answered by the module of its kind (nodes, accelerators, the fleet, the log, health), all
judging liveness by one policy and one clock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import asyncpg

from api.services.reads.accelerators import AcceleratorReads
from api.services.reads.bodies import AcceleratorBody, EventPage, InventoryHealth, NodeBody
from api.services.reads.events import EventReads
from api.services.reads.fleet import FleetCounts, FleetQuery, FleetReads, FleetRow
from api.services.reads.health import inventory_health
from api.services.reads.liveness import LivenessPolicy
from api.services.reads.nodes import NodeReads
from api.services.reads.rendering import Loaded
from ledger.events import EventClass


def central_now() -> datetime:
    """The central clock, by which every liveness verdict is judged."""
    return datetime.now(UTC)


class HardwareRepository:
    def __init__(
        self,
        pool: asyncpg.Pool,
        liveness: LivenessPolicy | None = None,
        *,
        clock: Callable[[], datetime] = central_now,
    ) -> None:
        self.pool = pool
        self.liveness = liveness or LivenessPolicy()
        self.clock = clock
        self.nodes = NodeReads(pool, self.liveness, clock)
        self.accelerators = AcceleratorReads(pool)
        self.fleet = FleetReads(pool, self.liveness, clock)
        self.events = EventReads(pool)

    async def list_nodes(
        self,
        *,
        cursor: str | None,
        limit: int,
        hostname: str | None = None,
        liveness: str | None = None,
        inventory_status: str | None = None,
        health: str | None = None,
    ) -> tuple[list[NodeBody], str | None]:
        return await self.nodes.page(
            cursor=cursor,
            limit=limit,
            hostname=hostname,
            liveness=liveness,
            inventory_status=inventory_status,
            health=health,
        )

    async def get_node(self, node_id: str) -> NodeBody | None:
        return await self.nodes.get(node_id)

    async def render_node(self, node_id: str) -> Loaded | None:
        return await self.nodes.render(node_id)

    async def list_accelerators(
        self,
        *,
        node_id: str | None,
        status: str | None,
        cursor: str | None,
        limit: int,
        model: str | None = None,
        health: str | None = None,
    ) -> tuple[list[AcceleratorBody], str | None]:
        return await self.accelerators.page(
            node_id=node_id, status=status, cursor=cursor, limit=limit, model=model, health=health
        )

    async def get_accelerator(self, accelerator_id: str) -> AcceleratorBody | None:
        return await self.accelerators.get(accelerator_id)

    async def list_events(
        self,
        *,
        node_id: str | None = None,
        types: list[str] | None = None,
        event_class: EventClass | None = None,
        accelerator_uuid: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        cursor: str | None = None,
        limit: int = 100,
        wait_seconds: float = 0,
    ) -> EventPage:
        return await self.events.page(
            node_id=node_id,
            types=types,
            event_class=event_class,
            accelerator_uuid=accelerator_uuid,
            since=since,
            until=until,
            cursor=cursor,
            limit=limit,
            wait_seconds=wait_seconds,
        )

    async def inventory_health(self) -> InventoryHealth:
        return await inventory_health(self.pool)

    async def fleet_page(
        self, query: FleetQuery, *, cursor: str | None, limit: int
    ) -> tuple[list[FleetRow], FleetCounts, str | None]:
        return await self.fleet.page(query, cursor=cursor, limit=limit)
