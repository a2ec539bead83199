"""HardwareRepository: the read side of the API, over the projections' tables."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import asyncpg
import msgspec

from api.services.rendered import Loaded, render
from api.services.views import (
    AcceleratorBody,
    AcceleratorHealthBody,
    CpuBody,
    EventBody,
    EventPage,
    HealthSignalsBody,
    InventoryHealth,
    NodeBody,
    NodeHealthBody,
    OsBody,
    StorageBody,
    UndecodableBody,
)
from collectors.facts import Fact, Known, TemporarilyFailed, Unavailable, Unknown, Unsupported
from collectors.gpu_health import XidOccurrence
from ledger.events import EventClass, HealthAction, HealthReason, HealthStatus, RecordedEvent
from ledger.feed import LogFeed
from ledger.reading import (
    MAX_POSITION,
    MAX_TX_ID,
    Checkpoint,
    LogEntry,
    LogFilter,
    read_log,
)


class BadCursor(ValueError):
    pass


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
    total: int
    liveness: dict[str, int]
    inventory: dict[str, int]


def _like_prefix(text: str) -> str:
    """A LIKE pattern matching `text` as a literal prefix."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


# Cursors are opaque to clients: base64url of a JSON array whose first element names the list it
# pages, so a cursor from one list handed to another is refused (400), not misread.
_Id = Annotated[str, msgspec.Meta(max_length=256, pattern="^[^\\x00]*$")]
_TxId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TX_ID)]
_Position = Annotated[int, msgspec.Meta(ge=0, le=MAX_POSITION)]
_IdCursor = tuple[Literal["id"], _Id]
_LogCursor = tuple[Literal["log"], _TxId, _Position]
_FleetCursor = tuple[Literal["fleet"], _Id, _Id]


def _encode(parts: tuple[Any, ...]) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(parts)).decode().rstrip("=")


def _decode(cursor: str, shape: Any) -> Any:
    try:
        raw = base64.urlsafe_b64decode(cursor.encode("ascii") + b"=" * (-len(cursor) % 4))
        return msgspec.json.decode(raw, type=shape, strict=True)
    except (ValueError, msgspec.DecodeError) as exc:
        raise BadCursor("cursor is not one this list issued") from exc


def encode_id_cursor(last_id: str) -> str:
    return _encode(("id", last_id))


def decode_id_cursor(cursor: str) -> str:
    _, last_id = _decode(cursor, _IdCursor)
    return str(last_id)


def encode_fleet_cursor(hostname: str, node_id: str) -> str:
    return _encode(("fleet", hostname, node_id))


def decode_fleet_cursor(cursor: str) -> tuple[str, str]:
    _, hostname, node_id = _decode(cursor, _FleetCursor)
    return str(hostname), str(node_id)


def encode_log_cursor(checkpoint: Checkpoint) -> str:
    return _encode(("log", checkpoint.tx_id, checkpoint.position))


def decode_log_cursor(cursor: str) -> Checkpoint:
    _, tx_id, position = _decode(cursor, _LogCursor)
    return Checkpoint(tx_id, position)


def event_body(entry: LogEntry) -> EventBody:
    """An event as the API shows it; one the catalog cannot decode is shown as stored, marked."""
    if isinstance(entry, RecordedEvent):
        return EventBody(
            global_position=entry.global_position,
            stream_id=entry.stream_id,
            stream_version=entry.stream_version,
            event_type=entry.event_type,
            event_class=entry.event_class,
            node_id=entry.stream_id,
            data=entry.payload,
            metadata=entry.metadata,
            recorded_at=entry.recorded_at,
        )
    return EventBody(
        global_position=entry.global_position,
        stream_id=entry.stream_id,
        stream_version=entry.stream_version,
        event_type=entry.event_type,
        event_class=entry.event_class,
        node_id=entry.stream_id,
        recorded_at=entry.recorded_at,
        undecodable=UndecodableBody(
            error=entry.error, stored_data=entry.raw_data(), stored_metadata=entry.raw_metadata()
        ),
    )


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


def node_health(healthy: int, degraded: int, failed: int) -> NodeHealthBody:
    """The node's summary from its GPUs' counts by verdict: the worst verdict present."""
    worst: HealthStatus = "failed" if failed else "degraded" if degraded else "healthy"
    return NodeHealthBody(status=worst, healthy=healthy, degraded=degraded, failed=failed)


