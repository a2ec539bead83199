"""HTTP API benchmark (issue 3): read latency and throughput with 10,000 nodes x 8 accelerators.

    python -m bench.api                    # default: 10,000 nodes, 2 rounds of 10 s per endpoint
    python -m bench.api --quick            # a smoke run (1,000 nodes, 1 round of 4 s)
    python -m bench.api --fill append      # fill through reconcile + EventStore.append instead

What it does, in one run, on a throwaway database (`mf_bench_<random>_api`) of the server named by
MODELFORGE_BENCH_DATABASE_URL (default postgresql://postgres@127.0.0.1:5432/test), dropped at the end:

1. Fill the read models with N nodes x 8 accelerators. Each node is a realistic eight-GPU server
   (H200, H100, A100 with MIG, L40S; Ubuntu; EPYC/Xeon; two mounts; full telemetry) observed once and
   reconciled by the product's `reconcile` into its 19 discovery + telemetry events.
   `--fill fold` (default): the events are folded by the inventory projection's own `fold` and
   `rows` (exactly what `rebuild` does) and the rows are COPYed into the live read-model tables,
   with `projection_state` and `streams`; the event log itself stays empty (the API routes measured
   here read only read models). `--fill append`: the same events go through `EventStore.append`
   (8 concurrent tasks), log included; slower.
   Then VACUUM ANALYZE (the steady state autovacuum gives a real server).
2. Serve, each in its own subprocess with uvicorn on 127.0.0.1 configured as `modelforge-hw serve`
   configures it: the real app (`api.http.app.create_app` around an AppContext made of the pieces the
   tests use: `build_service` with the fake NVML, `HardwareRepository`, an operator token; pool of
   2-10 as `serve`), and the ceiling: a trivial Litestar route (`GET /ping` -> {"status": "ok"}).
3. Walk every page of `GET /api/v1/hardware/accelerators?limit=100` once following `next_cursor`
   (checking every accelerator comes exactly once), then load each endpoint in turn with a
   keep-alive, closed-loop load generator of bounded concurrency (`wrk`, one thread, when on PATH;
   else an httpx client in this process): the ceiling, the accelerator pages (the cursors the walk
   collected, in order, round robin) and `GET /api/v1/hardware/nodes/{id}` (all node ids, shuffled).
   Rounds interleave the endpoints; requests/s add up over rounds, p50 is the median of the rounds',
   p99 the worst round's.

Targets: requests/s >= 0.5 of the ceiling's, p99 < 50 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # `python bench/api.py`: this file would shadow the `api` package; use the repo root.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
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

OPERATOR_TOKEN = "bench-operator-token"
ROOT = Path(__file__).resolve().parent.parent


# --- 1. filling the read models ---------------------------------------------------------------------


def node_events(i: int, rng: random.Random, now: datetime) -> tuple[str, list[Any]]:
    """The NewEvents of node `i`'s first report: discovery plus telemetry, from `reconcile`."""
    from collectors.identity import NodeIdentity
    from ledger.events import EventMetadata, NewEvent
    from ledger.node import NodeState, node_id_for
    from ledger.reconcile import reconcile

    node_id = node_id_for(node_key(i))
    obs = node_observation(i, rng)
    payloads = reconcile(obs, NodeState(node_id=node_id), NodeIdentity(node_key(i), "configured"))
    received = now - timedelta(seconds=rng.uniform(0, 30))
    meta = EventMetadata(
        received_at=received,
        source="agent",
        observed_at=received - timedelta(milliseconds=rng.randint(5, 400)),
        agent_stream=f"agent-{node_id}",
        agent_sequence=1,
    )
    return node_id, [NewEvent(payload=p, metadata=meta) for p in payloads]


