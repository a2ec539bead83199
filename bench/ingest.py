"""Ingest benchmark (issues 4, 12 and 33): simulated agents reporting to `modelforge-hw serve` over
HTTP, next to the ledger-only append ceiling, in one run on one throwaway database.

    python -m bench.ingest              # 1,000 nodes, 2 rounds x 10 s per tier, open loop 60 s
    python -m bench.ingest --quick      # under 2 minutes: 500 nodes, 2 rounds x 3 s, open loop 15 s
    python -m bench.ingest --quick --baseline CHECKOUT   # under 3 minutes: both, same PostgreSQL
    python -m bench.ingest --replica    # the closed loop with a hot standby: remote_apply, on,
                                        # asynchronous and no replica, same run (bench/replica.py)

Agents (simulated, no NVML): nodes of 8 GPUs (bench/fleet.py), each enrolled over HTTP (an
enrollment token from the operator API, then `POST /agent/enroll`), then one `inventory` report
(discovery, untimed). Every report is the agent's wire format with a full typed observation and
fresh telemetry, the node's credential as bearer; every 30th report of a node goes on the
`inventory` stream, the others on `telemetry`, each with its own increasing sequence, and a node
never has two reports in flight. A steady report is one observation event (the node's telemetry snapshot).

Measured:
- http: closed loop, `--connections` (16) keep-alive connections, as fast as the server answers;
- ceiling: `EventStore.append` in this process of the same events per report (what `reconcile`
  makes of them), with expected versions, on the same database and streams;
- two servers: the closed loop split over two `serve` processes sharing the database;
- open loop: `--rate` (1,000/s) offered for `--open-seconds`, latency from each report's scheduled
  time; says whether the backlog of waiting reports grows;
- retention: `--retention-events` old snapshots (received over the UTC day before yesterday, on
  that day's segment) pruned by the product's `prune_observations` while the closed loop runs:
  its p99 meanwhile, and the events table's size (all partitions) and dead tuples before, filled
  and after the prune;
- statements: the SQL statements and round trips per report, per refresh (`POST
  /hardware/refresh` of the server's own host) and per ceiling append, counted on the wire by
  the harness's StatementCounter (a proxy between a separate server process and PostgreSQL), with
  the transactions they make;
- with `--webhooks`: the closed loop with 3 webhook subscriptions active (receivers in this
  process answering 200; `--webhook-classes` selects what they get, lifecycle events by default),
  interleaved round by round with the same loop without any, and the ratio of the two;
- steady window: `--steady-reports` (5,000) telemetry reports only, to one checkout's server at a
  time with nothing else of this run writing: `WAL per report` (that database's WAL records, read
  back with pg_walinspect, since the WAL position is the cluster's) and `storage per snapshot`
  (the growth of every partition of `events` with TOAST and indexes over the NODE_TELEMETRY_OBSERVED
  events appended), printed with the closed loop's server and PostgreSQL CPU per report;
- with `--baseline CHECKOUT`: the http tier, the steady window and the statement counts of another
  checkout of the product (its own `serve`, database and agents), interleaved with this one's, and
  this checkout's figures over the baseline's.

Targets (issue 12): >= 1,000 reports/s closed loop with p99 < 100 ms; the open loop at 1,000/s
keeps up without a growing backlog; <= 1 ms of server CPU and <= 1 ms of PostgreSQL CPU per report.
Targets (issue 33), this checkout over the baseline: WAL per report and storage per snapshot <= 0.35,
reports/s >= 0.95, p99 <= 1/0.95, server CPU per report <= 0.5, PostgreSQL CPU per report <= 0.6.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, TypeVar

import msgspec

from bench import harness as h
from bench.fleet import node_key, node_observation

INVENTORY_EVERY = 30  # the agent's default (MODELFORGE_AGENT_INVENTORY_EVERY)
POOL = 10  # the pool `serve` makes
TARGET_RATE, TARGET_P99_MS, TARGET_CPU_MS = 1000.0, 100.0, 1.0
REPORTS = b"/api/v1/agent/reports"

# Placeholders encoded into each pre-built body, replaced per request.
_SENTINEL_AT = datetime(2000, 1, 1, tzinfo=UTC)
_SENTINEL_SEQ = 987_654_321_987_654
_AT = msgspec.json.encode(_SENTINEL_AT)
_SEQ = b'"sequence":' + str(_SENTINEL_SEQ).encode()
_TELEMETRY, _INVENTORY = b'"stream":"telemetry"', b'"stream":"inventory"'


def wire_report(i: int, node_id: str, rng: random.Random) -> bytes:
    """One report body of node `i` in the agent's wire format, with placeholders for the sequence
    and the times. The only use of the agent's protocol module: if it moves, change this."""
    from agent.protocol import PROTOCOL_VERSION, Report, encode_report
    from collectors.observations import CollectorRun

    obs = msgspec.structs.replace(
        node_observation(i, rng),
        observed_at=_SENTINEL_AT,
        collectors=[CollectorRun("system", True, 0.02), CollectorRun("nvml", True, 0.1)],
    )
    body = encode_report(
        Report(
            protocol=PROTOCOL_VERSION, node_id=node_id, identity_key=node_key(i), identity_source="configured",
            stream="telemetry", sequence=_SENTINEL_SEQ, observed_at=_SENTINEL_AT, observation=obs,
        )
    )  # fmt: skip
    assert body.count(_SEQ) == 1 and body.count(_TELEMETRY) == 1, "unexpected report encoding"
    return body


