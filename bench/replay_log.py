"""The log bench/replay.py reconstructs from, built fast and untimed: a fleet of eight-GPU nodes
reporting every 10 s (discovery and incidents decided by the product's `reconcile`, steady
telemetry built directly), one hot node with a day of history before them, generated in global
order and COPYed into `events` with its indexes dropped meanwhile."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from bench.fleet import (
    GPU_MODELS,
    GpuModel,
    accelerator_telemetry,
    gpu_uuid,
    model_of,
    node_key,
    node_observation,
)
from bench.ledger import CEILING_COLUMNS

INTERVAL = timedelta(seconds=10)
HOT_HISTORY = timedelta(hours=24)  # what retention keeps of a node's telemetry
T_FLEET = datetime(2026, 11, 24, 14, 0, tzinfo=UTC)  # the fleet's first reports ("last Tuesday")
INCIDENT_SHARE = 20  # one node in 20 has incidents
UPGRADED_DRIVER = "575.57.08"

# The columns an append fills, and the event's times, here the builder's rather than the clock's.
COPY_COLUMNS = [*CEILING_COLUMNS, "recorded_at", "received_at"]


@dataclass
class SimNode:
    index: int
    node_id: str
    model: GpuModel
    state: Any  # NodeState folded over this node's lifecycle events (what reconcile decides on)
    version: int = 0
    lifecycle: int = 0
    sequence: int = 0
    driver: str | None = None  # after an upgrade
    missing_gpu: int | None = None  # index of a GPU gone from the scan
    gpus: list[tuple[str, str]] = field(default_factory=list)  # (accelerator id, GPU UUID)


class LogBuilder:
    """Generates the rows of the log in global order, streaming (nothing holds the whole log)."""

    def __init__(
        self, nodes: int, reports: int, *, hot_history: timedelta = HOT_HISTORY, seed: int = 20261130
    ) -> None:
        from domain.node import NodeState, node_id_for

        self.rng = random.Random(seed)
        self.position = 0
        self.nodes = [
            SimNode(i, node_id_for(node_key(i)), model_of(i), NodeState(node_id=node_id_for(node_key(i))))
            for i in range(nodes)
        ]
        self.hot = SimNode(nodes, node_id_for(node_key(nodes)), model_of(nodes),
                           NodeState(node_id=node_id_for(node_key(nodes))))  # fmt: skip
        self.reports = reports
        self.hot_history = hot_history
        # Pre-encoded telemetry maps (the costly part of a payload), drawn at random per report.
        self.gpu_pool = {
            m.name: [msgspec.Raw(msgspec.json.encode(accelerator_telemetry(m, self.rng))) for _ in range(64)]
            for m in GPU_MODELS
        }
        self.host_pool: dict[int, list[tuple[msgspec.Raw, msgspec.Raw]]] = {}
        for parity in (0, 1):
            pool = []
            for _ in range(64):
                obs = node_observation(parity, self.rng, gpus=0)
                pool.append(
                    (
                        msgspec.Raw(msgspec.json.encode(obs.host.telemetry)),
                        msgspec.Raw(msgspec.json.encode(obs.host.storage)),
                    )
                )
            self.host_pool[parity] = pool
        self.lifecycle_events = 0
        self.events = 0
        self.last_at: datetime | None = None
        # Event ids: unique per run, in the UUID text form (uuid4() costs more than the rest of
        # a telemetry row; asyncpg takes the text form for a uuid column).
        self._id_prefix = f"{self.rng.getrandbits(32):08x}-{self.rng.getrandbits(16):04x}-4000-8000-"

    # -- one report -------------------------------------------------------------------------------

    def _meta(self, node: SimNode, at: datetime, stream: str) -> bytes:
        from ledger.events import EventMetadata

        node.sequence += 1
        return msgspec.json.encode(
            EventMetadata(
                received_at=at,
                source="agent",
                observed_at=at - timedelta(milliseconds=self.rng.randint(20, 400)),
                agent_stream=stream,
                agent_sequence=node.sequence,
                agent_sent_at=at - timedelta(milliseconds=self.rng.randint(1, 20)),
                agent_report_sha256=f"{self.rng.getrandbits(256):064x}",
                actor=f"credential:{node.node_id.replace('-', '')}",
            )
        )

    def _row(
        self, node: SimNode, etype: str, eclass: str, data: bytes, meta: bytes, at: datetime
    ) -> tuple[Any, ...]:
        node.version += 1
        self.position += 1
        self.events += 1
        self.last_at = at
        if eclass == "lifecycle":
            node.lifecycle += 1
            self.lifecycle_events += 1
        event_id = f"{self._id_prefix}{self.position:012x}"
        return (
            event_id,
            node.node_id,
            node.version,
            etype,
            eclass,
            1,
            msgspec.Raw(data),
            msgspec.Raw(meta),
            at,
            at,
        )

    def telemetry_report(self, node: SimNode, at: datetime) -> list[tuple[Any, ...]]:
        """A steady report: one NODE_TELEMETRY_OBSERVED (8 GPU samples, 7 with a GPU gone), built
        directly."""
        from ledger.events import AcceleratorSample, NodeTelemetryObserved

        meta = self._meta(node, at, "telemetry")
        telemetry, storage = self.rng.choice(self.host_pool[node.index % 2])
        pool = self.gpu_pool[node.model.name]
        samples = [
            AcceleratorSample(accelerator_id=acc_id, uuid=gpu, telemetry=self.rng.choice(pool))  # type: ignore[arg-type]
            for g, (acc_id, gpu) in enumerate(node.gpus)
            if g != node.missing_gpu
        ]
        payload = NodeTelemetryObserved(telemetry=telemetry, storage=storage, accelerators=samples)  # type: ignore[arg-type]
        return [
            self._row(node, "NODE_TELEMETRY_OBSERVED", "observation", msgspec.json.encode(payload), meta, at)
        ]

    def reconciled_report(
        self, node: SimNode, at: datetime, stream: str = "inventory"
    ) -> list[tuple[Any, ...]]:
        """A report decided by the product's `reconcile` against the node's folded state
        (discovery and incidents); lifecycle events are folded into that state."""
        from collectors.facts import Known
        from collectors.identity import NodeIdentity, accelerator_id_for
        from domain.node import evolve
        from domain.reconcile import reconcile
        from ledger.events import RecordedEvent, event_class_of, event_type_of, validate_payload

        obs = node_observation(node.index, self.rng)
        if node.driver is not None:
            obs = msgspec.structs.replace(
                obs, nvml=msgspec.structs.replace(obs.nvml, driver_version=Known(node.driver))
            )
        if node.missing_gpu is not None:
            accs = [a for g, a in enumerate(obs.nvml.accelerators) if g != node.missing_gpu]
            obs = msgspec.structs.replace(obs, nvml=msgspec.structs.replace(obs.nvml, accelerators=accs))
        payloads = reconcile(obs, node.state, NodeIdentity(node_key(node.index), "configured"))
        meta_bytes = self._meta(node, at, stream)
        from ledger.events import decode_metadata

        meta = decode_metadata(meta_bytes)
        rows = []
        for p in payloads:
            etype, eclass = event_type_of(p), event_class_of(p)
            row = self._row(node, etype, eclass, validate_payload(p)[0], meta_bytes, at)
            rows.append(row)
            if eclass == "lifecycle":
                node.state = evolve(
                    node.state,
                    RecordedEvent(
                        global_position=self.position, stream_id=node.node_id, stream_version=node.version,
                        event_id=uuid.UUID(row[0]), event_type=etype, event_class=eclass, schema_version=1,
                        payload=p, metadata=meta, recorded_at=at,
                    ),
                )  # fmt: skip
        if not node.gpus:
            node.gpus = [
                (accelerator_id_for(node.node_id, gpu_uuid(node.index, g)), gpu_uuid(node.index, g))
                for g in range(8)
            ]
        return rows

    # -- the whole log, in global order ---------------------------------------------------------

    def rows(self) -> Iterator[tuple[Any, ...]]:
        # The hot node: 24 h of history before the fleet arrives.
        hot = self.hot
        hot_reports = max(1, int(self.hot_history / INTERVAL))
        start = T_FLEET - self.hot_history
        yield from self.reconciled_report(hot, start)
        for k in range(1, hot_reports):
            yield from self.telemetry_report(hot, start + k * INTERVAL)
        # The fleet: slot 0 is discovery, then a report per node per slot; incidents at slots
        # 3 (driver upgrade), 5 (a GPU gone) and 7 (back), when there are that many.
        n = len(self.nodes)
        step = INTERVAL / (n + 1)
        for slot in range(self.reports + 1):
            t_slot = T_FLEET + slot * INTERVAL
            for node in self.nodes:
                at = t_slot + (node.index + 1) * step
                incident = node.index % INCIDENT_SHARE == 0
                if slot == 0:
                    yield from self.reconciled_report(node, at)
                elif incident and slot == 3:
                    node.driver = UPGRADED_DRIVER
                    yield from self.reconciled_report(node, at)
                elif incident and slot == 5:
                    node.missing_gpu = 5
                    yield from self.reconciled_report(node, at)
                elif incident and slot == 7:
                    node.missing_gpu = None
                    yield from self.reconciled_report(node, at)
                else:
                    yield from self.telemetry_report(node, at)
            # The hot node keeps reporting with the fleet.
            if slot:
                yield from self.telemetry_report(hot, t_slot + (n + 0.5) * step)

    @property
    def all_nodes(self) -> list[SimNode]:
        return [self.hot, *self.nodes]

    def end_of_log(self) -> datetime:
        """The newest recorded_at in the log."""
        assert self.last_at is not None, "the log was not generated (or adopted)"
        return self.last_at

    def middle(self) -> datetime:
        """Half-way through the fleet's history (the hot node's whole history is before it)."""
        return T_FLEET + (self.reports + 1) * INTERVAL / 2


async def _index_definitions(
    conn: asyncpg.Connection,
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    constraints = [
        (r["conname"], r["def"])
        for r in await conn.fetch(
            "SELECT conname, pg_get_constraintdef(oid) AS def FROM pg_constraint "
            "WHERE conrelid = 'events'::regclass AND contype IN ('p', 'u') ORDER BY conname"
        )
    ]
    indexes = [
        (r["indexname"], r["indexdef"])
        for r in await conn.fetch(
            "SELECT i.indexname, i.indexdef FROM pg_indexes i WHERE i.tablename = 'events' AND NOT EXISTS "
            "(SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname) ORDER BY i.indexname"
        )
    ]
    return constraints, indexes


async def build_log(pool: asyncpg.Pool, builder: LogBuilder, chunk: int = 20_000) -> dict[str, float]:
    """Generate and COPY the log; returns the wall time of each phase."""
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    async with pool.acquire() as conn:
        constraints, indexes = await _index_definitions(conn)
        for name, _ in constraints:
            await conn.execute(f"ALTER TABLE events DROP CONSTRAINT {name}")
        for name, _ in indexes:
            await conn.execute(f"DROP INDEX {name}")
        batch: list[tuple[Any, ...]] = []
        copy_s = 0.0
        for row in builder.rows():
            batch.append(row)
            if len(batch) >= chunk:
                c0 = time.perf_counter()
                await conn.copy_records_to_table("events", records=batch, columns=COPY_COLUMNS)
                copy_s += time.perf_counter() - c0
                batch.clear()
        if batch:
            c0 = time.perf_counter()
            await conn.copy_records_to_table("events", records=batch, columns=COPY_COLUMNS)
            copy_s += time.perf_counter() - c0
        phases["generate"] = time.perf_counter() - t0 - copy_s
        phases["COPY"] = copy_s
        t0 = time.perf_counter()
        await conn.execute("SET maintenance_work_mem = '256MB'")
        for name, definition in constraints:
            await conn.execute(f"ALTER TABLE events ADD CONSTRAINT {name} {definition}")
        for _, ddl in indexes:
            await conn.execute(ddl)
        await conn.copy_records_to_table(
            "streams",
            records=[(n.node_id, n.version, n.lifecycle) for n in builder.all_nodes],
            columns=["stream_id", "version", "lifecycle_version"],
        )
        after_constraints, after_indexes = await _index_definitions(conn)
        assert (after_constraints, after_indexes) == (constraints, indexes), "indexes not restored"
        phases["indexes"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    async with pool.acquire() as conn:
        await conn.execute("VACUUM ANALYZE events")
        await conn.execute("VACUUM ANALYZE streams")
    phases["VACUUM ANALYZE"] = time.perf_counter() - t0
    return phases