async def fill_by_fold(pool: asyncpg.Pool, nodes: int, rng: random.Random) -> int:
    """Fold each node's events with the inventory projection and COPY its rows into the live
    tables (what `rebuild` does into shadows). Returns the number of events folded."""
    from ledger.events import SCHEMA_VERSION, RecordedEvent
    from projections.framework import STATE_TABLE
    from projections.inventory import INVENTORY

    specs = {t.name: t for t in INVENTORY.tables}
    buffers: dict[str, list[tuple[Any, ...]]] = {name: [] for name in specs}
    states: list[tuple[Any, ...]] = []
    streams: list[tuple[Any, ...]] = []
    position = 0
    events_total = 0
    now = datetime.now(UTC)

    async def flush(conn: asyncpg.Connection) -> None:
        for table, rows in buffers.items():
            if rows:
                await conn.copy_records_to_table(table, records=rows, columns=list(specs[table].columns))
                rows.clear()
        if states:
            await conn.copy_records_to_table(
                STATE_TABLE,
                records=states,
                columns=["projection", "stream_id", "stream_version", "position", "state"],
            )
            states.clear()
        if streams:
            await conn.copy_records_to_table(
                "streams", records=streams, columns=["stream_id", "version", "lifecycle_version"]
            )
            streams.clear()

    async with pool.acquire() as conn, conn.transaction():
        for i in range(nodes):
            node_id, new_events = node_events(i, rng, now)
            recorded = []
            lifecycle = 0
            for version, e in enumerate(new_events, start=1):
                position += 1
                lifecycle += e.event_class == "lifecycle"
                recorded.append(
                    RecordedEvent(
                        global_position=position,
                        stream_id=node_id,
                        stream_version=version,
                        event_id=e.event_id,
                        event_type=e.event_type,
                        event_class=e.event_class,
                        schema_version=SCHEMA_VERSION,
                        payload=e.payload,
                        metadata=e.metadata,
                        recorded_at=e.metadata.received_at,
                    )
                )
            state = INVENTORY.fold_all(INVENTORY.initial(node_id), recorded)
            for table, rows in INVENTORY.rows(state).items():
                buffers[table].extend(rows)
            version, pos = INVENTORY.checkpoint_of(state)
            states.append((INVENTORY.name, node_id, version, pos, msgspec.Raw(msgspec.json.encode(state))))
            streams.append((node_id, len(recorded), lifecycle))
            events_total += len(recorded)
            if len(states) >= 500:
                await flush(conn)
        await flush(conn)
    return events_total


async def fill_by_append(pool: asyncpg.Pool, nodes: int, rng: random.Random, tasks: int = 8) -> int:
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    store = EventStore(pool, ALL_PROJECTIONS)
    now = datetime.now(UTC)
    total = 0

    async def worker(t: int) -> None:
        nonlocal total
        for i in range(t, nodes, tasks):
            node_id, events = node_events(i, rng, now)
            await store.append(node_id, 0, events)
            total += len(events)

    await asyncio.gather(*(worker(t) for t in range(tasks)))
    return total


# --- 2. the servers ---------------------------------------------------------------------------------


def real_app(dsn: str, state_dir: str) -> Any:
    """The product's app, with an AppContext built from the same pieces as the tests' `make_api`."""
    from litestar import Litestar

    from api.config import ServerConfig, token_hash
    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.repository import HardwareRepository
    from api.wiring import build_service
    from ledger.db import create_pool

    try:  # the tests' fake NVML, so nothing here ever touches a real driver
        from tests.fakes.fake_pynvml import FakeNvml
        from tests.fixtures_nvml import multi_gpu_scenario

        nvml: Any = FakeNvml(multi_gpu_scenario(8))
    except ImportError:  # pragma: no cover - a checkout without tests/
        nvml = None

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        pool = await create_pool(dsn, min_size=2, max_size=10)  # as `serve` makes it
        try:
            config = ServerConfig(state_dir=Path(state_dir), node_id="bench-api-host", collector_timeout=5.0)
            app.state.ctx = AppContext(
                pool=pool,
                service=build_service(pool, config, nvml=nvml),
                repository=HardwareRepository(pool),
                admin_token_hash=token_hash(OPERATOR_TOKEN),
            )
            yield
        finally:
            await pool.close()

    return create_app(lifespan=lifespan)


