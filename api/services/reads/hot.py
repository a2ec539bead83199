"""The two hot reads, a node by id and a page of accelerators, answered from their renderings.

One place builds each read's key, names the streams it is built from and loads it on a miss
(`RenderedReads`), so the Litestar routes and the fast path in front of them
(`api.http.fast_reads`) cannot answer the same request differently."""

from __future__ import annotations

from typing import Literal

import msgspec

from api.services.reads.bodies import AcceleratorPage
from api.services.reads.rendered import RenderedReads
from api.services.reads.rendering import Loaded, Rendered, render
from api.services.reads.repository import HardwareRepository

# The filters' values, for the route's parameters and the fast path's parse alike.
AcceleratorStatus = Literal["active", "missing", "decommissioned"]
HealthStatus = Literal["healthy", "degraded", "failed"]


class AcceleratorQuery(msgspec.Struct, frozen=True):
    """The filters and the page of `GET /api/v1/hardware/accelerators` (without `as_of`)."""

    node_id: str | None = None
    status: AcceleratorStatus | None = None
    model: str | None = None
    health: HealthStatus | None = None
    cursor: str | None = None
    limit: int = 100


class HardwareReads:
    def __init__(self, rendered: RenderedReads, repository: HardwareRepository) -> None:
        self.rendered = rendered
        self.repository = repository

    async def node(self, node_id: str) -> Rendered | None:
        """The node's rendering; None when there is no such node."""
        return await self.rendered.read(
            ("node", node_id), frozenset({node_id}), lambda: self.repository.nodes.render(node_id)
        )

    async def accelerator_page(self, query: AcceleratorQuery) -> Rendered:
        """The page's rendering (raises `BadCursor` for a cursor that is not one)."""

        async def load() -> Loaded:
            items, next_cursor = await self.repository.accelerators.page(
                node_id=query.node_id,
                status=query.status,
                cursor=query.cursor,
                limit=query.limit,
                model=query.model,
                health=query.health,
            )
            return render(AcceleratorPage(items=items, next_cursor=next_cursor)), None

        # A page of one node's GPUs is built from that node's stream; any other from the fleet's.
        rendered = await self.rendered.read(
            ("accelerators", query),
            None if query.node_id is None else frozenset({query.node_id}),
            load,
        )
        assert rendered is not None  # a page always exists (it may be empty)
        return rendered