@dataclass
class Agent:
    index: int
    node_id: str
    headers: bytes
    templates: list[bytes]
    payloads: list[list[Any]] = field(default_factory=list)  # the events of each template (ceiling)
    reports: int = 0
    sequences: dict[str, int] = field(default_factory=lambda: {"inventory": 0, "telemetry": 0})
    version: int = 0  # the stream's version, for the ceiling's expected version
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def next_body(self, stream: str | None = None) -> bytes:
        self.reports += 1
        stream = stream or ("inventory" if self.reports % INVENTORY_EVERY == 0 else "telemetry")
        self.sequences[stream] += 1
        body = self.templates[self.reports % len(self.templates)]
        body = body.replace(_SEQ, b'"sequence":%d' % self.sequences[stream])
        body = body.replace(_AT, msgspec.json.encode(datetime.now(UTC)))
        return body.replace(_TELEMETRY, _INVENTORY) if stream == "inventory" else body

    async def send(self, conn: h.HttpConnection, stream: str | None = None) -> int:
        """One report; returns its events; raises unless accepted."""
        sent_at = b"Modelforge-Agent-Sent-At: %s\r\n" % datetime.now(UTC).isoformat().encode()
        status, resp = await conn.request(b"POST", REPORTS, self.headers + sent_at, self.next_body(stream))
        ack = msgspec.json.decode(resp) if status == 200 else {}
        if ack.get("status") != "accepted":
            raise RuntimeError(f"HTTP {status}: {resp[:300].decode(errors='replace')}")
        return int(ack["events"])


async def enroll(port: int, nodes: int, variants: int, connections: int) -> list[Agent]:
    """Every node enrolled over HTTP, as an operator and an agent would do it."""
    op = h.bearer(h.OPERATOR_TOKEN) + b"Content-Type: application/json\r\n"
    conns = [await h.HttpConnection.open(port) for _ in range(connections)]
    per = -(-nodes // connections)
    rng = random.Random(20261130)
    agents: list[Agent] = []

    async def worker(c: int) -> None:
        conn = conns[c]
        body = msgspec.json.encode({"ttl_seconds": 3600, "uses": per, "description": f"bench {c}"})
        status, resp = await conn.request(b"POST", b"/api/v1/enrollment-tokens", op, body)
        assert status == 201, resp[:300]
        token = msgspec.json.decode(resp)["token"]
        for i in range(c * per, min(nodes, (c + 1) * per)):
            req = {"identity_key": node_key(i), "identity_source": "configured", "hostname": f"gpu-{i:06d}"}
            status, resp = await conn.request(
                b"POST", b"/api/v1/agent/enroll",
                h.bearer(token) + b"Content-Type: application/json\r\n", msgspec.json.encode(req),
            )  # fmt: skip
            assert status == 201, resp[:300]
            made = msgspec.json.decode(resp)
            headers = h.bearer(made["credential"]) + b"Content-Type: application/json\r\n"
            templates = [wire_report(i, made["node_id"], rng) for _ in range(variants)]
            agents.append(Agent(i, made["node_id"], headers, templates))

    try:
        await asyncio.gather(*(worker(c) for c in range(connections)))
    finally:
        for conn in conns:
            conn.close()
    return sorted(agents, key=lambda a: a.index)


T = TypeVar("T")

GROUP_COMMIT_COUNTERS = (
    b"modelforge_ingest_report_transactions_total",
    b"modelforge_ingest_reports_committed_total",
)


async def group_commit_counts(port: int) -> tuple[float, float]:
    """(transactions, reports) the server's group commit has committed so far, from its /metrics.
    The batch size moves the CPU per report as much as a change of the code does
    (docs/performance.md, issue 12, ninth step), so each tier reports the one it ran at."""
    conn = await h.HttpConnection.open(port)
    try:
        status, body = await conn.request(b"GET", b"/metrics", h.bearer(h.OPERATOR_TOKEN))
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


async def ceiling_payloads(pool: Any, agents: list[Agent]) -> None:
    """What `reconcile` makes of each pre-built observation against the node's folded state: the
    events the server appends for such a report."""
    from collectors.identity import NodeIdentity
    from domain.reconcile import reconcile
    from projections.inventory import INVENTORY

    rng = random.Random(7)
    async with pool.acquire() as conn:
        for a in agents:
            state = await INVENTORY.load_state(conn, a.node_id)
            for _ in a.templates:
                obs = node_observation(a.index, rng)
                a.payloads.append(reconcile(obs, state, NodeIdentity(node_key(a.index), "configured")))


async def read_versions(pool: Any, agents: list[Agent]) -> None:
    """The streams' versions, for the ceiling's expected versions (the http tiers move them)."""
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT stream_id, version FROM streams WHERE stream_id = ANY($1)",
                                [a.node_id for a in agents])  # fmt: skip
    versions = {r["stream_id"]: r["version"] for r in rows}
    for a in agents:
        a.version = versions[a.node_id]