def trivial_app(dsn: str | None = None) -> Any:
    """The ceiling: `GET /ping`. With a DSN, also the informative "floor" routes: the repository's
    own SQL through the same pool codecs, rows returned as they come (no auth, no body models)."""
    from litestar import Litestar, get

    from api import repository
    from ledger.db import create_pool

    pools: list[asyncpg.Pool] = []

    @get("/ping")
    async def ping() -> dict[str, str]:
        return {"status": "ok"}

    @get("/floor/accelerators")
    async def floor_accelerators(after: str = "", limit: int = 100) -> list[dict[str, Any]]:
        rows = await pools[0].fetch(
            repository._ACCELERATOR_SELECT
            + " WHERE a.accelerator_id > $1 ORDER BY a.accelerator_id LIMIT $2",
            after,
            limit + 1,
        )
        return [dict(r) for r in rows[:limit]]

    @get("/floor/nodes/{node_id:str}")
    async def floor_node(node_id: str) -> dict[str, Any]:
        row = await pools[0].fetchrow(repository._NODE_SELECT + " WHERE n.node_id = $1", node_id)
        return dict(row) if row else {}

    @contextlib.asynccontextmanager
    async def lifespan(_: Litestar) -> AsyncIterator[None]:
        if dsn:
            pools.append(await create_pool(dsn, min_size=2, max_size=10))
        try:
            yield
        finally:
            for p in pools:
                await p.close()

    handlers = [ping, floor_accelerators, floor_node] if dsn else [ping]
    return Litestar(route_handlers=handlers, lifespan=[lifespan], debug=False)


def serve_main(argv: Sequence[str]) -> int:
    """`python -m bench.api _serve real|trivial PORT [DSN STATE_DIR]`: uvicorn as `serve` runs it."""
    import uvicorn

    kind, port = argv[0], int(argv[1])
    app = real_app(argv[2], argv[3]) if kind == "real" else trivial_app(argv[2] if len(argv) > 2 else None)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="on")
    )
    asyncio.run(server.serve())
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        cpu = cpu_of([self.proc.pid])
        return float("nan") if cpu is None else cpu

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(name: str, args: list[str], workdir: Path) -> Server:
    port = free_port()
    log = workdir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MODELFORGE_LOG_LEVEL": "WARNING"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.api", "_serve", args[0], str(port), *args[1:]],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Server(name, proc, port, log)


async def start_server(name: str, args: list[str], probe: str, workdir: Path) -> Server:
    import httpx

    server = _spawn(name, args, workdir)
    proc, log = server.proc, server.log
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} server exited: {log.read_text()[-2000:]}")
            try:
                r = await client.get(server.base + probe, timeout=2)
                if r.status_code == 200:
                    return server
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    server.stop()
    raise RuntimeError(f"{name} server did not answer {probe} within 60 s: {log.read_text()[-2000:]}")


# --- 3. load ----------------------------------------------------------------------------------------


@dataclass
class Run:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    generator_cpu: float = 0.0
    server_cpu: float = 0.0
    db_cpu: float | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


@dataclass
class Endpoint:
    name: str
    server: Server
    paths: list[str]
    auth: bool
    runs: list[Run] = field(default_factory=list)

    @property
    def rps(self) -> float:
        secs = sum(r.seconds for r in self.runs)
        return sum(r.requests for r in self.runs) / secs if secs else 0.0

    @property
    def p50(self) -> float:
        return statistics.median(r.p50_ms for r in self.runs)

    @property
    def p99(self) -> float:
        return max(r.p99_ms for r in self.runs)

    @property
    def errors(self) -> int:
        return sum(r.errors for r in self.runs)

    def cpu_per_request(self, attr: str) -> str:
        n = sum(r.requests for r in self.runs)
        vals = [getattr(r, attr) for r in self.runs]
        if not n or any(v is None for v in vals):
            return "n/a"
        return f"{1e3 * sum(vals) / n:.2f}"

    @property
    def service_cpu(self) -> float | None:
        """Server process + PostgreSQL CPU seconds per request (what serving one costs)."""
        n = sum(r.requests for r in self.runs)
        if not n or any(r.db_cpu is None for r in self.runs):
            return None
        return sum(r.server_cpu + (r.db_cpu or 0.0) for r in self.runs) / n


