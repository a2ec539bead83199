"""Health policy backtest benchmark: a 1,000-node x 8-GPU fleet's 30 days of lifecycle events,
backtested with a candidate policy.

    python -m bench.health_backtest            # 1,000 nodes x 8 GPUs, 30 days, 40,000 XIDs
    python -m bench.health_backtest --quick    # 100 nodes, 3 days, 2,000 XIDs

1. Build (untimed) the fleet's history: each node discovered by the real reconciler 30 days ago,
   then `--xids` XID occurrences spread over the window (a tenth of the GPUs get most of them, as
   lemons do; mostly application XIDs such as 13 and 31, some hardware ones such as 48, 79, 94),
   and the ACCELERATOR_HEALTH_CHANGED events the shipped policy gives them.
2. Time the pure fold (`domain.health_backtest.backtest`) on that history, in this process.
3. Append the history to a throwaway database through the event store, serve the product as an
   operator starts it, and time `POST /api/v1/hardware/health/backtest` (read, decode, fold,
   answer) with a stricter candidate (XID 13 three times in an hour: degraded), each page of the
   differing GPUs in turn.

Target: the backtest through the server < 10 s.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from bench import harness as h
from bench.fleet import node_key, node_observation
from bench.servers import OPERATOR_TOKEN, HttpConnection, bearer, start_product_server, workdir

TARGET_SECONDS = 10.0
GPUS = 8
# Application faults dominate real XID streams; hardware XIDs are the rare ones that matter.
XID_WEIGHTS = {13: 40, 31: 20, 43: 10, 45: 5, 48: 3, 63: 5, 74: 5, 79: 2, 94: 5, 119: 5}

CANDIDATE = """version = 1
name = "bench-strict"

[[xid]]
xids = [48, 79, 94]
status = "failed"
action = "service"
detail = "hardware memory or bus error"

[[xid]]
xids = [63, 74, 119]
status = "degraded"
action = "reset_gpu"
detail = "recoverable hardware error"

