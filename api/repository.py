"""HardwareRepository: the read side of the API, over the projections' tables."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import asyncpg
import msgspec

from api.schemas import (
    AcceleratorBody,
    CpuBody,
    EventBody,
    InventoryHealth,
    NodeBody,
    OsBody,
    StorageBody,
)
from collectors.facts import Fact, Known, TemporarilyFailed, Unavailable, Unknown, Unsupported
from ledger.store import event_from_row


class BadCursor(ValueError):
    pass


def encode_cursor(*parts: object) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(list(parts))).decode().rstrip("=")


def decode_cursor(cursor: str, n: int) -> list[Any]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        parts = msgspec.json.decode(raw)
    except (ValueError, msgspec.DecodeError) as exc:
        raise BadCursor("cursor is not one this API issued") from exc
    if not isinstance(parts, list) or len(parts) != n:
        raise BadCursor("cursor is not one this API issued")
    return parts


_FACT_CLASSES: dict[str, type[Any]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (Known, Unknown, Unsupported, Unavailable, TemporarilyFailed)
}


def _fact(value: Any) -> Fact:
    # Converting into the concrete class: converting into the `Fact` union costs ~20x more, since
    # msgspec rebuilds the union's type information on every call.
    try:
        cls = _FACT_CLASSES[value["state"]]
    except (KeyError, TypeError) as exc:
        raise msgspec.ValidationError(f"not an availability-typed fact: {value!r}") from exc
    fact: Fact = msgspec.convert(value, cls)
    return fact


def _plain(fact: Fact) -> Any:
    return fact.value if isinstance(fact, Known) else None


def _facts(value: Any) -> dict[str, Fact]:
    return {k: _fact(v) for k, v in (value or {}).items()}


class LivenessPolicy(msgspec.Struct, frozen=True):
    stale_after: float = 60.0
    offline_after: float = 300.0

    def judge(self, source: str | None, last_received_at: datetime | None, now: datetime) -> str:
        """By the central clock only: an agent's own clock never decides its liveness."""
        if source == "local":
            return "local"
        if last_received_at is None:
            return "offline"
        age = (now - last_received_at).total_seconds()
        if age <= self.stale_after:
            return "online"
        if age <= self.offline_after:
            return "stale"
        return "offline"


_NODE_SELECT = """
SELECT n.*, t.metrics AS host_metrics, t.observed_at AS telemetry_observed_at,
       t.received_at AS last_received_at, t.observed_at AS last_observed_at, t.clock_skew_seconds,
       greatest(n.first_seen_at, t.received_at) AS last_seen_at,
       coalesce((SELECT jsonb_agg(jsonb_build_object('mount', s.mount, 'used_bytes', s.used_bytes,
                                                     'total_bytes', s.total_bytes) ORDER BY s.mount)
                 FROM hw_node_storage s WHERE s.node_id = n.node_id), '[]'::jsonb) AS storage
FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id
"""

# The telemetry row is joined per accelerator (LATERAL ... OFFSET 0 keeps the planner from a merge
# join that reads the telemetry index from its start up to the page's cursor on every page).
_ACCELERATOR_SELECT = """
SELECT a.accelerator_id, a.node_id, a.uuid, a.status, a.device_index, a.pci_bus_id, a.name,
       a.memory_total_bytes, a.compute_capability, a.mig_mode, a.driver_version, a.cuda_driver_version,
       a.first_seen_at, greatest(a.last_seen_at, t.received_at) AS last_seen_at, a.missing_since,
       t.metrics AS metrics, t.observed_at AS telemetry_observed_at
FROM hw_accelerators a
LEFT JOIN LATERAL (
    SELECT x.metrics, x.observed_at, x.received_at FROM hw_accelerator_telemetry x
    WHERE x.accelerator_id = a.accelerator_id OFFSET 0
) t ON true
"""