class Load:
    """The load generators of one run: each connection (or task) owns its own nodes, so a node
    never has two reports in flight."""

    def __init__(self, agents: list[Agent]) -> None:
        self.agents = agents

    async def http(self, name: str, ports: Sequence[int], connections: int, seconds: float) -> h.Sample:
        conns = [await h.HttpConnection.open(ports[c % len(ports)]) for c in range(connections)]
        groups = [self.agents[c::connections] for c in range(connections)]

        async def step(w: int, k: int) -> int:
            return await groups[w][k % len(groups[w])].send(conns[w])

        try:
            return await h.closed_loop(name, connections, seconds, step)
        finally:
            for c in conns:
                c.close()

    async def ceiling(self, store: Any, tasks: int, seconds: float) -> h.Sample:
        from ledger.events import EventMetadata, NewEvent

        groups = [self.agents[c::tasks] for c in range(tasks)]

        async def step(w: int, k: int) -> int:
            a = groups[w][k % len(groups[w])]
            now = datetime.now(UTC)
            meta = EventMetadata(
                received_at=now, source="agent", observed_at=now - timedelta(milliseconds=2),
                agent_stream="telemetry", agent_sequence=k + 1, agent_sent_at=now, agent_report_sha256="0" * 64,
            )  # fmt: skip
            events = [NewEvent(payload=p, metadata=meta) for p in a.payloads[k % len(a.payloads)]]
            a.version = (await store.append(a.node_id, a.version, events)).stream_version
            return len(events)

        return await h.closed_loop("ceiling: EventStore.append in-process", tasks, seconds, step)

    async def open(self, port: int, rate: float, seconds: float, max_in_flight: int) -> h.OpenLoop:
        conns = [await h.HttpConnection.open(port) for _ in range(max_in_flight)]

        async def step(slot: int, k: int) -> int:
            a = self.agents[k % len(self.agents)]
            async with a.lock:  # a node's reports stay in order
                return await a.send(conns[slot])

        try:
            return await h.open_loop(
                f"http open loop, {rate:,.0f}/s offered", rate, seconds, step, max_in_flight=max_in_flight
            )
        finally:
            for c in conns:
                c.close()