[[xid]]
xids = [13]
count = 3
window = "1h"
status = "degraded"
action = "reset_gpu"
detail = "XID 13 three times in an hour"
"""


def parse_args(argv: Sequence[str] | None = None) -> Any:
    p = h.parser(__doc__)
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 1,000; --quick 100)")
    p.add_argument("--days", type=int, default=None, help="days of history (default 30; --quick 3)")
    p.add_argument("--xids", type=int, default=None, help="XID occurrences (default 40,000; --quick 2,000)")
    args = p.parse_args(argv)
    args.nodes = args.nodes or (100 if args.quick else 1000)
    args.days = args.days or (3 if args.quick else 30)
    args.xids = args.xids or (2000 if args.quick else 40_000)
    return args


def history(nodes: int, days: int, xids: int, now: datetime, seed: int = 7) -> dict[str, list[Any]]:
    """node id -> its lifecycle events (NewEvent) in order."""
    from collectors.gpu_health import XidOccurrence
    from collectors.identity import NodeIdentity
    from domain.health_backtest import timelines
    from domain.health_policy import DEFAULT_POLICY
    from domain.node import NodeState, node_id_for
    from domain.reconcile import reconcile
    from ledger.events import (
        AcceleratorDiscovered,
        AcceleratorHealthChanged,
        AcceleratorXidObserved,
        EventMetadata,
        NewEvent,
        RecordedEvent,
        event_class_of,
        event_type_of,
    )

    rng = random.Random(seed)
    start = now - timedelta(days=days)
    per_node: dict[str, list[tuple[datetime, Any]]] = {}
    gpus: list[tuple[str, AcceleratorDiscovered]] = []
    for i in range(nodes):
        node_id = node_id_for(node_key(i))
        payloads = reconcile(
            node_observation(i, rng, gpus=GPUS),
            NodeState(node_id=node_id),
            NodeIdentity(node_key(i), "configured"),
        )
        per_node[node_id] = [(start, p) for p in payloads if event_class_of(p) == "lifecycle"]
        gpus += [(node_id, p) for p in payloads if isinstance(p, AcceleratorDiscovered)]
    lemons = gpus[: max(1, len(gpus) // 10)]
    codes, weights = list(XID_WEIGHTS), list(XID_WEIGHTS.values())
    span = (now - start).total_seconds()
    for _ in range(xids):
        node_id, acc = rng.choice(lemons) if rng.random() < 0.7 else rng.choice(gpus)
        at = start + timedelta(seconds=rng.uniform(60, span - 60))
        burst = 3 if rng.random() < 0.1 else 1  # XIDs come in bursts now and then
        for k in range(burst):
            x = XidOccurrence(code=rng.choices(codes, weights)[0], at=at + timedelta(seconds=20 * k))
            xid = AcceleratorXidObserved(
                accelerator_id=acc.accelerator_id, uuid=acc.uuid, code=x.code, at=x.at
            )
            per_node[node_id].append((x.at, xid))
    # The verdicts the shipped policy gives (what the live decider would have recorded).
    recorded: list[RecordedEvent] = []
    for node_id, items in per_node.items():
        items.sort(key=lambda item: item[0])
        for at, p in items:
            recorded.append(
                RecordedEvent(
                    len(recorded) + 1,
                    node_id,
                    0,
                    uuid.uuid4(),
                    event_type_of(p),
                    "lifecycle",
                    1,
                    p,
                    EventMetadata(received_at=at, source="agent", observed_at=at),
                    at,
                )
            )
    previous: dict[str, Any] = {}
    for aid, gpu in timelines(recorded, DEFAULT_POLICY, now).items():
        for at, verdict in gpu.live:
            before = previous.get(aid)
            per_node[gpu.node_id].append(
                (
                    at,
                    AcceleratorHealthChanged(
                        accelerator_id=aid,
                        uuid=gpu.uuid,
                        before="healthy" if before is None else before.status,
                        after=verdict.status,
                        action=verdict.action,
                        reasons=list(verdict.reasons),
                        before_reasons=[] if before is None else [r.code for r in before.reasons],
                        policy_digest=DEFAULT_POLICY.digest,
                    ),
                )
            )
            previous[aid] = verdict
    out: dict[str, list[Any]] = {}
    for node_id, items in per_node.items():
        items.sort(key=lambda item: (item[0], isinstance(item[1], AcceleratorHealthChanged)))
        out[node_id] = [
            NewEvent(payload=p, metadata=EventMetadata(received_at=at, source="agent", observed_at=at))
            for at, p in items
        ]
    return out


def recorded_of(streams: dict[str, list[Any]]) -> list[Any]:
    from ledger.events import RecordedEvent

    out: list[RecordedEvent] = []
    for node_id, events in streams.items():
        for v, e in enumerate(events, 1):
            out.append(
                RecordedEvent(
                    len(out) + 1,
                    node_id,
                    v,
                    e.event_id,
                    e.event_type,
                    e.event_class,
                    1,
                    e.payload,
                    e.metadata,
                    e.metadata.received_at,
                )
            )
    return out


async def append(pool: Any, streams: dict[str, list[Any]], tasks: int = 8) -> None:
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    store = EventStore(pool, ALL_PROJECTIONS)
    ids = list(streams)

    async def worker(t: int) -> None:
        for node_id in ids[t::tasks]:
            events = streams[node_id]
            for k in range(0, len(events), 500):
                await store.append(node_id, k, events[k : k + 500])

    await asyncio.gather(*(worker(t) for t in range(tasks)))


async def run(args: Any) -> int:
    from domain.health_backtest import backtest
    from domain.health_policy import load_policy
    from ledger.db import create_pool

    report = h.Report("health_backtest")
    await h.describe_environment(report, "health policy backtest")
    now = datetime.now(UTC)
    t0 = time.perf_counter()
    streams = history(args.nodes, args.days, args.xids, now)
    events = sum(len(v) for v in streams.values())
    kinds: dict[str, int] = {}
    for evs in streams.values():
        for e in evs:
            kinds[e.event_type] = kinds.get(e.event_type, 0) + 1
    report.note(
        f"history: {args.nodes} nodes x {GPUS} GPUs, {args.days} days, {events:,} lifecycle events "
        f"({', '.join(f'{k} {v:,}' for k, v in sorted(kinds.items()))}), built in {time.perf_counter() - t0:.1f} s"
    )
    candidate = load_policy(CANDIDATE)
    recorded = [e for e in recorded_of(streams) if e.event_type != "NODE_DISCOVERED"]
    t1, c1 = time.perf_counter(), time.process_time()
    result = backtest(recorded, candidate, since=now - timedelta(days=args.days), until=now)
    pure, pure_cpu = time.perf_counter() - t1, time.process_time() - c1
    s = result.summary
    report.note(
        f"pure fold: {pure:.2f} s ({pure_cpu:.2f} s CPU); {s.gpus:,} GPUs, {s.differing:,} differ, drained earlier {s.drained_earlier:,}, "
        f"later {s.drained_later:,}, serviced earlier {s.serviced_earlier:,}, later {s.serviced_later:,}"
    )
    report.row(step="pure fold", seconds=round(pure, 3), events=len(recorded), differing=s.differing)
    async with (
        h.throwaway_database("backtest", keep=args.keep) as db,
        workdir("backtest", keep=args.keep) as wd,
    ):
        pool = await create_pool(db.dsn, min_size=1, max_size=8)
        try:
            from ledger.schema import migrate

            async with pool.acquire() as conn:
                await migrate(conn)
            t2 = time.perf_counter()
            await append(pool, streams)
            report.note(f"appended through the event store in {time.perf_counter() - t2:.1f} s (untimed)")
            async with pool.acquire() as conn:
                await conn.execute("VACUUM ANALYZE")
        finally:
            await pool.close()
        server = await start_product_server(db.dsn, wd, retention=False)
        try:
            conn_ = await HttpConnection.open(server.port)
            cursor: str | None = None
            pages, first, first_server, total = 0, 0.0, 0.0, time.perf_counter()
            cpu_before, cpu_first = h.cpu_of([server.pid]), None
            while True:
                body = msgspec.json.encode(
                    {"policy": CANDIDATE, "since_seconds": args.days * 86400, "limit": 1000, "cursor": cursor}
                )
                t3 = time.perf_counter()
                status, answer = await conn_.request(
                    b"POST",
                    b"/api/v1/hardware/health/backtest",
                    bearer(OPERATOR_TOKEN) + b"Content-Type: application/json\r\n",
                    body,
                )
                if status != 200:
                    raise RuntimeError(f"backtest answered {status}: {answer[:500]!r}")
                page = msgspec.json.decode(answer)
                pages += 1
                if not first:
                    first, first_server = time.perf_counter() - t3, page["elapsed_seconds"]
                    cpu_after = h.cpu_of([server.pid])
                    if cpu_before is not None and cpu_after is not None:
                        cpu_first = cpu_after - cpu_before
                cursor = page["next_cursor"]
                if cursor is None:
                    break
            all_pages = time.perf_counter() - total
            conn_.close()
        finally:
            server.stop()
    report.note(
        f"through the server: first page {first:.2f} s (server-side {first_server:.2f} s, "
        f"server CPU {'n/a' if cpu_first is None else f'{cpu_first:.2f} s'}, {page['events']:,} health "
        f"events read), all {pages} page(s) {all_pages:.2f} s (later pages reuse the fold)"
    )
    report.row(
        step="server, first page",
        seconds=round(first, 3),
        events=page["events"],
        differing=page["summary"]["differing"],
    )
    report.ratio(
        h.Ratio("backtest through the server, first page (s)", first, TARGET_SECONDS, at_least=False)
    )
    report.ratio(h.Ratio("pure fold (s)", pure, None))
    if cpu_first is not None:
        report.ratio(h.Ratio("server CPU for the first page (s)", cpu_first, TARGET_SECONDS, at_least=False))
    report.finish(args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return h.main(run, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
