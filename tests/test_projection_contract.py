"""One contract every projection honours, written once (in the style of the `eventsourcing`
library's reusable recorder test cases): a base class with an abstract factory, and one small
subclass per projection that says how to make it and which histories to feed it.

    fold is pure            the same events from the same state give the same state, and folding
                            leaves its input as it was
    live equals rebuild     what the inline projection wrote equals a rebuild from the log
    handles() is honoured   a stream it does not handle gets no state and no rows, inline and in
                            a rebuild
"""

from __future__ import annotations

import abc
from datetime import timedelta
from typing import Any

import asyncpg
import msgspec

from collectors.identity import NodeIdentity
from domain.node import NodeState, node_id_for
from domain.reconcile import reconcile
from ledger.events import (
    EnrollmentTokenCreated,
    EnrollmentTokenRevoked,
    EnrollmentTokenUsed,
    NewEvent,
    RecordedEvent,
    WorkLeaseAcquired,
    enrollment_token_stream,
)
from ledger.store import EventStore
from projections.agent import ENROLLMENT_TOKEN_PROJECTION
from projections.framework import STATE_TABLE, Projection
from projections.inventory import ALL_PROJECTIONS, INVENTORY
from projections.rebuild import rebuild
from tests.builders import T0, gpu, meta, new, observation

TOKEN_ID = "0" * 31 + "1"
NODE_KEY = "contract-node"
NODE = node_id_for(NODE_KEY)


def node_history() -> list[NewEvent]:
    """A node discovered with two GPUs, one lost, a lease taken."""
    identity = NodeIdentity(key=NODE_KEY, source="configured")
    state = NodeState(node_id=NODE)
    first = [new(p) for p in reconcile(observation([gpu(0), gpu(1)]), state, identity)]
    return first


def token_history() -> list[NewEvent]:
    return [
        new(
            EnrollmentTokenCreated(
                token_id=TOKEN_ID, secret_sha256="a" * 64, expires_at=T0 + timedelta(hours=1), uses=2
            )
        ),
        new(EnrollmentTokenUsed(token_id=TOKEN_ID, node_id=NODE, credential_id="c" * 32)),
        new(EnrollmentTokenRevoked(token_id=TOKEN_ID, reason="done")),
    ]


class ProjectionContract(abc.ABC):
    """Subclass per projection: `create_projection`, a stream it handles with a history, and a
    stream it does not handle with a history."""

    @abc.abstractmethod
    def create_projection(self) -> Projection[Any]: ...

    @abc.abstractmethod
    def handled(self) -> tuple[str, list[NewEvent]]: ...

    @abc.abstractmethod
    def not_handled(self) -> tuple[str, list[NewEvent]]: ...

    async def _append(self, store: EventStore, stream_id: str, events: list[NewEvent]) -> list[RecordedEvent]:
        result = await store.append(stream_id, None, events)
        return result.events

    async def _state_rows(self, pool: asyncpg.Pool, name: str, stream_id: str) -> int:
        async with pool.acquire() as conn:
            count: int = await conn.fetchval(
                f"SELECT count(*) FROM {STATE_TABLE} WHERE projection = $1 AND stream_id = $2",
                name,
                stream_id,
            )
        return count

    async def test_fold_is_pure(self, store: EventStore) -> None:
        projection = self.create_projection()
        stream_id, history = self.handled()
        recorded = await self._append(store, stream_id, history)
        initial = projection.initial(stream_id)
        before = msgspec.json.encode(initial)
        once = projection.fold_all(initial, recorded)
        twice = projection.fold_all(projection.initial(stream_id), recorded)
        assert once == twice
        assert msgspec.json.encode(initial) == before
        assert once != initial

    async def test_live_equals_rebuild(self, store: EventStore, pool: asyncpg.Pool) -> None:
        projection = self.create_projection()
        for stream_id, history in (self.handled(), self.not_handled()):
            await self._append(store, stream_id, history)
        report = await rebuild(pool, ALL_PROJECTIONS, verify=True)
        assert report.differences == []
        stream_id, _ = self.handled()
        async with pool.acquire() as conn:
            live = await projection.load_state(conn, stream_id)
        assert live != projection.initial(stream_id)

    async def test_handles_is_honoured(self, store: EventStore, pool: asyncpg.Pool) -> None:
        projection = self.create_projection()
        handled, handled_history = self.handled()
        other, other_history = self.not_handled()
        assert projection.handles(handled) and not projection.handles(other)
        await self._append(store, handled, handled_history)
        recorded = await self._append(store, other, other_history)
        async with pool.acquire() as conn, conn.transaction():
            assert await projection.apply(conn, other, recorded) is None
        assert await self._state_rows(pool, projection.name, other) == 0
        await rebuild(pool, ALL_PROJECTIONS)
        assert await self._state_rows(pool, projection.name, other) == 0
        assert await self._state_rows(pool, projection.name, handled) == 1


class TestInventoryProjection(ProjectionContract):
    def create_projection(self) -> Projection[Any]:
        return INVENTORY

    def handled(self) -> tuple[str, list[NewEvent]]:
        lease = NewEvent(
            payload=WorkLeaseAcquired(lease_id="l1", owner="o", reason="r"), metadata=meta(T0, "operator")
        )
        return NODE, [*node_history(), lease]

    def not_handled(self) -> tuple[str, list[NewEvent]]:
        return enrollment_token_stream(TOKEN_ID), token_history()


class TestEnrollmentTokenProjection(ProjectionContract):
    def create_projection(self) -> Projection[Any]:
        return ENROLLMENT_TOKEN_PROJECTION

    def handled(self) -> tuple[str, list[NewEvent]]:
        return enrollment_token_stream(TOKEN_ID), token_history()

    def not_handled(self) -> tuple[str, list[NewEvent]]:
        return NODE, node_history()