WRK_SCRIPT = r"""
local paths = {}
for line in io.lines(os.getenv("BENCH_PATHS")) do paths[#paths + 1] = line end
local token = os.getenv("BENCH_TOKEN")
local headers = {}
if token and #token > 0 then headers["Authorization"] = "Bearer " .. token end
local i = 0
request = function()
  i = i + 1
  return wrk.format("GET", paths[(i - 1) % #paths + 1], headers)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "errors": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


def _child_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


async def run_wrk(ep: Endpoint, seconds: float, connections: int, workdir: Path) -> Run:
    paths_file = workdir / f"paths-{abs(hash(ep.name))}.txt"
    paths_file.write_text("\n".join(ep.paths) + "\n")
    script = workdir / "bench.lua"
    script.write_text(WRK_SCRIPT)
    env = {**os.environ, "BENCH_PATHS": str(paths_file), "BENCH_TOKEN": OPERATOR_TOKEN if ep.auth else ""}
    cpu0 = _child_cpu()
    proc = await asyncio.create_subprocess_exec(
        "wrk", "-t1", f"-c{connections}", f"-d{seconds:.0f}s", "--timeout", "10s", "-s", str(script),
        ep.server.base + ep.paths[0],
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed: {err.decode()[-1000:]}")
    line = [ln for ln in out.decode().splitlines() if ln.startswith("{")][-1]
    d = json.loads(line)
    return Run(
        requests=d["requests"],
        seconds=d["duration_us"] / 1e6,
        p50_ms=d["p50_us"] / 1e3,
        p99_ms=d["p99_us"] / 1e3,
        errors=d["errors"],
        generator_cpu=_child_cpu() - cpu0,
    )


async def run_httpx(ep: Endpoint, seconds: float, connections: int) -> Run:
    """The fallback load generator: `connections` keep-alive workers in this process."""
    import httpx

    headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}"} if ep.auth else {}
    latencies: list[float] = []
    errors = 0
    counter = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    c0 = time.process_time()
    async with httpx.AsyncClient(base_url=ep.server.base, headers=headers, limits=limits) as client:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal errors, counter
            while time.perf_counter() < deadline:
                path = ep.paths[counter % len(ep.paths)]
                counter += 1
                t0 = time.perf_counter()
                try:
                    r = await client.get(path, timeout=10)
                    ok = r.status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.perf_counter() - t0)
                errors += not ok

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.perf_counter() - t0
    latencies.sort()

    def pct(p: float) -> float:
        return 1e3 * latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] if latencies else 0.0

    return Run(len(latencies), elapsed, pct(50), pct(99), errors, generator_cpu=time.process_time() - c0)


async def walk_accelerator_pages(base: str, limit: int) -> tuple[list[str], int, list[float]]:
    """Follow next_cursor from the first page to the last; every accelerator must come once."""
    import httpx

    headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    path = f"/api/v1/hardware/accelerators?limit={limit}"
    paths, seen, latencies = [], set(), []
    async with httpx.AsyncClient(base_url=base, headers=headers) as client:
        while path:
            t0 = time.perf_counter()
            r = await client.get(path, timeout=30)
            latencies.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"GET {path}: {r.status_code} {r.text[:500]}")
            body = r.json()
            ids = [a["id"] for a in body["items"]]
            if seen.intersection(ids):
                raise RuntimeError(f"paging repeated accelerators at {path}")
            seen.update(ids)
            paths.append(path)
            cursor = body.get("next_cursor")
            path = f"/api/v1/hardware/accelerators?limit={limit}&cursor={cursor}" if cursor else ""
    return paths, len(seen), latencies


async def db_cpu(conn: asyncpg.Connection, database: str) -> float | None:
    rows = await conn.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()", database
    )
    return cpu_of([r["pid"] for r in rows])


# --- the run ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000, help="nodes of 8 accelerators (default 10,000)")
    p.add_argument("--fill", choices=("fold", "append"), default="fold", help="how to fill (default fold)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per endpoint per round (default 10)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--connections", type=int, default=8, help="concurrent keep-alive connections (default 8)")
    p.add_argument("--limit", type=int, default=100, help="page size of the accelerator list (default 100)")
    p.add_argument(
        "--generator",
        choices=("auto", "wrk", "httpx"),
        default="auto",
        help="load generator (default: wrk if found)",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 1,000 nodes, 1 round of 4 s")
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the informative floor routes (the repository's SQL without the app around it)",
    )
    p.add_argument(
        "--py-spy",
        action="store_true",
        help="sample the real server with py-spy while each of its endpoints is loaded (diagnostic)",
    )
    p.add_argument("--keep", action="store_true", help="do not drop the database (prints its name)")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.rounds, args.duration = 1000, 1, 4.0
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "httpx"
    return args


async def run(args: argparse.Namespace) -> int:
    import httpx

    from ledger.db import create_pool, migrate

    server = server_dsn()
    db = bench_database_name("api")
    print(f"ModelForge API benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"machine: {machine_description()}; {await server_description(server)}")
    dsn = await create_database(server, db)
    servers: list[Server] = []
    workdir = Path(tempfile.mkdtemp(prefix="mf-bench-api-"))
    monitor: asyncpg.Connection | None = None
    try:
        pool = await create_pool(dsn, min_size=1, max_size=8)
        try:
            async with pool.acquire() as conn:
                await migrate(conn)
            t0 = time.perf_counter()
            rng = random.Random(20261130)
            if args.fill == "fold":
                n_events = await fill_by_fold(pool, args.nodes, rng)
            else:
                n_events = await fill_by_append(pool, args.nodes, rng)
            async with pool.acquire() as conn:
                await conn.execute("VACUUM ANALYZE")
                n_nodes = await conn.fetchval("SELECT count(*) FROM hw_nodes")
                n_accs = await conn.fetchval("SELECT count(*) FROM hw_accelerators")
                node_ids = [r["node_id"] for r in await conn.fetch("SELECT node_id FROM hw_nodes")]
            print(
                f"fill ({args.fill}): {n_nodes:,} nodes, {n_accs:,} accelerators from {n_events:,} events "
                f"in {time.perf_counter() - t0:.1f} s (untimed)"
            )
        finally:
            await pool.close()

        ceiling = await start_server("ceiling", ["trivial", dsn], "/ping", workdir)
        servers.append(ceiling)
        real = await start_server("real", ["real", dsn, str(workdir / "state")], "/api/v1/health", workdir)
        servers.append(real)

        # Correctness before speed: one node by id, and the whole accelerator list by cursor.
        random.Random(1).shuffle(node_ids)
        async with httpx.AsyncClient(base_url=real.base) as client:
            r = await client.get(
                f"/api/v1/hardware/nodes/{node_ids[0]}", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}
            )
            assert r.status_code == 200 and r.json()["id"] == node_ids[0], r.text[:500]
            assert len(r.json()["storage"]) == 2, r.text[:500]
            r = await client.get("/api/v1/hardware/accelerators?limit=1")
            assert r.status_code == 401, "the benchmark must go through the operator guard"
        t0 = time.perf_counter()
        pages, seen, walk = await walk_accelerator_pages(real.base, args.limit)
        walk_s = time.perf_counter() - t0
        assert seen == n_accs, f"paging saw {seen} accelerators of {n_accs}"
        walk.sort()
        print(
            f"cursor walk: {len(pages)} pages of {args.limit}, all {seen:,} accelerators exactly once, "
            f"{walk_s:.1f} s for one client (page p50 {1e3 * walk[len(walk) // 2]:.1f} ms, "
            f"max {1e3 * walk[-1]:.1f} ms)"
        )

        endpoints = [
            Endpoint("ceiling GET /ping", ceiling, ["/ping"], auth=False),
            Endpoint(f"GET accelerators?limit={args.limit} (paged)", real, pages, auth=True),
            Endpoint("GET nodes/{id}", real, [f"/api/v1/hardware/nodes/{n}" for n in node_ids], auth=True),
        ]
        if args.floor:
            from api.services.repository import decode_cursor

            after = [""] + [decode_cursor(p.rsplit("cursor=", 1)[1], 1)[0] for p in pages[1:]]
            endpoints += [
                Endpoint(
                    "floor: same SQL, rows as-is (acc)",
                    ceiling,
                    [f"/floor/accelerators?limit={args.limit}&after={a}" for a in after],
                    auth=False,
                ),
                Endpoint(
                    "floor: same SQL, rows as-is (node)",
                    ceiling,
                    [f"/floor/nodes/{n}" for n in node_ids],
                    auth=False,
                ),
            ]
        print(
            f"load: {args.generator}, {args.connections} keep-alive connections, closed loop, "
            f"{args.duration:.0f} s per endpoint x {args.rounds} round(s), interleaved"
        )
        monitor = await asyncpg.connect(server)
        for _ in range(args.rounds):
            for ep in endpoints:
                s0, d0 = ep.server.cpu_seconds(), await db_cpu(monitor, db)
                spy = None
                if args.py_spy and ep.server is real:
                    raw = workdir / f"py-spy-{len(ep.runs)}-{abs(hash(ep.name))}.txt"
                    spy = await asyncio.create_subprocess_exec(
                        "py-spy", "record", "--nonblocking", "-r", "200", "-f", "raw", "-o", str(raw),
                        "-d", str(int(args.duration)), "-p", str(real.proc.pid),
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                    )  # fmt: skip
                if args.generator == "wrk":
                    result = await run_wrk(ep, args.duration, args.connections, workdir)
                else:
                    result = await run_httpx(ep, args.duration, args.connections)
                d1 = await db_cpu(monitor, db)
                if spy is not None:
                    await spy.wait()
                    print(f"\npy-spy of the real server under {ep.name}:\n{summarize_pyspy(str(raw))}")
                result.server_cpu = ep.server.cpu_seconds() - s0
                result.db_cpu = None if d0 is None or d1 is None else d1 - d0
                ep.runs.append(result)

        base = endpoints[0]
        print(
            f"\n  {'endpoint':<36} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}   "
            f"CPU ms/request: {'server':>6} {'postgres':>8} {'loadgen':>7}"
        )
        for ep in endpoints:
            print(
                f"  {ep.name:<36} {ep.rps:>8,.0f} {ep.p50:>7.1f} {ep.p99:>7.1f} {ep.errors:>6}   "
                f"{'':15} {ep.cpu_per_request('server_cpu'):>6} {ep.cpu_per_request('db_cpu'):>8} "
                f"{ep.cpu_per_request('generator_cpu'):>7}"
            )
        print(
            "\ntargets (same run): requests/s >= 0.5 x ceiling, p99 < 50 ms\n"
            "(CPU-cost ratio: the ceiling's server+PostgreSQL CPU per request over the endpoint's; a\n"
            " cross-check that other load on the machine moves less than requests/s and p99 do)"
        )
        failed = False
        for ep in endpoints[1:3]:
            ratio = ep.rps / base.rps if base.rps else 0.0
            v1, v2 = verdict(ratio, 0.5), verdict(ep.p99, 50.0, at_least=False)
            a, b = ep.service_cpu, base.service_cpu
            cost = f"{b / a:.2f}" if a and b else "n/a"
            print(
                f"  {ep.name:<36} ratio {ratio:5.2f} {v1:<8}  p99 {ep.p99:6.1f} ms {v2:<8} "
                f"(CPU-cost ratio {cost})"
            )
            failed |= ep.errors > 0
        if args.floor:
            print("informative: the product's endpoint over the floor route running the same SQL")
            for ep, floor in ((endpoints[1], endpoints[3]), (endpoints[2], endpoints[4])):
                print(
                    f"  {ep.name:<36} {ep.rps / floor.rps if floor.rps else 0.0:5.2f} of the floor's requests/s"
                )
        gen = sum(r.generator_cpu for r in base.runs)
        srv = sum(r.server_cpu for r in base.runs)
        if gen > 0.5 * srv:
            print(
                f"WARNING: the load generator ({args.generator}) used {gen / max(srv, 1e-9):.1f}x the ceiling "
                "server's CPU: on a small machine it caps the ceiling, so the ratios above are not valid "
                "(install wrk)"
            )
        if args.py_spy:
            print("(--py-spy was on: sampling slowed the real server, and py-spy's CPU counts as loadgen)")
        if failed:
            print("some requests failed: see the errors column (the figures are not valid)")
        return 1 if failed else 0
    finally:
        if monitor is not None:
            await monitor.close()
        for s in servers:
            s.stop()
        if args.keep:
            print(f"kept database: {db}; server logs in {workdir}")
        else:
            await drop_database(server, db)
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_serve":
        return serve_main(argv[1:])
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