class AcceleratorRow(msgspec.Struct):
    """One row of `_ACCELERATOR_SELECT`, typed. A page comes back from PostgreSQL as one JSON array
    of these (`_ACCELERATOR_PAGE`) and is decoded in one pass, facts straight into their classes:
    converting each jsonb column's builtins fact by fact was most of a page's server time. An
    as-of read builds the same rows from a fold (`projections.pointintime.accelerator_records`)."""

    accelerator_id: str
    node_id: str
    uuid: str
    status: Literal["active", "missing", "decommissioned"]
    device_index: Fact
    pci_bus_id: Fact
    name: Fact
    memory_total_bytes: Fact
    compute_capability: Fact
    mig_mode: Fact
    driver_version: Fact
    cuda_driver_version: Fact
    first_seen_at: datetime
    last_seen_at: datetime
    missing_since: datetime | None
    metrics: dict[str, Fact] | None
    telemetry_observed_at: datetime | None
    health_status: HealthStatus
    health_action: HealthAction
    health_reasons: list[HealthReason] | None
    health_xids: list[XidOccurrence] | None
    # The stored signals carry an empty `xids` (XIDs are lifecycle events): not decoded, not shown.
    health_signals: HealthSignalsBody | None


_accelerator_rows = msgspec.json.Decoder(list[AcceleratorRow])


def accelerator_row(record: dict[str, Any]) -> AcceleratorRow:
    """An as-of record (builtins and datetimes, the database's shapes) as a typed row."""
    return msgspec.convert(record, AcceleratorRow)


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

    def settled_until(
        self, source: str | None, last_received_at: datetime | None, now: datetime
    ) -> datetime | None:
        """Until when `judge` keeps its verdict of `now` (None: for good, until a report comes)."""
        if source == "local" or last_received_at is None:
            return None
        age = (now - last_received_at).total_seconds()
        if age <= self.stale_after:
            return last_received_at + timedelta(seconds=self.stale_after)
        if age <= self.offline_after:
            return last_received_at + timedelta(seconds=self.offline_after)
        return None


# The node's GPUs by verdict: decommissioned ones are no longer the node's to take work.
_NODE_SELECT = """
SELECT n.*, t.metrics AS host_metrics, t.observed_at AS telemetry_observed_at,
       t.received_at AS last_received_at, t.observed_at AS last_observed_at, t.clock_skew_seconds,
       greatest(n.first_seen_at, t.received_at) AS last_seen_at,
       coalesce((SELECT jsonb_agg(jsonb_build_object('mount', s.mount, 'used_bytes', s.used_bytes,
                                                     'total_bytes', s.total_bytes) ORDER BY s.mount)
                 FROM hw_node_storage s WHERE s.node_id = n.node_id), '[]'::jsonb) AS storage,
       h.health_healthy, h.health_degraded, h.health_failed
FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id
LEFT JOIN LATERAL (
    SELECT count(*) FILTER (WHERE a.health_status = 'healthy') AS health_healthy,
           count(*) FILTER (WHERE a.health_status = 'degraded') AS health_degraded,
           count(*) FILTER (WHERE a.health_status = 'failed') AS health_failed
    FROM hw_accelerators a WHERE a.node_id = n.node_id AND a.status <> 'decommissioned'
) h ON true
"""
# `node_health` in SQL, so the node list filters by the node's worst verdict on the server.
_NODE_HEALTH_SQL = (
    "CASE WHEN h.health_failed > 0 THEN 'failed' WHEN h.health_degraded > 0 THEN 'degraded' "
    "ELSE 'healthy' END"
)

# The telemetry row is joined per accelerator (LATERAL ... OFFSET 0 keeps the planner from a merge
# join that reads the telemetry index from its start up to the page's cursor on every page), and
# its sample is read from the event it points at (schema.sql, mf_accelerator_sample).
_ACCELERATOR_SELECT = """
SELECT a.accelerator_id, a.node_id, a.uuid, a.status, a.device_index, a.pci_bus_id, a.name,
       a.memory_total_bytes, a.compute_capability, a.mig_mode, a.driver_version, a.cuda_driver_version,
       a.first_seen_at, greatest(a.last_seen_at, t.received_at) AS last_seen_at, a.missing_since,
       m.metrics AS metrics, t.observed_at AS telemetry_observed_at,
       a.health_status, a.health_action, a.health_reasons, a.health_xids, m.health_signals
FROM hw_accelerators a
LEFT JOIN LATERAL (
    SELECT x.observed_at, x.received_at, x.position FROM hw_accelerator_telemetry x
    WHERE x.accelerator_id = a.accelerator_id OFFSET 0
) t ON true
LEFT JOIN LATERAL mf_accelerator_sample(t.position, a.uuid) m ON true
"""


