"""A node's liveness, judged by one rule: the SQL below, which every read of a node uses (a list,
its filter, one node, the console's fleet and its counts, /metrics, and the as-of reads), so the
liveness a node shows and the liveness it is found by can never differ.

By the central clock only: `received_at` is when the server received the node's newest report,
never the agent's own clock. A decommissioned node is offline; a node refreshed by the server
itself (`source = 'local'`) is `local`; otherwise a node is online up to `stale_after` seconds
after its newest report, stale up to `offline_after`, offline after that or without a report.

`LIVENESS_UNTIL` is, from the same thresholds, until when the verdict holds (NULL: until the next
report), which bounds how long a rendering of the node is kept (`api.services.reads.rendered`)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Literal, LiteralString

import asyncpg
import msgspec

from api.services.reads.statement import Query

# Over `n` (a row with the node's `status` and `source`) and `t` (one with its `received_at`),
# with the slots `now`, `stale_after` and `offline_after` (`LivenessPolicy.values`).
_ONLINE: LiteralString = "t.received_at >= {now}::timestamptz - {stale_after}::interval"
_STALE: LiteralString = "t.received_at >= {now}::timestamptz - {offline_after}::interval"
_SETTLED: LiteralString = "n.status = 'decommissioned' OR n.source = 'local' OR t.received_at IS NULL"

LIVENESS: LiteralString = (
    "(CASE WHEN n.status = 'decommissioned' THEN 'offline' WHEN n.source = 'local' THEN 'local' "
    "WHEN t.received_at IS NULL THEN 'offline' "
    "WHEN " + _ONLINE + " THEN 'online' WHEN " + _STALE + " THEN 'stale' ELSE 'offline' END)"
)
LIVENESS_UNTIL: LiteralString = (
    "(CASE WHEN " + _SETTLED + " THEN NULL "
    "WHEN " + _ONLINE + " THEN t.received_at + {stale_after}::interval "
    "WHEN " + _STALE + " THEN t.received_at + {offline_after}::interval END)"
)

Liveness = Literal["online", "stale", "offline", "local"]
LIVENESS_STATES: tuple[Liveness, ...] = ("online", "stale", "offline", "local")


class LivenessPolicy(msgspec.Struct, frozen=True):
    """The thresholds (`MODELFORGE_STALE_AFTER`, `MODELFORGE_OFFLINE_AFTER`), in seconds."""

    stale_after: float = 60.0
    offline_after: float = 300.0

    def values(self, now: datetime) -> dict[str, object]:
        """The rule's slots, judging at `now`."""
        return {
            "now": now,
            "stale_after": timedelta(seconds=self.stale_after),
            "offline_after": timedelta(seconds=self.offline_after),
        }


class LivenessInput(msgspec.Struct, frozen=True):
    """What the rule reads of a node that is not in the read models (one folded as of a moment)."""

    status: str
    source: str | None
    received_at: datetime | None


# The rule over rows that are not in the tables: the inputs as arrays, paired by their order.
_JUDGE = (
    Query("SELECT " + LIVENESS + " AS verdict FROM ")
    .add("unnest({statuses}::text[], {sources}::text[]) WITH ORDINALITY AS n(status, source, k) ")
    .add("JOIN unnest({received}::timestamptz[]) WITH ORDINALITY AS t(received_at, k) USING (k) ")
    .add("ORDER BY k")
    .build()
)


async def judge(
    conn: asyncpg.Connection, policy: LivenessPolicy, nodes: Sequence[LivenessInput], now: datetime
) -> list[Liveness]:
    """The verdict of each node at `now`, in order, by the same SQL as the read models' reads."""
    if not nodes:
        return []
    values = {
        **policy.values(now),
        "statuses": [n.status for n in nodes],
        "sources": [n.source for n in nodes],
        "received": [n.received_at for n in nodes],
    }
    rows = await conn.fetch(_JUDGE.sql, *_JUDGE.args(values))
    return [r["verdict"] for r in rows]
