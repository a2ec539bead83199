"""The inventory's health for `GET /api/v1/health`: the worst inventory state over the nodes
still in service."""

from __future__ import annotations

import asyncpg

from api.services.reads.bodies import InventoryHealth

_RUNS = (
    "SELECT r.node_id, r.status, r.reasons, n.hostname FROM hw_inventory_runs r "
    "LEFT JOIN hw_nodes n ON n.node_id = r.node_id "
    "WHERE n.status IS DISTINCT FROM 'decommissioned' ORDER BY r.node_id"
)
_ORDER = {"ok": 0, "degraded": 1, "failed": 2}


async def inventory_health(pool: asyncpg.Pool) -> InventoryHealth:
    """Worst inventory state over the nodes still in service (pending when none reported)."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(_RUNS)
    if not rows:
        return InventoryHealth(status="pending", reasons=["no inventory has been collected yet"], nodes=0)
    worst = max((r["status"] for r in rows), key=lambda s: _ORDER.get(s, 0))
    reasons = [f"{r['hostname'] or r['node_id']}: {reason}" for r in rows for reason in (r["reasons"] or [])]
    return InventoryHealth(status=worst, reasons=reasons, nodes=len(rows))


# A standby that has replayed all it received is current (0), however long ago the primary last
# committed; otherwise the age of the last replayed commit. NULL on a server not in recovery.
_REPLAY_LAG = (
    "SELECT CASE WHEN NOT pg_is_in_recovery() THEN NULL "
    "WHEN pg_last_wal_receive_lsn() IS NOT DISTINCT FROM pg_last_wal_replay_lsn() THEN 0::float8 "
    "ELSE extract(epoch FROM clock_timestamp() - pg_last_xact_replay_timestamp())::float8 END"
)


async def replay_lag(pool: asyncpg.Pool) -> float | None:
    """Seconds the read standby is behind its primary (None: it is not in recovery, a promoted
    one, so its reads are current)."""
    async with pool.acquire() as conn:
        lag = await conn.fetchval(_REPLAY_LAG)
    return None if lag is None else max(0.0, float(lag))
