"""Point-in-time inventory: fold the log up to a moment with the projection's own fold, so "what did
node X look like at 14:00" is answered from the log alone, by the same code that keeps the live
read models.

The moment is the central `recorded_at` (when the ledger knew it). The answer carries the global
position it was folded to: the largest position of any event included.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

import asyncpg
import msgspec

from domain.node import NodeState
from ledger.reading import EVENT_COLUMNS, event_from_row
from projections.inventory import INVENTORY

_BATCH = 5000


class InventoryAsOf(msgspec.Struct, frozen=True):
    as_of: datetime
    position: int
    nodes: list[NodeState]


async def inventory_as_of(
    conn: asyncpg.Connection, as_of: datetime, *, node_id: str | None = None
) -> InventoryAsOf:
    """Every node's folded state (or one node's) from the events recorded at or before `as_of`."""
    states: list[NodeState] = []
    position = 0
    current: NodeState | None = None
    last = ("", 0)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        while True:
            args: list[Any] = [last[0], last[1], as_of, _BATCH]
            stream_filter = ""
            if node_id is not None:
                args.append(node_id)
                stream_filter = "AND stream_id = $5"
            rows = await conn.fetch(
                f"SELECT {EVENT_COLUMNS} FROM events "
                "WHERE (events.stream_id, events.stream_version) > ($1, $2) "
                f"AND events.recorded_at <= $3 {stream_filter} "
                "ORDER BY events.stream_id, events.stream_version LIMIT $4",
                *args,
            )
            if not rows:
                break
            for row in rows:
                event = event_from_row(row)
                if not INVENTORY.handles(event.stream_id):
                    continue
                if current is None or current.node_id != event.stream_id:
                    if current is not None:
                        states.append(current)
                    current = INVENTORY.initial(event.stream_id)
                current = INVENTORY.fold_whole(current, event)
                position = max(position, event.global_position)
            last = (rows[-1]["stream_id"], rows[-1]["stream_version"])
    if current is not None:
        states.append(current)
    return InventoryAsOf(as_of=as_of, position=position, nodes=[s for s in states if s.discovered])


def _plain(value: Any) -> Any:
    """Row values as the database would give them back: jsonb columns as builtins."""
    if isinstance(value, msgspec.Struct | dict | list):
        return msgspec.to_builtins(value)
    return value


def _as_dicts(rows: Mapping[str, Any], table: str) -> list[dict[str, Any]]:
    spec = next(t for t in INVENTORY.tables if t.name == table)
    out: list[dict[str, Any]] = []
    for row in rows.get(table, ()):
        out.append({c: _plain(v) for c, v in zip(spec.columns, row, strict=True)})
    return out


def _later(a: datetime | None, b: datetime | None) -> datetime | None:
    """SQL's greatest(): the later of two times, ignoring a null."""
    if a is None or b is None:
        return a or b
    return max(a, b)


def node_record(state: NodeState) -> dict[str, Any]:
    """The node's row as `GET /nodes` reads it (hw_nodes joined with its telemetry and storage)."""
    rows = INVENTORY.rows(state)
    record = _as_dicts(rows, "hw_nodes")[0]
    telemetry = _as_dicts(rows, "hw_host_telemetry")
    t = telemetry[0] if telemetry else None
    record["host_metrics"] = t["metrics"] if t else None
    record["telemetry_observed_at"] = t["observed_at"] if t else None
    # A decommissioned node has no telemetry row; its row keeps when its last report came.
    record["last_received_at"] = t["received_at"] if t else record["final_received_at"]
    record["last_observed_at"] = t["observed_at"] if t else None
    record["clock_skew_seconds"] = t["clock_skew_seconds"] if t else None
    record["last_seen_at"] = _later(record["first_seen_at"], record["last_received_at"])
    record["storage"] = [
        {"mount": s["mount"], "used_bytes": s["used_bytes"], "total_bytes": s["total_bytes"]}
        for s in sorted(_as_dicts(rows, "hw_node_storage"), key=lambda s: s["mount"])
    ]
    # The node's GPUs by verdict, counted as the API's node query counts them.
    verdicts = [
        a["health_status"] for a in _as_dicts(rows, "hw_accelerators") if a["status"] != "decommissioned"
    ]
    for verdict in ("healthy", "degraded", "failed"):
        record[f"health_{verdict}"] = verdicts.count(verdict)
    return record


def accelerator_records(state: NodeState) -> list[dict[str, Any]]:
    """The node's accelerator rows as `GET /accelerators` reads them."""
    rows = INVENTORY.rows(state)
    # The sample itself is in the folded state, as the API reads it from the event at the
    # telemetry row's position.
    samples = {a.accelerator_id: state.accelerator_telemetry.get(u) for u, a in state.accelerators.items()}
    out = []
    for acc in _as_dicts(rows, "hw_accelerators"):
        t = samples.get(acc["accelerator_id"])
        acc["metrics"] = _plain(t.metrics) if t else None
        acc["telemetry_observed_at"] = t.observed_at if t else None
        acc["health_signals"] = _plain(t.health) if t else None
        acc["last_seen_at"] = _later(acc["last_seen_at"], t.received_at if t else None)
        out.append(acc)
    return sorted(out, key=lambda a: a["accelerator_id"])