async def count_http(db: h.Database, work: Path, agents: list[Agent], n: int, tree: Path) -> dict[str, float]:
    """Statements per report and per refresh, counted on the wire: a separate server process (from
    `tree`) whose pool goes through the harness's counting proxy; its timings are not reported."""
    out: dict[str, float] = {}
    op = h.bearer(h.OPERATOR_TOKEN)
    async with h.StatementCounter(db.dsn) as counter:
        server = await h.start_product_server(counter.dsn, work, "counted", retention=False, tree=tree)
        conn = await h.HttpConnection.open(server.port)
        try:
            # Each kind of report counted apart: an agent sends an inventory report every
            # INVENTORY_EVERY reports, and a window of whatever comes next would mix the kinds in
            # proportions that depend on where the agents' counters stand. Warm-up: prepared
            # statements, the credential cache of every agent counted below (a fresh server looks
            # each credential up once; a steady one does not), and both streams' kept copies, the
            # telemetry stream last: a baseline from before 071e723 opens a node (seven statements)
            # for a report after one on its other stream, and its telemetry count stays steady.
            few = max(5, n // 20)
            for k in range(few):
                await agents[k % len(agents)].send(conn, "inventory")
            for k in range(min(n, len(agents))):
                await agents[k].send(conn, "telemetry")
            status, resp = await conn.request(b"POST", b"/api/v1/hardware/refresh", op)
            assert status == 200, resp[:300]
            kinds = (("report", n), ("inventory_report", few), ("refresh", few))
            for what, times in kinds:
                before = counter.counts.copy()
                for k in range(times):
                    if what == "report":
                        await agents[k % len(agents)].send(conn, "telemetry")
                    elif what == "inventory_report":
                        await agents[k % len(agents)].send(conn, "inventory")
                    else:
                        status, resp = await conn.request(b"POST", b"/api/v1/hardware/refresh", op)
                        assert status == 200, resp[:300]
                d = counter.counts - before
                out[f"{what}_executions"] = d.executions / times
                out[f"{what}_round_trips"] = d.round_trips / times
                out[f"{what}_transactions"] = d.transactions / times
        finally:
            conn.close()
            server.stop()
    return out


async def count_append(db: h.Database, agents: list[Agent]) -> dict[str, float]:
    """Statements per ceiling append (this checkout's EventStore), counted on the wire."""
    from ledger.db import create_pool
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    async with h.StatementCounter(db.dsn) as counter:
        pool = await create_pool(counter.dsn, min_size=1, max_size=4)
        try:
            store = EventStore(pool, ALL_PROJECTIONS)
            await read_versions(pool, agents)
            await Load(agents).ceiling(store, 4, 0.5)
            before = counter.counts.copy()
            s = await Load(agents).ceiling(store, 4, 2.0)
            d = counter.counts - before
        finally:
            await pool.close()
    return {
        "append_executions": d.executions / s.ops,
        "append_round_trips": d.round_trips / s.ops,
        "append_transactions": d.transactions / s.ops,
    }


@dataclass
class Target:
    """One checkout under load: its own database, its `serve` process, its enrolled agents."""

    label: str
    tree: Path
    db: h.Database
    server: h.Process
    agents: list[Agent]

    @classmethod
    async def prepare(
        cls, label: str, tree: Path, db: h.Database, work: Path, args: argparse.Namespace
    ) -> Target:
        import asyncpg

        # Webhook receivers run on 127.0.0.1, which a server refuses by default (SSRF).
        settings = {"MODELFORGE_WEBHOOK_ALLOW_PRIVATE": "1"} if args.webhooks else None
        server = await h.start_product_server(db.dsn, work, label, tree=tree, settings=settings)
        agents = await enroll(server.port, args.nodes, args.variants, 8)
        conns = [await h.HttpConnection.open(server.port) for _ in range(8)]

        async def discover(c: int) -> None:  # each node's first report, on the inventory stream
            for a in agents[c::8]:
                await a.send(conns[c], "inventory")

        try:
            await asyncio.gather(*(discover(c) for c in range(8)))
        finally:
            for conn in conns:
                conn.close()
        conn = await asyncpg.connect(db.dsn)
        try:
            await conn.execute("ANALYZE")  # the statistics autovacuum gives a live server
        finally:
            await conn.close()
        await Load(agents).http("warm-up", [server.port], args.connections, 2.0)
        return cls(label, tree, db, server, agents)


STEADY_REPORTS = 5000  # the steady window's reports per checkout (--quick: 2,000)
SNAPSHOTS = "SELECT count(*) FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED'"


@dataclass
class Steady:
    """A window of steady telemetry reports of one checkout, nothing else of this run writing
    meanwhile: what they cost in WAL and in the log's bytes."""

    reports: int  # accepted
    errors: int
    snapshots: int  # NODE_TELEMETRY_OBSERVED events appended in the window
    log_bytes: int  # growth of `events`: every partition with its TOAST and indexes
    wal: h.WalShare

    @property
    def wal_per_report(self) -> float | None:
        """The database's own WAL records per report; the cluster's WAL when they cannot be read."""
        wal = self.wal.database if self.wal.database is not None else self.wal.total
        return wal / self.reports if self.reports else None

    @property
    def storage_per_snapshot(self) -> float | None:
        return self.log_bytes / self.snapshots if self.snapshots else None

    def as_row(self, who: str) -> dict[str, Any]:
        return {
            "name": f"steady telemetry window ({who})",
            "reports": self.reports,
            "errors": self.errors,
            "snapshots": self.snapshots,
            "log_bytes": self.log_bytes,
            "wal_bytes_per_report": self.wal_per_report,
            "storage_bytes_per_snapshot": self.storage_per_snapshot,
            "wal_cluster_bytes": self.wal.total,
            "wal_records_bytes": self.wal.records,
            "wal_database_bytes": self.wal.database,
            "wal_database_fpi_bytes": self.wal.database_fpi,
        }


async def log_figures(dsn: str) -> tuple[int, int]:
    """(bytes of `events`: every partition with its TOAST and indexes, telemetry snapshots in it)."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        size = await conn.fetchval(
            f"SELECT sum(pg_total_relation_size(relid)) FROM ({h.LOG_PARTITIONS}) leaves"
        )
        return int(size), int(await conn.fetchval(SNAPSHOTS))
    finally:
        await conn.close()


async def steady_window(target: Target, reports: int, connections: int, wal: h.WalInspector) -> Steady:
    """`reports` telemetry reports (no inventory report among them) to `target`'s server alone,
    closed loop; the other checkout's server idles meanwhile."""
    conns = [await h.HttpConnection.open(target.server.port) for _ in range(connections)]
    groups = [target.agents[c::connections] for c in range(connections)]
    per = -(-reports // connections)
    accepted, errors = 0, 0

    async def worker(c: int) -> None:
        nonlocal accepted, errors
        for k in range(per):
            try:
                await groups[c][k % len(groups[c])].send(conns[c], "telemetry")
            except Exception as exc:
                errors += 1
                if errors <= 3:
                    print(f"  error (steady window, {target.label}): {exc!r}"[:300])
            else:
                accepted += 1

    size0, snapshots0 = await log_figures(target.db.dsn)
    start = await wal.position()
    try:
        await asyncio.gather(*(worker(c) for c in range(connections)))
    finally:
        for conn in conns:
            conn.close()
    end = await wal.position()
    size1, snapshots1 = await log_figures(target.db.dsn)
    share = await wal.share(start, end, target.db.name)
    return Steady(accepted, errors, snapshots1 - snapshots0, size1 - size0, share)


def print_per_report(who: str, steady: Steady | None, http: h.Sample) -> None:
    """The figures issue 33 compares, on lines of their own: WAL and storage from the steady
    window, CPU from the closed loop (its rounds interleaved with the other checkout's)."""
    wal = steady.wal_per_report if steady is not None else None
    storage = steady.storage_per_snapshot if steady is not None else None
    server, db = http.per_op("server_cpu"), http.per_op("db_cpu")
    print(f"{who}:")
    print(f"  WAL per report: {'n/a' if wal is None else f'{wal:,.0f}'} B")
    print(f"  storage per snapshot: {'n/a' if storage is None else f'{storage:,.0f}'} B")
    print(f"  server CPU per report: {'n/a' if server is None else f'{server:.3f}'} ms")
    print(f"  PostgreSQL CPU per report: {'n/a' if db is None else f'{db:.3f}'} ms")


def this_over_baseline(
    report: h.Report, steady: Steady, bsteady: Steady, http: h.Sample, base: h.Sample
) -> None:
    """Issue 33's targets: this checkout's figures over the baseline's, same run, same PostgreSQL."""

    def over(a: float | None, b: float | None) -> float:
        return a / b if a is not None and b else float("nan")

    report.ratio(h.Ratio("WAL per steady report, this / baseline", over(steady.wal_per_report, bsteady.wal_per_report), 0.35, at_least=False))  # fmt: skip
    report.ratio(h.Ratio("storage per snapshot, this / baseline", over(steady.storage_per_snapshot, bsteady.storage_per_snapshot), 0.35, at_least=False))  # fmt: skip
    report.ratio(h.Ratio("this checkout / baseline (http reports/s)", over(http.rate, base.rate), 0.95, h.cost_ratio(http, base)))  # fmt: skip
    report.ratio(h.Ratio("p99, this / baseline (closed loop)", over(http.ms(99), base.ms(99)), 1 / 0.95, at_least=False))  # fmt: skip
    for attr, label, target in (("server_cpu", "server", 0.5), ("db_cpu", "PostgreSQL", 0.6)):
        v = over(http.per_op(attr), base.per_op(attr))
        report.ratio(h.Ratio(f"{label} CPU per report, this / baseline", v, target, at_least=False))


RETENTION_STREAMS = 200  # the old snapshots are spread over this many simulated node streams


async def fill_old_telemetry(pool: Any, events: int) -> date:
    """`events` NODE_TELEMETRY_OBSERVED snapshots received over the whole UTC day before yesterday
    (copies of a real report's stored snapshot) on that day's segment, as the product's appends
    put them there, in `RETENTION_STREAMS` streams of their own, each ending with one snapshot
    received now: everything on the old day is prunable. Returns the day."""
    from ledger.segments import ensure_segments

    per = max(2, events // RETENTION_STREAMS)
    async with pool.acquire() as conn:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
        day = today - timedelta(days=2)
        await ensure_segments(conn, day, ahead=0)
        await ensure_segments(conn, today, ahead=0)
        await conn.execute(
            """
            INSERT INTO events (event_id, stream_id, stream_version, event_type, event_class,
                                schema_version, data, metadata, body, sampled, recorded_at,
                                received_at, segment)
            SELECT gen_random_uuid(), 'retention-sim-' || s, v, e.event_type, e.event_class,
                   e.schema_version, e.data, e.metadata, e.body, e.sampled, now(), r.at,
                   (r.at AT TIME ZONE 'UTC')::date
            FROM (SELECT * FROM events WHERE event_type = 'NODE_TELEMETRY_OBSERVED' LIMIT 1) e,
                 generate_series(1, $1) s, generate_series(1, $2) v,
                 LATERAL (SELECT CASE WHEN v = $2 THEN now()
                                 ELSE ($4::date)::timestamp AT TIME ZONE 'UTC' + (v - 1) * ($3 * interval '1 second')
                                 END AS at) r
            """,
            RETENTION_STREAMS,
            per,
            86_400.0 / per,
            day,
        )
        await conn.execute("VACUUM ANALYZE events")
    return day


async def table_figures(pool: Any) -> tuple[int, int]:
    """(bytes of the events table: every partition with its TOAST and indexes, dead tuples)."""
    async with pool.acquire() as conn:
        size = await conn.fetchval(
            f"SELECT sum(pg_total_relation_size(relid)) FROM ({h.LOG_PARTITIONS}) leaves"
        )
        dead = await conn.fetchval(
            f"SELECT sum(n_dead_tup) FROM pg_stat_user_tables WHERE relid IN ({h.LOG_PARTITIONS})"
        )
    return int(size), int(dead or 0)


WEBHOOK_TARGET = 0.9  # ingest with 3 subscriptions active, as a share of ingest without


async def webhook_rounds(
    port: int, load: Load, meter: h.Meter, args: argparse.Namespace
) -> tuple[h.Sample, h.Sample, int]:
    """The closed loop without webhooks and with 3 subscriptions active, round by round."""
    from bench.webhooks import Receiver, subscribed

    c = args.connections
    classes = [x for x in args.webhook_classes.split(",") if x]
    without = h.Sample(f"http: no webhook subscriptions, {c} in flight")
    with_hooks = h.Sample(f"http: 3 webhook subscriptions ({'+'.join(classes)}), {c} in flight")
    receivers = [await Receiver().start() for _ in range(3)]
    try:
        for _ in range(args.rounds):
            s, u = await meter.measure(load.http(without.name, [port], c, args.duration))
            without.merge(s, u)
            async with subscribed(port, receivers, classes):
                s, u = await meter.measure(load.http(with_hooks.name, [port], c, args.duration))
                with_hooks.merge(s, u)
    finally:
        for r in receivers:
            r.close()
    return without, with_hooks, sum(r.deliveries for r in receivers)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = h.parser(__doc__)
    p.add_argument("--nodes", type=int, default=1000, help="simulated agents of 8 GPUs (default 1,000)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per tier per round (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--connections", type=int, default=16, help="reports in flight, closed loop (default 16)")
    p.add_argument("--rate", type=float, default=TARGET_RATE, help="open-loop rate offered (default 1,000/s)")
    p.add_argument("--open-seconds", type=float, default=60.0, help="open-loop length (default 60 s)")
    p.add_argument("--variants", type=int, default=3, help="pre-built observations per node (default 3)")
    p.add_argument("--count", type=int, default=400, help="reports in the statement-counting window")
    p.add_argument(
        "--steady-reports", type=int, default=STEADY_REPORTS,
        help="telemetry reports per checkout in the steady window, where WAL and storage are measured "
        f"(default {STEADY_REPORTS:,}; 0 skips it)",
    )  # fmt: skip
    p.add_argument("--no-two-servers", dest="two_servers", action="store_false", help="skip two servers")
    p.add_argument("--no-open-loop", dest="open_loop", action="store_false", help="skip the open loop")
    p.add_argument("--no-count", dest="count_statements", action="store_false", help="skip the counting")
    p.add_argument(
        "--retention-events", type=int, default=400_000,
        help="old snapshots pruned while the closed loop runs (default 400,000: a day of ~46 nodes at 10 s; "
        "0 skips the retention tier)",
    )  # fmt: skip
    p.add_argument(
        "--baseline", metavar="CHECKOUT", type=Path,
        help="another checkout of the product (e.g. a worktree of main) to compare with in the same run: its "
        "`serve` gets its own database and agents, and its http tier and statement counts are interleaved "
        "with this checkout's",
    )  # fmt: skip
    p.add_argument(
        "--webhooks", action="store_true",
        help="also measure the closed loop with 3 webhook subscriptions active, against the same loop without",
    )  # fmt: skip
    p.add_argument(
        "--webhook-classes", default="lifecycle",
        help="the event classes the 3 subscriptions select, comma-separated (default lifecycle; "
        "lifecycle,observation delivers every report's telemetry too)",
    )  # fmt: skip
    p.add_argument(
        "--replica", action="store_true",
        help="instead: the closed loop against PostgreSQL 15 clusters of this machine without a standby and "
        "with one (synchronous_commit remote_apply, on, asynchronous), same run (bench/replica.py)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.rounds, args.duration, args.open_seconds, args.count = 500, 2, 3.0, 15.0, 200
        args.steady_reports = min(args.steady_reports, 2000)
        args.retention_events = min(args.retention_events, 100_000)
    return args


async def run(args: argparse.Namespace) -> int:
    from ledger.db import create_pool
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    report = h.Report("ingest")
    await h.describe_environment(report, "ingest")
    async with contextlib.AsyncExitStack() as stack:
        work = await stack.enter_async_context(h.workdir("ingest", keep=args.keep))
        db = await stack.enter_async_context(h.throwaway_database("ingest", keep=args.keep))
        processes: list[h.Process] = []
        stack.callback(lambda: [p.stop() for p in processes])
        t0 = time.perf_counter()
        this = await Target.prepare("server", h.ROOT, db, work, args)
        processes.append(this.server)
        baseline: Target | None = None
        if args.baseline:
            bdb = await stack.enter_async_context(h.throwaway_database("baseline", keep=args.keep))
            baseline = await Target.prepare("baseline", args.baseline.resolve(), bdb, work, args)
            processes.append(baseline.server)
        agents, load = this.agents, Load(this.agents)
        pool = await create_pool(db.dsn, min_size=2, max_size=POOL)
        stack.push_async_callback(pool.close)
        await ceiling_payloads(pool, agents)
        store = EventStore(pool, ALL_PROJECTIONS)
        print(f"setup: {len(agents):,} nodes enrolled and discovered over HTTP per checkout in "
              f"{time.perf_counter() - t0:.0f} s (untimed)")  # fmt: skip

        meter = await h.Meter.open([db.name], [this.server.pid])
        stack.push_async_callback(meter.close)
        bmeter: h.Meter | None = None
        if baseline is not None:
            bmeter = await h.Meter.open([baseline.db.name], [baseline.server.pid])
            stack.push_async_callback(bmeter.close)
        c = args.connections
        http = h.Sample(f"http: POST /agent/reports, {c} in flight")
        ceiling = h.Sample("ceiling: EventStore.append in-process")
        base = h.Sample(f"baseline http ({args.baseline}), {c} in flight")
        batches = Batches(this.server.port)
        bbatches = Batches(baseline.server.port) if baseline is not None else None
        for _ in range(args.rounds):
            s, u = await batches.around(
                meter.measure(load.http(http.name, [this.server.port], c, args.duration))
            )
            http.merge(s, u)
            if baseline is not None and bmeter is not None and bbatches is not None:
                s, u = await bbatches.around(
                    bmeter.measure(Load(baseline.agents).http("", [baseline.server.port], c, args.duration))
                )
                base.merge(s, u)
        # The steady windows, one checkout at a time, before anything else of this run writes:
        # the WAL position is the cluster's, so each window has only that server's reports.
        steady: Steady | None = None
        bsteady: Steady | None = None
        wal_note = ""
        if args.steady_reports > 0:
            wdb = await stack.enter_async_context(h.throwaway_database("wal", keep=args.keep))
            wal = await h.WalInspector.open(wdb.dsn)
            stack.push_async_callback(wal.close)
            steady = await steady_window(this, args.steady_reports, c, wal)
            if baseline is not None:
                bsteady = await steady_window(baseline, args.steady_reports, c, wal)
            wal_note = wal.why_not or (
                "the bytes of the window's WAL records of that checkout's database (the relations they change,\n"
                "the commits of its transactions), read back with pg_walinspect; other databases' are left out"
            )
        # The ceiling after the http rounds, not between them: it appends to this checkout's
        # database and streams, which the baseline's never see, and interleaved it put this
        # checkout's http rounds 5-20 % behind an identical baseline's (docs/performance.md,
        # issue 12, ninth step). Its warm-up too: it writes this checkout's streams, so before the
        # http rounds it left this server's kept states outdated and put its rounds 7 % behind an
        # identical baseline's (docs/performance.md, issue 12, eleventh step).
        await read_versions(pool, agents)
        await load.ceiling(store, args.connections, 1.0)
        for _ in range(args.rounds):
            await read_versions(pool, agents)
            s, u = await meter.measure(load.ceiling(store, c, args.duration))
            ceiling.merge(s, u)
        samples = [http, ceiling] + ([base] if baseline is not None else [])

        hooked: tuple[h.Sample, h.Sample, int] | None = None
        if args.webhooks:
            hooked = await webhook_rounds(this.server.port, load, meter, args)
            samples += [hooked[0], hooked[1]]

        two: h.Sample | None = None
        if args.two_servers:
            second = await h.start_product_server(db.dsn, work, "server2")
            processes.append(second)
            meter.server_pids = [this.server.pid, second.pid]
            await load.http("warm-up", [second.port], 4, 1.0)
            two = h.Sample(f"http: two servers on one database, {c} in flight")
            for _ in range(args.rounds):
                s, u = await meter.measure(
                    load.http(two.name, [this.server.port, second.port], c, args.duration)
                )
                two.merge(s, u)
            samples.append(two)
            second.stop()
            meter.server_pids = [this.server.pid]

        opened: h.OpenLoop | None = None
        if args.open_loop:
            opened, u = await meter.measure(load.open(this.server.port, args.rate, args.open_seconds, 64))
            u.seconds = opened.sample.usage.seconds
            opened.sample.usage = u
            samples.append(opened.sample)

        pruning: h.Sample | None = None
        if args.retention_events > 0:
            from ledger.retention import prune_observations

            before = await table_figures(pool)
            day = await fill_old_telemetry(pool, args.retention_events)
            filled = await table_figures(pool)
            pruning = h.Sample(f"http while pruning {args.retention_events:,} old snapshots, {c} in flight")
            started = time.perf_counter()
            prune = asyncio.create_task(prune_observations(pool))
            while not prune.done():
                s, u = await meter.measure(
                    load.http(pruning.name, [this.server.port], c, min(args.duration, 3.0))
                )
                pruning.merge(s, u)
            pruned = prune.result()
            took = time.perf_counter() - started
            after_prune = await table_figures(pool)
            samples.append(pruning)
            mib = 1024 * 1024
            report.note(
                f"retention: {pruned.deleted:,} snapshots pruned ({', '.join(d.isoformat() for d in pruned.segments_dropped)}"
                f" dropped whole, {pruned.kept_past_day} kept past their day; the simulated day {day.isoformat()}) in "
                f"{took:.1f} s while the closed loop ran (p99 {pruning.ms(99):.0f} ms, against {http.ms(99):.0f} ms "
                f"without); events table, every partition with TOAST and indexes: {before[0] / mib:,.0f} MiB before "
                f"the fill, {filled[0] / mib:,.0f} MiB filled, {after_prune[0] / mib:,.0f} MiB after the prune "
                f"({after_prune[1]:,} dead tuples; no VACUUM)"
            )

        h.table(
            ["tier", "reports/s", "events/s", "p50 ms", "p99 ms", "errors", "server ms", "PG ms", "client ms", "WAL KB"],
            [[s.name, s.rate, s.unit_rate, s.ms(50), s.ms(99), s.errors, s.per_op("server_cpu"),
              s.per_op("db_cpu"), s.per_op("client_cpu"), s.per_op("wal_bytes", 1 / 1024)] for s in samples],
            first_width=52,
        )  # fmt: skip
        print("  (CPU per report: server = the serve process(es), PG = the database's backends, client = this\n"
              "   process: the load generator, or the ceiling's append itself; WAL: how far the server's WAL\n"
              "   position moved per report, whoever wrote it: the steady window below counts only its database's)")  # fmt: skip
        for s in samples:
            report.row(**s.as_row())
            for e in s.error_samples:
                print(f"  error ({s.name}): {e}")
        if steady is not None:
            windows = [("this checkout", steady)] + ([("baseline", bsteady)] if bsteady is not None else [])
            lines = []
            for who, w in windows:
                report.row(**w.as_row(who))
                others = w.wal.others
                per = max(1, w.reports)
                lines.append(
                    f"  {who}: {w.reports:,} reports ({w.errors} errors), {w.snapshots:,} snapshots appended, "
                    f"events +{w.log_bytes / 1024:,.0f} KiB;\n    the cluster's WAL position moved {w.wal.total / per:,.0f} B per report"
                    + ("" if others is None else f" ({others / max(1, w.wal.total):.0%} of it other databases' records or none's)")
                    + ("" if w.wal.database_fpi is None else f"; full-page images {w.wal.database_fpi / per:,.0f} B of the report's WAL")
                )  # fmt: skip
            report.note(
                "steady window: telemetry reports only, one checkout's server at a time, nothing else of this run\n"
                "writing meanwhile (the WAL position is the cluster's, and this PostgreSQL may be shared).\n"
                f"WAL per report: {wal_note}.\n"
                "storage per snapshot: the growth of every partition of `events` (table, TOAST, indexes) over the\n"
                "NODE_TELEMETRY_OBSERVED events appended in the window.\n" + "\n".join(lines)
            )  # fmt: skip
        print_per_report("this checkout", steady, http)
        if baseline is not None:
            print_per_report(f"baseline ({args.baseline})", bsteady, base)
        report.note(
            f"group commit during the closed loop: {batches.size:.1f} reports per transaction"
            + (f" (baseline: {bbatches.size:.1f})" if bbatches is not None else "")
        )
        if opened is not None:
            state = "grows (overloaded: stopped early)" if opened.overloaded else (
                "grows" if opened.backlog_grows else "does not grow")  # fmt: skip
            report.note(
                f"open loop at {opened.offered:,.0f}/s offered for {opened.offered_seconds:.0f} s: "
                f"{opened.sample.rate:,.0f} answered/s, {opened.abandoned:,} never sent, backlog {state} (waiting each second: "
                f"{', '.join(map(str, opened.backlog[:20]))}{'...' if len(opened.backlog) > 20 else ''})"
            )

        if args.count_statements:
            counted = {"this checkout": {**await count_http(db, work, agents, args.count, h.ROOT),
                                         **await count_append(db, agents)}}  # fmt: skip
            if baseline is not None:
                counted["baseline"] = await count_http(
                    baseline.db, work, baseline.agents, args.count, baseline.tree
                )
            lines = []
            for who, figures in counted.items():
                report.row(name=f"statements ({who})", **figures)
                for k, what in (
                    ("report", "telemetry report"),
                    ("inventory_report", "inventory report"),
                    ("refresh", "refresh"),
                    ("append", "ceiling append"),
                ):
                    if f"{k}_executions" in figures:
                        lines.append(
                            f"  {who:<14} per {what:<16} {figures[k + '_executions']:5.1f} / "
                            f"{figures[k + '_round_trips']:5.1f} / {figures[k + '_transactions']:4.1f}"
                        )
            report.note(
                "SQL counted on the wire (statements executed / round trips / transactions; an executemany of\n"
                "n rows is n executions in one round trip; a refresh is POST /hardware/refresh of the server's host):\n"
                + "\n".join(lines)
            )

        report.ratio(
            h.Ratio("http / ceiling (reports/s)", http.rate / ceiling.rate, None, h.cost_ratio(http, ceiling))
        )
        if baseline is not None and steady is not None and bsteady is not None:
            this_over_baseline(report, steady, bsteady, http, base)
        elif baseline is not None:
            report.ratio(
                h.Ratio(
                    "this checkout / baseline (http reports/s)",
                    http.rate / base.rate,
                    0.95,
                    h.cost_ratio(http, base),
                )
            )
        if two is not None:
            report.ratio(h.Ratio("two servers / one server (reports/s)", two.rate / http.rate, None))
        if hooked is not None:
            without, with_hooks, delivered = hooked
            report.note(f"webhooks: {delivered:,} deliveries received by the 3 receivers during their rounds")
            report.ratio(
                h.Ratio(
                    "3 webhook subscriptions / none (http reports/s)",
                    with_hooks.rate / without.rate if without.rate else 0.0,
                    WEBHOOK_TARGET,
                    h.cost_ratio(with_hooks, without),
                )
            )
        report.ratio(h.Ratio("http reports/s (closed loop)", http.rate, TARGET_RATE))
        report.ratio(h.Ratio("http p99 ms (closed loop)", http.ms(99), TARGET_P99_MS, at_least=False))
        if pruning is not None:
            report.ratio(
                h.Ratio(
                    "http p99 ms while pruning (closed loop)", pruning.ms(99), TARGET_P99_MS, at_least=False
                )
            )
        for attr, label in (("server_cpu", "server"), ("db_cpu", "PostgreSQL")):
            v = http.per_op(attr)
            if v is not None:
                report.ratio(h.Ratio(f"{label} CPU ms per report", v, TARGET_CPU_MS, at_least=False))
        if opened is not None:
            report.ratio(
                h.Ratio(
                    f"open loop at {opened.offered:,.0f}/s keeps up (1 = yes)", float(opened.keeps_up), 1.0
                )
            )
        report.finish(args.json)
        return 1 if any(s.errors for s in samples if s is not (opened and opened.sample)) else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replica:
        from bench.replica import run_replica

        return h.main(run_replica, args)
    return h.main(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
