"""The fleet's GPU health at a glance: GPUs by model and verdict, and the GPUs that need someone,
failed first. Two statements whatever the fleet's size; decommissioned GPUs are left out, as from
every health count."""

from __future__ import annotations

import asyncpg
import msgspec

from ledger.events import HealthAction, HealthStatus

# How many failing GPUs the overview names; the rest are a filter away (`?health=`).
FAILING_SHOWN = 20


class ModelHealth(msgspec.Struct, frozen=True):
    model: str
    healthy: int
    degraded: int
    failed: int


class FailingGpu(msgspec.Struct, frozen=True):
    accelerator_id: str
    uuid: str
    model: str
    node_id: str
    hostname: str | None
    status: HealthStatus
    action: HealthAction
    reasons: list[str]  # the reason codes


class GpuHealthOverview(msgspec.Struct, frozen=True):
    by_model: list[ModelHealth]  # the models with failed GPUs first, then degraded, then by name
    failing: list[FailingGpu]  # at most FAILING_SHOWN: failed first, then by hostname and UUID
    failing_total: int


# `gpu_model` rather than `name`: the column `name` is a jsonb fact.
_BY_MODEL = """
SELECT coalesce(CASE WHEN a.name->>'state' = 'known' THEN a.name->>'value' END, 'unknown model') AS gpu_model,
       count(*) FILTER (WHERE a.health_status = 'healthy') AS healthy,
       count(*) FILTER (WHERE a.health_status = 'degraded') AS degraded,
       count(*) FILTER (WHERE a.health_status = 'failed') AS failed
FROM hw_accelerators a
WHERE a.status <> 'decommissioned'
GROUP BY 1
ORDER BY 4 DESC, 3 DESC, 1
"""

# The health index (health_status, accelerator_id) finds the few failing GPUs of a large fleet.
_FAILING = """
SELECT a.accelerator_id, a.uuid, a.node_id, n.hostname, a.health_status, a.health_action,
       ARRAY(SELECT x->>'code' FROM jsonb_array_elements(a.health_reasons) x) AS reason_codes,
       coalesce(CASE WHEN a.name->>'state' = 'known' THEN a.name->>'value' END, 'unknown model') AS gpu_model
FROM hw_accelerators a JOIN hw_nodes n ON n.node_id = a.node_id
WHERE a.health_status IN ('failed', 'degraded') AND a.status <> 'decommissioned'
ORDER BY a.health_status = 'failed' DESC, coalesce(n.hostname, ''), a.uuid
LIMIT $1
"""


async def gpu_health_overview(pool: asyncpg.Pool) -> GpuHealthOverview:
    async with pool.acquire() as conn:
        models = await conn.fetch(_BY_MODEL)
        failing = await conn.fetch(_FAILING, FAILING_SHOWN)
    by_model = [
        ModelHealth(model=r["gpu_model"], healthy=r["healthy"], degraded=r["degraded"], failed=r["failed"])
        for r in models
    ]
    return GpuHealthOverview(
        by_model=by_model,
        failing=[
            FailingGpu(
                accelerator_id=r["accelerator_id"],
                uuid=r["uuid"],
                model=r["gpu_model"],
                node_id=r["node_id"],
                hostname=r["hostname"],
                status=r["health_status"],
                action=r["health_action"],
                reasons=list(r["reason_codes"]),
            )
            for r in failing
        ],
        failing_total=sum(m.failed + m.degraded for m in by_model),
    )