# A page of `_ACCELERATOR_SELECT` rows as one JSON array (the query goes in the braces).
_ACCELERATOR_PAGE = "SELECT coalesce(json_agg(p ORDER BY p.accelerator_id), '[]')::text FROM ({}) p"


class HardwareRepository:
    def __init__(self, pool: asyncpg.Pool, liveness: LivenessPolicy | None = None) -> None:
        self.pool = pool
        self.liveness = liveness or LivenessPolicy()
        self.feed = LogFeed(pool)

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
            health=node_health(r["health_healthy"], r["health_degraded"], r["health_failed"]),
        )

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
        """A page of nodes by id; the filters narrow the keyset, so a cursor pages the filtered set.
        Liveness is judged in SQL by the same rule and at the same moment as the bodies."""
        now = datetime.now(UTC)
        args: list[Any] = [decode_id_cursor(cursor) if cursor else ""]
        where = ["n.node_id > $1"]
        if hostname is not None:
            # Hostnames are case-insensitive (DNS).
            args.append(hostname)
            where.append(f"lower(n.hostname) = lower(${len(args)})")
        if liveness is not None:
            args += [now, liveness]
            where.append(f"({self._liveness_sql(f'${len(args) - 1}::timestamptz')}) = ${len(args)}")
        if inventory_status is not None:
            args.append(inventory_status)
            where.append(f"n.inventory_status = ${len(args)}")
        if health is not None:
            args.append(health)
            where.append(f"{_NODE_HEALTH_SQL} = ${len(args)}")
        args.append(limit + 1)
        query = f"{_NODE_SELECT} WHERE {' AND '.join(where)} ORDER BY n.node_id LIMIT ${len(args)}"
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(query, *args)
        items = [self.node_body(r, now) for r in rows[:limit]]
        next_cursor = encode_id_cursor(items[-1].id) if len(rows) > limit and items else None
        return items, next_cursor

    async def _node_row(self, node_id: str) -> asyncpg.Record | None:
        async with self.pool.acquire() as conn:
            row: asyncpg.Record | None = await conn.fetchrow(_NODE_SELECT + " WHERE n.node_id = $1", node_id)
        return row

    async def get_node(self, node_id: str) -> NodeBody | None:
        row = await self._node_row(node_id)
        return None if row is None else self.node_body(row, datetime.now(UTC))

    async def render_node(self, node_id: str) -> Loaded | None:
        """`get_node` rendered, with until when its liveness verdict holds (`RenderedReads`)."""
        row = await self._node_row(node_id)
        if row is None:
            return None
        now = datetime.now(UTC)
        until = (
            None
            if row["status"] == "decommissioned"
            else self.liveness.settled_until(row["source"], row["last_received_at"], now)
        )
        return render(self.node_body(row, now)), until

    # --- accelerators ----------------------------------------------------------------------------

    def accelerator_body(self, r: AcceleratorRow) -> AcceleratorBody:
        facts: dict[str, Fact] = {
            "index": r.device_index,
            "pci_bus_id": r.pci_bus_id,
            "name": r.name,
            "memory_total_bytes": r.memory_total_bytes,
            "compute_capability": r.compute_capability,
            "mig_mode": r.mig_mode,
            "driver_version": r.driver_version,
            "cuda_driver_version": r.cuda_driver_version,
        }
        return AcceleratorBody(
            id=r.accelerator_id,
            node_id=r.node_id,
            uuid=r.uuid,
            status=r.status,
            index=_plain(r.device_index),
            pci_bus_id=_plain(r.pci_bus_id),
            name=_plain(r.name),
            memory_total_bytes=_plain(r.memory_total_bytes),
            compute_capability=_plain(r.compute_capability),
            mig_mode=r.mig_mode,
            driver_version=_plain(r.driver_version),
            cuda_driver_version=_plain(r.cuda_driver_version),
            telemetry=r.metrics or {},
            telemetry_observed_at=r.telemetry_observed_at,
            facts=facts,
            first_seen_at=r.first_seen_at,
            last_seen_at=r.last_seen_at,
            missing_since=r.missing_since,
            health=AcceleratorHealthBody(
                status=r.health_status,
                action=r.health_action,
                reasons=r.health_reasons or [],
                recent_xids=r.health_xids or [],
                signals=r.health_signals,
            ),
        )

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
        after = decode_id_cursor(cursor) if cursor else ""
        where = ["a.accelerator_id > $1"]
        args: list[Any] = [after]
        if node_id is not None:
            args.append(node_id)
            where.append(f"a.node_id = ${len(args)}")
        if status is not None:
            args.append(status)
            where.append(f"a.status = ${len(args)}")
        if model is not None:
            # The model is the accelerator's name fact (e.g. "NVIDIA H200"), matched when known.
            args.append(model)
            where.append(f"a.name->>'state' = 'known' AND a.name->>'value' = ${len(args)}")
        if health is not None:
            args.append(health)
            where.append(f"a.health_status = ${len(args)}")
        args.append(limit + 1)
        query = _ACCELERATOR_PAGE.format(
            f"{_ACCELERATOR_SELECT} WHERE {' AND '.join(where)} ORDER BY a.accelerator_id LIMIT ${len(args)}"
        )
        async with self.pool.acquire() as conn:
            rows = _accelerator_rows.decode(await conn.fetchval(query, *args))
        items = [self.accelerator_body(r) for r in rows[:limit]]
        next_cursor = encode_id_cursor(items[-1].id) if len(rows) > limit and items else None
        return items, next_cursor

    async def get_accelerator(self, accelerator_id: str) -> AcceleratorBody | None:
        query = _ACCELERATOR_PAGE.format(_ACCELERATOR_SELECT + " WHERE a.accelerator_id = $1")
        async with self.pool.acquire() as conn:
            rows = _accelerator_rows.decode(await conn.fetchval(query, accelerator_id))
        return self.accelerator_body(rows[0]) if rows else None

    # --- events ----------------------------------------------------------------------------------

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
        """The audit log in commit order through the ledger's one gap-safe read. Every page carries
        the cursor to resume from, so a poller continues exactly where it stopped. With
        `wait_seconds`, an empty page is held until an event commits (the change feed)."""
        after = decode_log_cursor(cursor) if cursor else Checkpoint()
        where = LogFilter(
            stream_id=node_id,
            event_types=tuple(types or ()),
            event_class=event_class,
            accelerator_uuid=accelerator_uuid,
            recorded_since=since,
            recorded_until=until,
        )
        if wait_seconds > 0:
            page = await self.feed.wait(after, limit=limit, where=where, wait_seconds=wait_seconds)
        else:
            async with self.pool.acquire() as conn:
                page = await read_log(conn, after, limit=limit, where=where)
        return EventPage(
            items=[event_body(e) for e in page.entries],
            next_cursor=encode_log_cursor(page.resume),
            has_more=page.more,
        )

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

    # --- console reads (api/http/console): a filtered fleet page with its counts ----------------------

    def _liveness_sql(self, now_arg: str) -> str:
        """LivenessPolicy.judge in SQL, so the console can filter and count by it on the server."""
        return (
            "CASE WHEN n.status = 'decommissioned' THEN 'offline' WHEN n.source = 'local' THEN 'local' "
            "WHEN t.received_at IS NULL THEN 'offline' "
            f"WHEN t.received_at >= {now_arg} - make_interval(secs => {self.liveness.stale_after!r}) "
            "THEN 'online' "
            f"WHEN t.received_at >= {now_arg} - make_interval(secs => {self.liveness.offline_after!r}) "
            "THEN 'stale' ELSE 'offline' END"
        )

    async def fleet_page(
        self, query: FleetQuery, *, cursor: str | None, limit: int
    ) -> tuple[list[FleetRow], FleetCounts, str | None]:
        """One page of nodes (by hostname, then id) matching the query, each with its GPU summary,
        and the counts by state over the whole fleet: two queries, whatever the fleet's size."""
        now = datetime.now(UTC)
        args: list[Any] = []
        where = ["true"]
        if query.search:
            args.append(_like_prefix(query.search))
            where.append(
                f"(n.hostname ILIKE ${len(args)} OR n.node_id LIKE lower(${len(args)}) "
                f"OR n.identity_key ILIKE ${len(args)})"
            )
        if query.liveness:
            args += [now, query.liveness]
            where.append(f"({self._liveness_sql(f'${len(args) - 1}::timestamptz')}) = ${len(args)}")
        if query.inventory_status:
            args.append(query.inventory_status)
            where.append(f"n.inventory_status = ${len(args)}")
        if query.status:
            args.append(query.status)
            where.append(f"n.status = ${len(args)}")
        if query.health:
            args.append(query.health)
            where.append(f"{_NODE_HEALTH_SQL} = ${len(args)}")
        if cursor:
            after_host, after_id = decode_fleet_cursor(cursor)
            args += [after_host, after_id]
            where.append(f"(coalesce(n.hostname, ''), n.node_id) > (${len(args) - 1}, ${len(args)})")
        args.append(limit + 1)
        page_sql = (
            f"SELECT p.*, g.gpus_active, g.gpus_missing, g.gpu_models FROM ({_NODE_SELECT} "
            f"WHERE {' AND '.join(where)} ORDER BY coalesce(n.hostname, ''), n.node_id LIMIT ${len(args)}) p "
            "LEFT JOIN LATERAL (SELECT count(*) FILTER (WHERE a.status = 'active') AS gpus_active, "
            "count(*) FILTER (WHERE a.status = 'missing') AS gpus_missing, "
            "coalesce(jsonb_agg(DISTINCT a.name->>'value') FILTER (WHERE a.status <> 'decommissioned' "
            "AND a.name->>'state' = 'known'), '[]'::jsonb) AS gpu_models "
            "FROM hw_accelerators a WHERE a.node_id = p.node_id) g ON true "
            "ORDER BY coalesce(p.hostname, ''), p.node_id"
        )
        counts_sql = (
            f"SELECT {self._liveness_sql('$1::timestamptz')} AS console_liveness, "
            "n.inventory_status AS console_inventory, "
            "count(*) AS n FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id "
            "GROUP BY 1, 2"
        )
        async with self.pool.acquire() as conn:
            rows = await conn.fetch(page_sql, *args)
            count_rows = await conn.fetch(counts_sql, now)
        items = [
            FleetRow(
                node=self.node_body(r, now),
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
        next_cursor = None
        if len(rows) > limit and items:
            last = items[-1].node
            next_cursor = encode_fleet_cursor(last.hostname or "", last.id)
        return (
            items,
            FleetCounts(total=sum(liveness.values()), liveness=liveness, inventory=inventory),
            next_cursor,
        )


class AuditRepository:
    """Point-in-time reads: the inventory folded from the log up to a moment."""

    def __init__(self, pool: asyncpg.Pool, hardware: HardwareRepository) -> None:
        self.pool = pool
        self.hardware = hardware

    async def inventory_as_of(
        self, as_of: datetime, *, node_id: str | None = None, status: str | None = None
    ) -> tuple[list[NodeBody], list[AcceleratorBody], int]:
        """Nodes and accelerators as they stood at `as_of`, from ONE fold of the log."""
        from projections.pointintime import accelerator_records, inventory_as_of, node_record

        async with self.pool.acquire() as conn:
            folded = await inventory_as_of(conn, as_of, node_id=node_id)
        nodes = [self.hardware.node_body(node_record(s), as_of) for s in folded.nodes]
        for n in nodes:
            n.as_of_position = folded.position
        accelerators = [
            self.hardware.accelerator_body(accelerator_row(r))
            for s in folded.nodes
            for r in accelerator_records(s)
            if status is None or r["status"] == status
        ]
        return nodes, sorted(accelerators, key=lambda a: a.id), folded.position

    async def nodes_as_of(self, as_of: datetime, *, node_id: str | None = None) -> tuple[list[NodeBody], int]:
        nodes, _, position = await self.inventory_as_of(as_of, node_id=node_id)
        return nodes, position

    async def accelerators_as_of(
        self, as_of: datetime, *, node_id: str | None = None, status: str | None = None
    ) -> tuple[list[AcceleratorBody], int]:
        _, accelerators, position = await self.inventory_as_of(as_of, node_id=node_id, status=status)
        return accelerators, position