class HardwareRepository:
    def __init__(self, pool: asyncpg.Pool, liveness: LivenessPolicy | None = None) -> None:
        self.pool = pool
        self.liveness = liveness or LivenessPolicy()

    # --- nodes -----------------------------------------------------------------------------------

    def node_body(self, r: asyncpg.Record | dict[str, Any], now: datetime) -> NodeBody:
        os_facts = {k: _fact(v) for k, v in (r["os"] or {}).items()}
        cpu_facts = {k: _fact(v) for k, v in (r["cpu"] or {}).items()}
        memory = _fact(r["memory_total_bytes"])
        driver = _fact(r["driver_version"])
        cuda = _fact(r["cuda_driver_version"])
        facts: dict[str, Fact] = {f"os.{k}": v for k, v in os_facts.items()}
        facts.update({f"cpu.{k}": v for k, v in cpu_facts.items()})
        facts.update(memory_total_bytes=memory, driver_version=driver, cuda_driver_version=cuda)
        status = r["status"]
        return NodeBody(
            id=r["node_id"],
            identity_key=r["identity_key"],
            identity_source=r["identity_source"],
            hostname=r["hostname"],
            display_name=r["display_name"],
            status=status,
            liveness="offline"
            if status == "decommissioned"
            else self.liveness.judge(r["source"], r["last_received_at"], now),  # type: ignore[arg-type]
            inventory_status=r["inventory_status"],
            inventory_reasons=list(r["inventory_reasons"] or []),
            accelerator_capability=r["accelerator_capability"],
            fingerprint=r["fingerprint"],
            fingerprint_position=r["fingerprint_position"],
            os=OsBody(
                **{
                    k: _plain(os_facts[k]) if k in os_facts else None
                    for k in ("name", "version", "kernel", "architecture")
                }
            ),
            cpu=CpuBody(
                **{
                    k: _plain(cpu_facts[k]) if k in cpu_facts else None
                    for k in ("model", "sockets", "physical_cores", "logical_cores")
                }
            ),
            memory_total_bytes=_plain(memory),
            driver_version=_plain(driver),
            cuda_driver_version=_plain(cuda),
            storage=msgspec.convert(r["storage"], list[StorageBody]),
            telemetry=_facts(r["host_metrics"]),
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
        )

    async def list_nodes(self, *, cursor: str | None, limit: int) -> tuple[list[NodeBody], str | None]:
        after = decode_cursor(cursor, 1)[0] if cursor else ""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                _NODE_SELECT + " WHERE n.node_id > $1 ORDER BY n.node_id LIMIT $2", after, limit + 1
            )
        now = datetime.now(UTC)
        items = [self.node_body(r, now) for r in rows[:limit]]
        next_cursor = encode_cursor(items[-1].id) if len(rows) > limit and items else None
        return items, next_cursor

    async def get_node(self, node_id: str) -> NodeBody | None:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(_NODE_SELECT + " WHERE n.node_id = $1", node_id)
        return None if row is None else self.node_body(row, datetime.now(UTC))

    # --- accelerators ----------------------------------------------------------------------------

    def accelerator_body(self, r: asyncpg.Record | dict[str, Any]) -> AcceleratorBody:
        facts = {
            "index": _fact(r["device_index"]),
            "pci_bus_id": _fact(r["pci_bus_id"]),
            "name": _fact(r["name"]),
            "memory_total_bytes": _fact(r["memory_total_bytes"]),
            "compute_capability": _fact(r["compute_capability"]),
            "mig_mode": _fact(r["mig_mode"]),
            "driver_version": _fact(r["driver_version"]),
            "cuda_driver_version": _fact(r["cuda_driver_version"]),
        }
        return AcceleratorBody(
            id=r["accelerator_id"],
            node_id=r["node_id"],
            uuid=r["uuid"],
            status=r["status"],
            index=_plain(facts["index"]),
            pci_bus_id=_plain(facts["pci_bus_id"]),
            name=_plain(facts["name"]),
            memory_total_bytes=_plain(facts["memory_total_bytes"]),
            compute_capability=_plain(facts["compute_capability"]),
            mig_mode=facts["mig_mode"],
            driver_version=_plain(facts["driver_version"]),
            cuda_driver_version=_plain(facts["cuda_driver_version"]),
            telemetry=_facts(r["metrics"]),
            telemetry_observed_at=r["telemetry_observed_at"],
            facts=facts,
            first_seen_at=r["first_seen_at"],
            last_seen_at=r["last_seen_at"],
            missing_since=r["missing_since"],
        )

    async def list_accelerators(
        self, *, node_id: str | None, status: str | None, cursor: str | None, limit: int
    ) -> tuple[list[AcceleratorBody], str | None]:
        after = decode_cursor(cursor, 1)[0] if cursor else ""
        where = ["a.accelerator_id > $1"]
        args: list[Any] = [after]
        if node_id is not None:
            args.append(node_id)
            where.append(f"a.node_id = ${len(args)}")
        if status is not None:
            args.append(status)
            where.append(f"a.status = ${len(args)}")
        args.append(limit + 1)
        query = (
            f"{_ACCELERATOR_SELECT} WHERE {' AND '.join(where)} ORDER BY a.accelerator_id LIMIT ${len(args)}"
        )
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(query, *args)
        items = [self.accelerator_body(r) for r in rows[:limit]]
        next_cursor = encode_cursor(items[-1].id) if len(rows) > limit and items else None
        return items, next_cursor

    async def get_accelerator(self, accelerator_id: str) -> AcceleratorBody | None:
        async with self.pool.acquire() as conn:
            row = await conn.fetchrow(_ACCELERATOR_SELECT + " WHERE a.accelerator_id = $1", accelerator_id)
        return None if row is None else self.accelerator_body(row)

    # --- events ----------------------------------------------------------------------------------

    async def list_events(
        self,
        *,
        node_id: str | None = None,
        types: list[str] | None = None,
        event_class: str | None = None,
        accelerator_uuid: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        cursor: str | None = None,
        limit: int = 100,
    ) -> tuple[list[EventBody], str | None]:
        """The audit log in gap-safe (tx_id, position) order: a cursor never passes an event whose
        transaction commits late (the same rule as the ledger's catch-up read)."""
        tx, pos = decode_cursor(cursor, 2) if cursor else ("0", 0)
        args: list[Any] = [str(tx), int(pos)]
        where = [
            "(tx_id, global_position) > ($1::text::xid8, $2)",
            "tx_id < pg_snapshot_xmin(pg_current_snapshot())",
        ]
        if node_id is not None:
            args.append(node_id)
            where.append(f"stream_id = ${len(args)}")
        if types:
            args.append(types)
            where.append(f"event_type = ANY(${len(args)})")
        if event_class is not None:
            args.append(event_class)
            where.append(f"event_class = ${len(args)}")
        if accelerator_uuid is not None:
            args.append(accelerator_uuid)
            where.append(f"(data->>'uuid' = ${len(args)} OR data->>'accelerator_uuid' = ${len(args)})")
        if since is not None:
            args.append(since)
            where.append(f"recorded_at >= ${len(args)}")
        if until is not None:
            args.append(until)
            where.append(f"recorded_at < ${len(args)}")
        args.append(limit + 1)
        query = (
            "SELECT global_position, stream_id, stream_version, event_id, event_type, event_class, "
            "schema_version, data::text AS data, metadata::text AS metadata, recorded_at, "
            # Not `AS tx_id`: ORDER BY would bind to the text alias and sort 1000 before 999.
            f"tx_id::text AS tx_text FROM events WHERE {' AND '.join(where)} "
            f"ORDER BY tx_id, global_position LIMIT ${len(args)}"
        )
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(query, *args)
        items = []
        for r in rows[:limit]:
            e = event_from_row(r)
            items.append(
                EventBody(
                    global_position=e.global_position,
                    stream_id=e.stream_id,
                    stream_version=e.stream_version,
                    event_type=e.event_type,
                    event_class=e.event_class,
                    node_id=e.stream_id,
                    data=e.payload,
                    metadata=e.metadata,
                    recorded_at=e.recorded_at,
                )
            )
        next_cursor = None
        if len(rows) > limit and items:
            last = rows[limit - 1]
            next_cursor = encode_cursor(last["tx_text"], last["global_position"])
        return items, next_cursor

    # --- health ----------------------------------------------------------------------------------

    async def inventory_health(self) -> InventoryHealth:
        """Worst inventory state over the nodes still in service (pending when none reported)."""
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT r.node_id, r.status, r.reasons, n.hostname FROM hw_inventory_runs r "
                "LEFT JOIN hw_nodes n ON n.node_id = r.node_id "
                "WHERE n.status IS DISTINCT FROM 'decommissioned' ORDER BY r.node_id"
            )
        if not rows:
            return InventoryHealth(status="pending", reasons=["no inventory has been collected yet"], nodes=0)
        order = {"ok": 0, "degraded": 1, "failed": 2}
        worst = max((r["status"] for r in rows), key=lambda s: order.get(s, 0))
        reasons = [
            f"{r['hostname'] or r['node_id']}: {reason}" for r in rows for reason in (r["reasons"] or [])
        ]
        return InventoryHealth(status=worst, reasons=reasons, nodes=len(rows))


