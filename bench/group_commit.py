"""The batch size of the server's group commit over a tier's windows, read from its /metrics."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from bench.servers import OPERATOR_TOKEN, HttpConnection, bearer

T = TypeVar("T")

GROUP_COMMIT_COUNTERS = (
    b"modelforge_ingest_report_transactions_total",
    b"modelforge_ingest_reports_committed_total",
)


async def group_commit_counts(port: int) -> tuple[float, float]:
    """(transactions, reports) the server's group commit has committed so far, from its /metrics.
    The batch size moves the CPU per report as much as a change of the code does
    (docs/performance.md, "where a small batch's database time goes"), so each tier reports the one it ran at."""
    conn = await HttpConnection.open(port)
    try:
        status, body = await conn.request(b"GET", b"/metrics", bearer(OPERATOR_TOKEN))
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"GET /metrics answered {status}")
    found = dict.fromkeys(GROUP_COMMIT_COUNTERS, 0.0)
    for line in body.splitlines():
        name, _, value = line.partition(b" ")
        if name in found:
            found[name] = float(value)
    return found[GROUP_COMMIT_COUNTERS[0]], found[GROUP_COMMIT_COUNTERS[1]]


class Batches:
    """Transactions and reports a server committed over the windows of one tier."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.transactions = 0.0
        self.reports = 0.0

    async def around(self, window: Awaitable[T]) -> T:
        t0, r0 = await group_commit_counts(self.port)
        out = await window
        t1, r1 = await group_commit_counts(self.port)
        self.transactions += t1 - t0
        self.reports += r1 - r0
        return out

    @property
    def size(self) -> float:
        return self.reports / self.transactions if self.transactions else 0.0
