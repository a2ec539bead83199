"""Ingest benchmark (issue 4): simulated agents reporting through the real HTTP API, next to the
ledger-only append ceiling measured in the same run.

    python -m bench.ingest                 # default: 1,000 nodes x 8 GPUs, 2 rounds of 10 s per tier
    python -m bench.ingest --quick         # a smoke run (1,000 nodes, 1 round of 4 s)
    python -m bench.ingest --py-spy        # also sample the server with py-spy under load

Everything runs on a throwaway database (`mf_bench_<random>_ingest`) of the server named by
MODELFORGE_BENCH_DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test), dropped at
the end (`--keep` keeps it and the server's log).

1. Server: ONE uvicorn process on 127.0.0.1, the product's own app (`api.http.server.make_app`, which
   migrates, builds the real context with the EnrollmentService and starts the retention loop),
   served as `modelforge-hw serve` serves it (`log_config=None, access_log=False, lifespan="on"`,
   structlog at INFO as `serve` configures it, into a log file).
2. Agents (simulated, no NVML): N nodes of 8 GPUs (the fleet types of bench/_common.py: H200,
   H100, A100 with MIG, L40S), each enrolled with the product's EnrollmentService in-process (a
   credential per node, as `POST /agent/enroll` would issue), then one `inventory` report each
   through HTTP (discovery: untimed). Reports are the agent's wire format (`agent.protocol.Report`,
   a full `HardwareObservation` of ~6 KB, fresh telemetry every time, unchanged inventory facts),
   with the node's credential as bearer and the `Modelforge-Agent-Sent-At` header. Like the agent,
   every 30th report of a node goes on the `inventory` stream and the others on `telemetry`,
   each stream with its own strictly increasing sequence; a node never has two reports in flight
   (its reports stay in order). Each steady report is 9 observation events (host + 8 GPUs).
   The load generator is a minimal keep-alive HTTP/1.1 client over asyncio streams with the report
   bodies pre-encoded (only the sequence and the times are spliced in per request), so it costs a
   fraction of the server's CPU; its CPU is printed.
3. Tiers, interleaved in rounds, same concurrency (`--connections`, default 16; pools of 10 as
   `serve` makes them):
   - http: closed loop, as fast as the server takes them (the verdict's reports/s);
   - service (diagnostic): the same report bodies through `EnrollmentService.accept_report` in
     this process, no HTTP (authenticate, decode, validate, lock, sequence check, reconcile,
     append, advance), to split HTTP/ASGI cost from the ingest path;
   - ledger (the ceiling): `EventStore(pool, ALL_PROJECTIONS).append` in this process of the same
     9 events per report (what `reconcile` makes of those observations), with expected versions,
     on the same database and the same streams.
   Then the http tier again at other concurrencies (`--sweep`, default 8, 32 and 64 connections,
   5 s each): the capacity is the best closed-loop rate seen.
   Then an open loop at the target rate (`--rate`, default 1,000 reports/s; latency measured from
   each report's scheduled time, so a stalled server cannot hide its queue), stopped early when
   the backlog passes 2 s of reports. When the closed-loop capacity is below the target, another
   open loop at 0.5 x capacity shows the latency at a rate this server can sustain.

Targets on this 2-core machine: >= 1,000 reports/s sustained with p99 < 100 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from bench._common import (
    bench_database_name,
    cpu_of,
    create_database,
    drop_database,
    machine_description,
    node_key,
    node_observation,
    server_description,
    server_dsn,
    summarize_pyspy,
    verdict,
)

ROOT = Path(__file__).resolve().parent.parent
OPERATOR_TOKEN = "bench-ingest-operator-token"
INVENTORY_EVERY = 30  # the agent's default (MODELFORGE_AGENT_INVENTORY_EVERY)
POOL_MAX = 10  # what `serve` (api.http.server.make_app) gives its pool
TARGET_RATE = 1000.0
TARGET_P99_MS = 100.0

# Placeholders encoded into each pre-built body; replaced per request.
_SENTINEL_AT = datetime(2000, 1, 1, tzinfo=UTC)
_SENTINEL_SEQ = 987_654_321_987_654
_AT_BYTES = msgspec.json.encode(_SENTINEL_AT)
_SEQ_BYTES = b'"sequence":' + str(_SENTINEL_SEQ).encode()
_TELEMETRY = b'"stream":"telemetry"'
_INVENTORY = b'"stream":"inventory"'


# --- the server ------------------------------------------------------------------------------------


def serve_main(argv: Sequence[str]) -> int:
    """`python -m bench.ingest _serve PORT DSN STATE_DIR`: the product's app, served as `serve` does."""
    import uvicorn

    from api.config import ServerConfig, token_hash
    from api.http.server import make_app
    from ledger.logs import configure_logging

    port, dsn, state_dir = int(argv[0]), argv[1], argv[2]
    configure_logging(level="INFO", json=True)  # `serve`'s default level; stderr is the log file
    config = ServerConfig(
        database_url=dsn,
        state_dir=Path(state_dir),
        node_id="bench-ingest-api-host",
        admin_token=OPERATOR_TOKEN,
    )
    app = make_app(config, dsn, token_hash(OPERATOR_TOKEN))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on")
    )
    asyncio.run(server.serve())
    return 0


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def cpu_seconds(self) -> float | None:
        return cpu_of([self.proc.pid])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def start_server(
    dsn: str, workdir: Path, *, module: str = "bench.ingest", name: str = "server"
) -> Server:
    """The server in a subprocess: `python -m <module> _serve PORT DSN STATE_DIR` (an experiment
    module patches the product first, then calls `serve_main`)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    log = workdir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as out:  # noqa: ASYNC230
        proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-m", module, "_serve", str(port), dsn, str(workdir / f"state-{name}")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(proc, port, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            conn = await HttpConnection.open(port)
            try:
                status, _ = await conn.request(b"GET", b"/api/v1/health", b"", b"")
            finally:
                conn.close()
            if status == 200:
                return server
        await asyncio.sleep(0.2)
    server.stop()
    raise RuntimeError(f"the server did not answer /api/v1/health within 60 s: {log.read_text()[-2000:]}")


# --- a minimal HTTP/1.1 keep-alive client ------------------------------------------------------------


class HttpConnection:
    """One keep-alive connection; requests pre-encoded; responses with Content-Length only (what
    uvicorn sends for Litestar's responses). Costs ~0.1 ms of CPU per request, a fraction of
    httpx's."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> HttpConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def request(self, method: bytes, path: bytes, headers: bytes, body: bytes) -> tuple[int, bytes]:
        self.writer.write(
            b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Length: %d\r\n\r\n%s"
            % (method, path, headers, len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        i = head.lower().find(b"\r\ncontent-length:")
        if i < 0:
            raise ValueError(f"response without Content-Length: {head[:200]!r}")
        n = int(head[i + 17 : head.index(b"\r\n", i + 2)])
        return status, await self.reader.readexactly(n)

    def close(self) -> None:
        self.writer.close()


# --- the simulated agents ------------------------------------------------------------------------


@dataclass
class Agent:
    index: int
    node_id: str
    identity_key: str
    credential: bytes
    headers: bytes  # Authorization + Content-Type, pre-encoded
    templates: list[bytes]  # encoded Report bodies (telemetry stream) with placeholders
    payloads: list[list[Any]] = field(default_factory=list)  # the events of each variant (ceiling)
    principal: Any = None
    reports: int = 0
    sequences: dict[str, int] = field(default_factory=lambda: {"inventory": 0, "telemetry": 0})
    version: int = 0  # stream version, for the ledger tier's expected version
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def next_body(self, *, stream: str | None = None) -> bytes:
        """The next report of this node: the next sequence of its stream, observed now."""
        self.reports += 1
        if stream is None:
            stream = "inventory" if self.reports % INVENTORY_EVERY == 0 else "telemetry"
        self.sequences[stream] += 1
        body = self.templates[self.reports % len(self.templates)]
        body = body.replace(_SEQ_BYTES, b'"sequence":%d' % self.sequences[stream]).replace(
            _AT_BYTES, msgspec.json.encode(datetime.now(UTC))
        )
        return body.replace(_TELEMETRY, _INVENTORY) if stream == "inventory" else body


def build_agent(i: int, credential: str, variants: int, rng: random.Random) -> Agent:
    from agent.protocol import PROTOCOL_VERSION, Report, encode_report
    from collectors.observations import CollectorRun
    from ledger.node import node_id_for

    key = node_key(i)
    node_id = node_id_for(key)
    templates = []
    for _ in range(variants):
        obs = node_observation(i, rng)
        obs = msgspec.structs.replace(
            obs,
            observed_at=_SENTINEL_AT,
            collectors=[
                CollectorRun("system", True, round(rng.uniform(0.01, 0.05), 4)),
                CollectorRun("nvml", True, round(rng.uniform(0.02, 0.2), 4)),
            ],
        )
        report = Report(
            protocol=PROTOCOL_VERSION,
            node_id=node_id,
            identity_key=key,
            identity_source="configured",
            stream="telemetry",
            sequence=_SENTINEL_SEQ,
            observed_at=_SENTINEL_AT,
            observation=obs,
        )
        body = encode_report(report)
        assert body.count(_SEQ_BYTES) == 1 and body.count(_TELEMETRY) == 1, "unexpected report encoding"
        templates.append(body)
    headers = b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n" % credential.encode()
    return Agent(i, node_id, key, credential.encode(), headers, templates)


def sent_at_header() -> bytes:
    return b"Modelforge-Agent-Sent-At: %s\r\n" % datetime.now(UTC).isoformat().encode()


_ack_decoder = msgspec.json.Decoder(dict[str, Any])


# --- measurements ----------------------------------------------------------------------------------


@dataclass
class Window:
    """One timed window of one tier."""

    reports: int = 0
    events: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    client_cpu: float = 0.0  # this process (the load generator, or the in-process tier)
    server_cpu: float | None = 0.0  # the uvicorn process
    db_cpu: float | None = 0.0  # PostgreSQL backends of the bench database
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


@dataclass
class Tier:
    name: str
    windows: list[Window] = field(default_factory=list)

    def _sum(self, attr: str) -> float:
        return float(sum(getattr(w, attr) for w in self.windows))

    @property
    def rate(self) -> float:
        s = self._sum("seconds")
        return self._sum("reports") / s if s else 0.0

    @property
    def event_rate(self) -> float:
        s = self._sum("seconds")
        return self._sum("events") / s if s else 0.0

    def pct(self, p: float) -> float:
        lat = sorted(x for w in self.windows for x in w.latencies)
        if not lat:
            return float("nan")
        return 1e3 * lat[min(len(lat) - 1, int(p / 100 * len(lat)))]

    def cpu_ms(self, attr: str) -> float | None:
        n = self._sum("reports")
        vals = [getattr(w, attr) for w in self.windows]
        if not n or any(v is None for v in vals):
            return None
        return 1e3 * sum(vals) / n

    def line(self) -> str:
        def ms(v: float | None) -> str:
            return "n/a" if v is None else f"{v:.2f}"

        errors = int(self._sum("errors"))
        return (
            f"  {self.name:<40} {self.rate:>8,.0f} {self.event_rate:>9,.0f} {self.pct(50):>7.1f} "
            f"{self.pct(99):>7.1f} {errors:>6}   {ms(self.cpu_ms('client_cpu')):>7} "
            f"{ms(self.cpu_ms('server_cpu')):>7} {ms(self.cpu_ms('db_cpu')):>8}"
        )


class Meter:
    """CPU of the PostgreSQL backends of the bench database (from /proc), of the server process,
    and of this process, around a window."""

    def __init__(self, monitor: asyncpg.Connection, database: str, server: Server | None) -> None:
        self.monitor = monitor
        self.database = database
        self.server = server

    async def _db(self) -> float | None:
        rows = await self.monitor.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", self.database
        )
        return cpu_of([r["pid"] for r in rows])

    async def measure(self, work: Awaitable[Any]) -> Any:
        """Await `work` (returning a Window, or an OpenLoopResult holding one) and charge its
        window the wall time (closed loops) and the CPU spent meanwhile."""
        d0 = await self._db()
        s0 = self.server.cpu_seconds() if self.server else None
        c0, t0 = time.process_time(), time.perf_counter()
        result = await work
        seconds, client = time.perf_counter() - t0, time.process_time() - c0
        d1 = await self._db()
        s1 = self.server.cpu_seconds() if self.server else None
        w = result.window if isinstance(result, OpenLoopResult) else result
        if not isinstance(result, OpenLoopResult):
            w.seconds = seconds
        w.client_cpu = client
        # Backends that exited in between make this an underestimate, never an overestimate.
        w.db_cpu = None if d0 is None or d1 is None else max(0.0, d1 - d0)
        w.server_cpu = None if s0 is None or s1 is None else s1 - s0
        return result


def _check_ack(w: Window, status: int, body: bytes) -> None:
    if status != 200:
        w.error(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        return
    ack = _ack_decoder.decode(body)
    if ack.get("status") != "accepted":
        w.error(f"not accepted: {body[:300].decode(errors='replace')}")
        return
    w.reports += 1
    w.events += ack["events"]


async def http_closed_loop(agents: list[Agent], port: int, connections: int, seconds: float) -> Window:
    """`connections` keep-alive connections, each sending the next report of its own nodes as soon
    as the previous one is answered."""
    w = Window()
    conns = [await HttpConnection.open(port) for _ in range(connections)]
    groups = [agents[c::connections] for c in range(connections)]
    deadline = time.perf_counter() + seconds

    async def worker(conn: HttpConnection, group: list[Agent]) -> None:
        k = 0
        while time.perf_counter() < deadline:
            a = group[k % len(group)]
            k += 1
            body = a.next_body()
            t0 = time.perf_counter()
            status, resp = await conn.request(
                b"POST", b"/api/v1/agent/reports", a.headers + sent_at_header(), body
            )
            w.latencies.append(time.perf_counter() - t0)
            _check_ack(w, status, resp)

    try:
        await asyncio.gather(*(worker(c, g) for c, g in zip(conns, groups, strict=True)))
    finally:
        for c in conns:
            c.close()
    return w


@dataclass
class OpenLoopResult:
    window: Window
    offered_rate: float
    scheduled: int
    overloaded: bool


async def http_open_loop(
    agents: list[Agent], port: int, rate: float, seconds: float, max_connections: int
) -> OpenLoopResult:
    """Reports scheduled at a fixed rate, round robin over the nodes (each node every
    len(agents)/rate s), whatever the server's answers; at most `max_connections` in flight.
    Latency counts from the scheduled send time (coordinated omission corrected). Stops early
    when the backlog exceeds 2 s of reports."""
    w = Window()
    idle: asyncio.Queue[HttpConnection] = asyncio.Queue()
    conns = [await HttpConnection.open(port) for _ in range(max_connections)]
    for c in conns:
        idle.put_nowait(c)
    total = int(rate * seconds)
    pending: set[asyncio.Task[None]] = set()
    overloaded = False

    async def one(k: int, due: float) -> None:
        a = agents[k % len(agents)]
        async with a.lock:  # a node's reports stay in order
            conn = await idle.get()
            try:
                body = a.next_body()
                status, resp = await conn.request(
                    b"POST", b"/api/v1/agent/reports", a.headers + sent_at_header(), body
                )
            finally:
                idle.put_nowait(conn)
        w.latencies.append(time.perf_counter() - due)
        _check_ack(w, status, resp)

    t0 = time.perf_counter() + 0.01
    launched = 0
    try:
        while launched < total:
            now = time.perf_counter()
            due_n = min(total, int((now - t0) * rate) + 1) if now >= t0 else 0
            while launched < due_n:
                task = asyncio.create_task(one(launched, t0 + launched / rate))
                pending.add(task)
                task.add_done_callback(pending.discard)
                launched += 1
            if len(pending) > 2 * rate:
                overloaded = True
                break
            await asyncio.sleep(0.001)
        if pending:
            done, not_done = await asyncio.wait(pending, timeout=10)
            for t in not_done:
                t.cancel()
            for t in done:
                if t.exception() is not None:
                    w.error(repr(t.exception()))
    finally:
        for c in conns:
            c.close()
    w.seconds = time.perf_counter() - t0
    return OpenLoopResult(w, rate, launched, overloaded)


async def service_closed_loop(service: Any, agents: list[Agent], tasks: int, seconds: float) -> Window:
    """The same report bodies through EnrollmentService.authenticate + accept_report, in process."""
    from api.services.errors import DomainError

    w = Window()
    deadline = time.perf_counter() + seconds
    groups = [agents[c::tasks] for c in range(tasks)]

    async def worker(group: list[Agent]) -> None:
        k = 0
        while time.perf_counter() < deadline:
            a = group[k % len(group)]
            k += 1
            body = a.next_body()
            t0 = time.perf_counter()
            try:
                principal = await service.authenticate(a.credential.decode())
                ack = await service.accept_report(principal, body, datetime.now(UTC))
            except DomainError as exc:
                w.latencies.append(time.perf_counter() - t0)
                w.error(f"{type(exc).__name__} {exc.type}: {exc.detail}")
                continue
            w.latencies.append(time.perf_counter() - t0)
            w.reports += 1
            w.events += ack.events

    await asyncio.gather(*(worker(g) for g in groups))
    return w


async def ledger_closed_loop(store: Any, agents: list[Agent], tasks: int, seconds: float) -> Window:
    """The ceiling: EventStore.append (inline projections) of the same 9 events per report."""
    from ledger.events import EventMetadata, NewEvent

    w = Window()
    deadline = time.perf_counter() + seconds
    groups = [agents[c::tasks] for c in range(tasks)]

    async def worker(group: list[Agent]) -> None:
        k = 0
        while time.perf_counter() < deadline:
            a = group[k % len(group)]
            k += 1
            now = datetime.now(UTC)
            meta = EventMetadata(
                received_at=now,
                source="agent",
                observed_at=now - timedelta(milliseconds=2),
                agent_stream="telemetry",
                agent_sequence=k,
                agent_sent_at=now - timedelta(milliseconds=1),
                agent_report_sha256="0" * 64,
                actor="credential:" + a.credential[4:36].decode(),
            )
            events = [NewEvent(payload=p, metadata=meta) for p in a.payloads[k % len(a.payloads)]]
            t0 = time.perf_counter()
            result = await store.append(a.node_id, a.version, events)
            w.latencies.append(time.perf_counter() - t0)
            a.version = result.stream_version
            w.reports += 1
            w.events += len(events)

    await asyncio.gather(*(worker(g) for g in groups))
    return w


# --- setup -----------------------------------------------------------------------------------------


async def enroll_all(service: Any, nodes: int, tokens: int) -> list[tuple[int, str]]:
    """A credential per node through the product's EnrollmentService (what POST /agent/enroll
    does), several tokens so the token-stream lock does not serialize the whole setup."""
    from agent.protocol import EnrollRequest

    per = -(-nodes // tokens)
    made = [await service.create_token(3600, per, f"bench-ingest {t}") for t in range(tokens)]
    out: list[tuple[int, str]] = []

    async def worker(t: int) -> None:
        for i in range(t * per, min(nodes, (t + 1) * per)):
            resp = await service.enroll(
                made[t].token,
                EnrollRequest(
                    identity_key=node_key(i),
                    identity_source="configured",
                    hostname=f"gpu-r{i // 32:03d}-u{i % 32:02d}.dc1.example.net",
                    agent_version="bench",
                ),
            )
            out.append((i, resp.credential))

    await asyncio.gather(*(worker(t) for t in range(tokens)))
    return sorted(out)


async def discover_all(agents: list[Agent], port: int, connections: int) -> tuple[float, Window]:
    """Each node's first report (inventory stream, sequence 1): discovery through HTTP."""
    w = Window()
    conns = [await HttpConnection.open(port) for _ in range(connections)]
    groups = [agents[c::connections] for c in range(connections)]
    t0 = time.perf_counter()

    async def worker(conn: HttpConnection, group: list[Agent]) -> None:
        for a in group:
            body = a.next_body(stream="inventory")
            s0 = time.perf_counter()
            status, resp = await conn.request(
                b"POST", b"/api/v1/agent/reports", a.headers + sent_at_header(), body
            )
            w.latencies.append(time.perf_counter() - s0)
            _check_ack(w, status, resp)

    try:
        await asyncio.gather(*(worker(c, g) for c, g in zip(conns, groups, strict=True)))
    finally:
        for c in conns:
            c.close()
    return time.perf_counter() - t0, w


async def ceiling_payloads(pool: asyncpg.Pool, agents: list[Agent]) -> None:
    """What `reconcile` makes of each pre-built observation against the node's folded state:
    the events the server appends for that report (all observation events here)."""
    from agent.protocol import decode_report
    from collectors.identity import NodeIdentity
    from ledger.reconcile import reconcile
    from projections.inventory import INVENTORY

    async with pool.acquire() as conn:
        for a in agents:
            state = await INVENTORY.load_state(conn, a.node_id)
            for t in a.templates:
                report = decode_report(t)
                payloads = reconcile(report.observation, state, NodeIdentity(a.identity_key, "configured"))
                assert all(type(p).__name__.endswith("TelemetryObserved") for p in payloads), (
                    "a steady report should be telemetry only: "
                    + ", ".join(type(p).__name__ for p in payloads)
                )
                a.payloads.append(payloads)


async def read_versions(pool: asyncpg.Pool, agents: list[Agent]) -> None:
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT stream_id, version FROM streams WHERE stream_id = ANY($1)",
                                [a.node_id for a in agents])  # fmt: skip
    versions = {r["stream_id"]: r["version"] for r in rows}
    for a in agents:
        a.version = versions[a.node_id]


# --- the run ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000, help="simulated agents of 8 GPUs (default 1,000)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per tier per round (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--connections", type=int, default=16, help="concurrent connections / tasks (default 16)")
    p.add_argument("--rate", type=float, default=TARGET_RATE, help="open-loop rate (default 1,000/s)")
    p.add_argument(
        "--sweep",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[8, 32, 64],
        help="also run the http tier at these connection counts (default 8,32,64; '' for none)",
    )
    p.add_argument("--sweep-seconds", type=float, default=5.0, help="seconds per sweep point (default 5)")
    p.add_argument("--variants", type=int, default=3, help="pre-built observations per node (default 3)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 4 s per tier")
    p.add_argument("--no-service", dest="service", action="store_false", help="skip the in-process tier")
    p.add_argument("--no-open-loop", dest="open_loop", action="store_false", help="skip the open loops")
    p.add_argument(
        "--py-spy",
        action="store_true",
        help="sample the server with py-spy during an extra (unrecorded) closed-loop window",
    )
    p.add_argument(
        "--statements",
        action="store_true",
        help="each SQL statement of the in-process ingest path charged its wall time and backend CPU "
        "(an extra, unrecorded window)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the in-process ingest path (an extra, unrecorded window of the service tier)",
    )
    p.add_argument("--keep", action="store_true", help="keep the database and the server log")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.duration, args.sweep_seconds = 1, 4.0, 3.0
    return args


async def run(args: argparse.Namespace) -> int:
    from api.services.agent_plane import EnrollmentService
    from api.services.inventory import HardwareInventoryService
    from ledger.db import create_pool, init_connection, migrate
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    server_url = server_dsn()
    db = bench_database_name("ingest")
    print(f"ModelForge ingest benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {machine_description()}; {await server_description(server_url)}")
    dsn = await create_database(server_url, db)
    workdir = Path(tempfile.mkdtemp(prefix="mf-bench-ingest-"))
    # The in-process tiers log as the server does (structlog at INFO, as `serve` configures it),
    # into a file: unconfigured structlog would print every debug line.
    from ledger.logs import configure_logging

    inprocess_log = open(workdir / "inprocess.log", "w", encoding="utf-8")  # noqa: ASYNC230
    configure_logging(level="INFO", json=True, stream=inprocess_log)
    server: Server | None = None
    pool: asyncpg.Pool | None = None
    monitor: asyncpg.Connection | None = None
    failed = False
    try:
        pool = await create_pool(dsn, min_size=2, max_size=POOL_MAX)
        async with pool.acquire() as conn:
            await migrate(conn)
        store = EventStore(pool, ALL_PROJECTIONS)
        service = EnrollmentService(HardwareInventoryService(store))

        t0 = time.perf_counter()
        credentials = await enroll_all(service, args.nodes, tokens=8)
        rng = random.Random(20261130)
        agents = [build_agent(i, cred, args.variants, rng) for i, cred in credentials]
        print(
            f"setup: {len(agents):,} nodes enrolled (EnrollmentService in-process, a credential each) "
            f"and {len(agents) * args.variants:,} report bodies of {len(agents[0].templates[0]):,} B "
            f"pre-built in {time.perf_counter() - t0:.1f} s (untimed)"
        )

        server = await start_server(dsn, workdir)
        secs, disc = await discover_all(agents, server.port, args.connections)
        if disc.errors:
            raise RuntimeError(f"discovery reports failed: {disc.error_samples}")
        print(
            f"discovery: {disc.reports:,} first reports (inventory stream) through HTTP, "
            f"{disc.events:,} events, {disc.reports / secs:,.0f} reports/s (untimed)"
        )
        async with pool.acquire() as conn:
            await conn.execute("ANALYZE")  # the steady state autovacuum gives a live server
        await ceiling_payloads(pool, agents)
        for a in agents:
            _ = await service.authenticate(a.credential.decode())
        # Warm-up (untimed): the server's and this process's prepared statements and caches.
        await http_closed_loop(agents, server.port, args.connections, 2.0)
        if args.service:
            await service_closed_loop(service, agents, args.connections, 1.0)
        await read_versions(pool, agents)
        await ledger_closed_loop(store, agents, args.connections, 1.0)

        monitor = await asyncpg.connect(server_url)
        meter = Meter(monitor, db, server)
        tiers = {
            "http": Tier("http: POST /agent/reports (closed loop)"),
            "service": Tier("service: accept_report in-process"),
            "ledger": Tier("ceiling: EventStore.append in-process"),
        }
        c = args.connections
        print(
            f"load: {c} connections (closed loop), {args.duration:.0f} s per tier x {args.rounds} "
            f"round(s), interleaved; pools of {POOL_MAX}"
        )
        for _ in range(args.rounds):
            tiers["http"].windows.append(
                await meter.measure(http_closed_loop(agents, server.port, c, args.duration))
            )
            if args.service:
                tiers["service"].windows.append(
                    await meter.measure(service_closed_loop(service, agents, c, args.duration))
                )
            await read_versions(pool, agents)
            tiers["ledger"].windows.append(
                await meter.measure(ledger_closed_loop(store, agents, c, args.duration))
            )

        # Concurrency sweep of the http tier (closed loop, shorter windows): the most it takes.
        sweep: list[tuple[int, Tier]] = []
        for conns in args.sweep:
            t = Tier(f"http, {conns} connections")
            t.windows.append(
                await meter.measure(http_closed_loop(agents, server.port, conns, args.sweep_seconds))
            )
            sweep.append((conns, t))
        best = max([(c, tiers["http"]), *sweep], key=lambda ct: ct[1].rate)

        open_results: list[OpenLoopResult] = []
        if args.open_loop:
            rates = [args.rate]
            capacity = best[1].rate
            if capacity < args.rate:
                rates.append(round(0.5 * capacity))
            for rate in rates:
                open_results.append(
                    await meter.measure(http_open_loop(agents, server.port, rate, args.duration, 4 * c))
                )

        print(
            f"\n  {'tier':<40} {'reports/s':>8} {'events/s':>9} {'p50 ms':>7} {'p99 ms':>7} "
            f"{'errors':>6}   CPU ms/report: {'client':>7} {'server':>7} {'postgres':>8}"
        )
        for key in ("http", "service", "ledger"):
            if tiers[key].windows:
                print(tiers[key].line())
                failed |= any(w.errors for w in tiers[key].windows)
        print(
            "  (client: this process: the load generator for http, the ingest path itself for the\n"
            "   in-process tiers; server: the uvicorn process; postgres: the bench database's backends)"
        )
        for _, t in sweep:
            print(t.line())
        for r in open_results:
            t = Tier(f"http open loop, {r.offered_rate:,.0f}/s offered")
            t.windows.append(r.window)
            print(t.line())
            backlog = r.scheduled - r.window.reports - r.window.errors
            if r.overloaded:
                print(
                    f"    overloaded: stopped after {r.window.seconds:.1f} s with more than "
                    f"{2 * r.offered_rate:,.0f} reports waiting"
                )
            elif backlog:
                print(f"    {backlog} scheduled reports unanswered at the end")
        for key, tier in tiers.items():
            for w in tier.windows:
                for s in w.error_samples:
                    print(f"  error ({key}): {s}")

        http, ledger = tiers["http"], tiers["ledger"]
        print("\nratios (same run, same server)")
        print(f"  http / ledger ceiling (reports/s)       {http.rate / ledger.rate:5.2f}")
        if tiers["service"].windows:
            print(f"  service in-process / ledger ceiling     {tiers['service'].rate / ledger.rate:5.2f}")
            print(f"  http / service in-process               {http.rate / tiers['service'].rate:5.2f}")
        print(f"\ntargets: >= {TARGET_RATE:,.0f} reports/s sustained, p99 < {TARGET_P99_MS:.0f} ms")
        print(f"  capacity (closed loop, best of {c} and the sweep: {best[0]} connections)  "
              f"{best[1].rate:8,.0f} reports/s  {verdict(best[1].rate, TARGET_RATE)}")  # fmt: skip
        at_target = next((r for r in open_results if r.offered_rate == args.rate), None)
        if at_target is not None:
            wt = at_target.window
            sustained = wt.reports / wt.seconds if wt.seconds else 0.0
            t = Tier("")
            t.windows.append(wt)
            ok = not at_target.overloaded and sustained >= 0.99 * args.rate
            print(
                f"  open loop at {args.rate:,.0f}/s: {sustained:8,.0f} reports/s answered  "
                f"{'MET' if ok else 'NOT MET'}; p99 {t.pct(99):,.1f} ms  "
                f"{verdict(t.pct(99), TARGET_P99_MS, at_least=False)}"
            )
        print(
            f"  closed loop p99 {http.pct(99):.1f} ms (at {c} in flight; Little: ~{1e3 * c / max(http.rate, 1e-9):.0f} ms mean)"
        )

        if args.py_spy:
            raw = workdir / "py-spy-server.txt"
            spy = await asyncio.create_subprocess_exec(
                "py-spy", "record", "--nonblocking", "-r", "100", "-f", "raw", "-o", str(raw),
                "-d", str(int(args.duration)), "-p", str(server.proc.pid),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            await asyncio.sleep(0.5)
            w = await http_closed_loop(agents, server.port, c, args.duration)
            _, err = await spy.communicate()
            print(f"\npy-spy of the server ({w.reports / args.duration:,.0f} reports/s while sampled):")
            print(
                summarize_pyspy(str(raw), top=30)
                if raw.exists()
                else f"  py-spy failed: {err.decode()[-500:]}"
            )

        if args.profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            w = await service_closed_loop(service, agents, c, min(args.duration, 5.0))
            prof.disable()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(35)
                print(f"\n--- cProfile of the in-process ingest path ({w.reports:,} reports), by {key} ---")
                print(buf.getvalue())

        if args.statements:
            # Each statement charged its wall time and its backend's CPU (bench/ledger.py's
            # TimedConnection: /proc clock ticks, unbiased over many statements).
            from bench.ledger import STATEMENTS, TimedConnection

            spool = await asyncpg.create_pool(
                dsn, min_size=2, max_size=POOL_MAX, init=init_connection, reset=_no_reset,
                connection_class=TimedConnection,
            )  # fmt: skip
            try:
                sservice = EnrollmentService(HardwareInventoryService(EventStore(spool, ALL_PROJECTIONS)))
                for a in agents:
                    await sservice.authenticate(a.credential.decode())
                await service_closed_loop(sservice, agents, c, 1.0)
                STATEMENTS.by_sql.clear()
                w = await service_closed_loop(sservice, agents, c, min(args.duration, 8.0))
                print(f"\nstatements of the in-process ingest path ({w.reports:,} reports, {c} tasks):")
                STATEMENTS.print(max(1, w.reports))
            finally:
                await spool.close()
        return 1 if failed else 0
    finally:
        if monitor is not None:
            await monitor.close()
        if server is not None:
            server.stop()
        if pool is not None:
            await pool.close()
        inprocess_log.close()
        if args.keep:
            print(f"kept database: {db}; server log: {workdir / 'server.log'}")
        else:
            await drop_database(server_url, db)
            shutil.rmtree(workdir, ignore_errors=True)


async def _no_reset(_conn: asyncpg.Connection) -> None:
    """As ledger.db's pool: no reset query on release."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_serve":
        return serve_main(argv[1:])
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