class AuditRepository:
    """Point-in-time reads: the inventory folded from the log up to a moment."""

    def __init__(self, pool: asyncpg.Pool, hardware: HardwareRepository) -> None:
        self.pool = pool
        self.hardware = hardware

    async def nodes_as_of(self, as_of: datetime, *, node_id: str | None = None) -> tuple[list[NodeBody], int]:
        from projections.pointintime import inventory_as_of, node_record

        async with self.pool.acquire() as conn:
            folded = await inventory_as_of(conn, as_of, node_id=node_id)
        nodes = [self.hardware.node_body(node_record(s), as_of) for s in folded.nodes]
        for n in nodes:
            n.as_of_position = folded.position
        return nodes, folded.position

    async def accelerators_as_of(
        self, as_of: datetime, *, node_id: str | None = None, status: str | None = None
    ) -> tuple[list[AcceleratorBody], int]:
        from projections.pointintime import accelerator_records, inventory_as_of

        async with self.pool.acquire() as conn:
            folded = await inventory_as_of(conn, as_of, node_id=node_id)
        items = [
            self.hardware.accelerator_body(r)
            for s in folded.nodes
            for r in accelerator_records(s)
            if status is None or r["status"] == status
        ]
        return sorted(items, key=lambda a: a.id), folded.position
