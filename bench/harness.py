"""The one harness every benchmark in bench/ uses: throwaway databases, server processes started
through the product's console script, load loops (closed and open), latency percentiles, CPU
meters (this process, the server processes, the PostgreSQL backends), CPU steal readings, a
wire-level SQL statement counter, `wrk`, ratio verdicts and JSON output.

The benchmarks touch the product only through stable entry points: the `modelforge-hw` console
script (`serve`), HTTP, and the ledger (`ledger.db`, `ledger.store.EventStore`). Nothing here
imports `api`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/test"
OPERATOR_TOKEN = "bench-operator-token"
WRK_MISSING = "wrk is not installed: apt-get update && apt-get install -y wrk (Debian package `wrk`)"
# The log's tables: `events` is partitioned (migration 0004), so its size and dead tuples are
# its leaves', each with its TOAST and indexes.
LOG_PARTITIONS = "SELECT relid FROM pg_partition_tree('events') WHERE isleaf"


# --- command line and output -------------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark has: --quick, --keep, --json."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run (under 2 minutes on 2 cores)")
    p.add_argument("--keep", action="store_true", help="keep the throwaway database(s) and server logs")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    return p


def main(run: Callable[[argparse.Namespace], Awaitable[int]], args: argparse.Namespace) -> int:
    return asyncio.run(run(args))


@dataclass
class Ratio:
    label: str
    value: float
    target: float | None  # None: informative only
    cost_ratio: float | None = None  # the baseline's CPU per unit over ours (a noise cross-check)
    at_least: bool = True

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        ok = self.value >= self.target if self.at_least else self.value < self.target
        return "MET" if ok else "NOT MET"


@dataclass
class Report:
    """What one benchmark run found: rows of figures, ratios with verdicts, notes; printed as
    tables and, with --json, written as one document."""

    bench: str
    started: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    environment: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, **figures: Any) -> None:
        self.rows.append(figures)

    def ratio(self, ratio: Ratio) -> Ratio:
        self.ratios.append(ratio)
        return ratio

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(text)

    def print_ratios(self) -> None:
        print("\nratios and targets (same run, same machine):")
        for r in self.ratios:
            target = "" if r.target is None else f"{'>=' if r.at_least else '<'} {r.target:g}"
            cost = "" if r.cost_ratio is None else f"  (CPU-cost ratio {r.cost_ratio:.2f})"
            print(f"  {r.label:<58} {r.value:>9.2f}  {target:<9} {r.verdict:<8}{cost}")

    def finish(self, path: str | None) -> None:
        self.print_ratios()
        load = os.getloadavg()
        self.environment["load_average_at_end"] = [round(x, 2) for x in load]
        stolen = steal_share(self.environment.get("cpu_ticks_at_start"), read_cpu_ticks())
        self.environment["cpu_steal_share"] = None if stolen is None else round(stolen, 4)
        steal = "" if stolen is None else f"; CPU time stolen by the hypervisor during the run: {stolen:.1%}"
        print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}{steal}")
        if path:
            doc = asdict(self)
            doc["ratios"] = [{**asdict(r), "verdict": r.verdict} for r in self.ratios]
            Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
            print(f"figures written to {path}")


def table(headers: Sequence[str], lines: Sequence[Sequence[Any]], first_width: int = 44) -> None:
    def cell(v: Any) -> str:
        if v is None:
            return "n/a"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    print(f"\n  {headers[0]:<{first_width}}" + "".join(f" {h:>10}" for h in headers[1:]))
    for line in lines:
        print(f"  {cell(line[0]):<{first_width}}" + "".join(f" {cell(v):>10}" for v in line[1:]))


# --- databases ---------------------------------------------------------------------------------------


def server_dsn() -> str:
    return os.environ.get("MODELFORGE_BENCH_DATABASE_URL") or DEFAULT_SERVER


def dsn_for_database(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


@dataclass
class Database:
    name: str
    dsn: str
    server: str


@contextlib.asynccontextmanager
async def throwaway_database(suffix: str, *, keep: bool = False) -> AsyncIterator[Database]:
    """A fresh database `mf_bench_<random>_<suffix>` on the bench server, dropped afterwards."""
    server = server_dsn()
    name = f"mf_bench_{secrets.token_hex(4)}_{suffix}"
    admin = await asyncpg.connect(server)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield Database(name, dsn_for_database(server, name), server)
    finally:
        if keep:
            print(f"kept database: {name}")
        else:
            admin = await asyncpg.connect(server)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await admin.close()


# --- how shared this machine's cores are --------------------------------------------------------------
# Absolute figures (reports/s, CPU ms per report) moved by 2x between VMs sold as alike, and by
# 1.4x between consecutive runs on one of them (docs/performance.md, issue 12, twelfth and
# thirteenth steps). The share of the CPUs' time the hypervisor gave other guests (steal) while a
# run ran says whether its neighbours were busy.


def cpu_ticks(stat: str) -> tuple[int, int]:
    """(steal, all) clock ticks of every CPU from the text of /proc/stat (its first line: user nice
    system idle iowait irq softirq steal; guest time is already counted in user)."""
    fields = [int(v) for v in stat.split("\n", 1)[0].split()[1:9]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def read_cpu_ticks() -> tuple[int, int] | None:
    try:
        return cpu_ticks(Path("/proc/stat").read_text())
    except OSError:  # not Linux
        return None


def steal_share(start: Sequence[int] | None, end: Sequence[int] | None) -> float | None:
    """The share of the CPUs' time stolen by the hypervisor between two `cpu_ticks` readings."""
    if start is None or end is None or end[1] <= start[1]:
        return None
    return (end[0] - start[0]) / (end[1] - start[1])


async def describe_environment(report: Report, title: str) -> None:
    """Print (and record) what the figures depend on: date, machine, load, PostgreSQL settings."""
    conn = await asyncpg.connect(server_dsn())
    try:
        settings = {
            k: await conn.fetchval(f"SHOW {k}")
            for k in ("server_version", "synchronous_commit", "shared_buffers", "autovacuum")
        }
    finally:
        await conn.close()
    load = os.getloadavg()
    report.environment = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "postgresql": settings,
        "load_average_at_start": [round(x, 2) for x in load],
        "cpu_ticks_at_start": read_cpu_ticks(),
    }
    print(f"ModelForge {title} benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"PostgreSQL {settings['server_version']} (synchronous_commit={settings['synchronous_commit']}, "
        f"shared_buffers={settings['shared_buffers']}, autovacuum={settings['autovacuum']}); "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (the machine is shared: rates are noisy, "
        "compare ratios and CPU per unit)"
    )


# --- CPU meters --------------------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_of(pids: Sequence[int]) -> float | None:
    """utime + stime of the processes (and their reaped children: none here), in seconds; None
    when /proc does not have one of them (a remote PostgreSQL)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, IndexError, ValueError):
            return None
    return total


@dataclass
class Usage:
    """What one measured window cost: wall seconds, CPU seconds of this process, of the server
    processes and of the PostgreSQL backends of the measured databases, WAL bytes written
    (server-wide)."""

    seconds: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float | None = 0.0
    db_cpu: float | None = 0.0
    wal_bytes: int = 0

    def __add__(self, o: Usage) -> Usage:
        def add(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a + b

        return Usage(
            self.seconds + o.seconds,
            self.client_cpu + o.client_cpu,
            add(self.server_cpu, o.server_cpu),
            add(self.db_cpu, o.db_cpu),
            self.wal_bytes + o.wal_bytes,
        )


class Meter:
    """Takes CPU and WAL readings around a piece of work. It has its own connection (to the
    server's maintenance database), so no measured backend is left out and its own queries are
    not counted. Backends that exit during a window make the PostgreSQL CPU an underestimate,
    never an overestimate (the product's pools keep their connections)."""

    def __init__(
        self, conn: asyncpg.Connection, databases: Sequence[str], server_pids: Sequence[int]
    ) -> None:
        self.conn = conn
        self.databases = list(databases)
        self.server_pids = list(server_pids)

    @classmethod
    async def open(cls, databases: Sequence[str], server_pids: Sequence[int] = ()) -> Meter:
        return cls(await asyncpg.connect(server_dsn()), databases, server_pids)

    async def close(self) -> None:
        await self.conn.close()

    async def _reading(self) -> tuple[float | None, float | None, int]:
        pids = await self.conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = ANY($1) AND pid <> pg_backend_pid()",
            self.databases,
        )
        wal = await self.conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
        server = cpu_of(self.server_pids) if self.server_pids else 0.0
        return cpu_of([r["pid"] for r in pids]), server, int(wal)

    async def measure(self, work: Awaitable[Any]) -> tuple[Any, Usage]:
        d0, s0, w0 = await self._reading()
        c0, t0 = time.process_time(), time.perf_counter()
        result = await work
        seconds, client = time.perf_counter() - t0, time.process_time() - c0
        d1, s1, w1 = await self._reading()
        return result, Usage(
            seconds,
            client,
            None if s0 is None or s1 is None else s1 - s0,
            None if d0 is None or d1 is None else max(0.0, d1 - d0),
            w1 - w0,
        )


# --- WAL of one database ----------------------------------------------------------------------------
# The WAL position is cluster-wide: on a shared PostgreSQL, whatever else runs writes into the
# same window. pg_walinspect (contrib, PostgreSQL 15+) reads the window's records back; a record
# names the relations it changes (`rel tablespace/database/relfilenode`), and a commit record
# belongs to the database its transaction wrote to.

WAL_OF_DATABASE = r"""
WITH r AS (
    SELECT xid::text AS xid_text, record_length,
           fpi_length, substring(block_ref FROM 'rel \d+/(\d+)/') AS db
    FROM pg_get_wal_records_info($1::text::pg_lsn, $2::text::pg_lsn)
), mine AS (SELECT DISTINCT xid_text FROM r WHERE db = $3 AND xid_text <> '0')
SELECT coalesce(sum(record_length) FILTER (
           WHERE db = $3 OR (db IS NULL AND xid_text IN (SELECT xid_text FROM mine))), 0)::bigint AS database,
       coalesce(sum(fpi_length) FILTER (WHERE db = $3), 0)::bigint AS database_fpi,
       coalesce(sum(record_length), 0)::bigint AS records
FROM r
"""


@dataclass
class WalShare:
    """The WAL a window wrote: `total`, how far the cluster's WAL position moved (page headers
    included); `records`, the bytes of all its records; `database`, those of the measured
    database's records (None: pg_walinspect could not read the window back), `database_fpi` the
    full-page images among them (the first change of a page after a checkpoint)."""

    total: int
    records: int | None = None
    database: int | None = None
    database_fpi: int | None = None

    @property
    def others(self) -> int | None:
        """Bytes of records of other databases (and of none: checkpoints, running transactions)."""
        return None if self.records is None or self.database is None else self.records - self.database


class WalInspector:
    """WAL readings around a window, with the share of one database's records when the server has
    pg_walinspect (created in `dsn`'s database, a throwaway one: it needs a superuser)."""

    def __init__(self, conn: asyncpg.Connection, why_not: str | None) -> None:
        self.conn = conn
        self.why_not = why_not  # None: the records can be read back

    @classmethod
    async def open(cls, dsn: str) -> WalInspector:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except asyncpg.PostgresError as exc:
            return cls(conn, f"pg_walinspect unavailable ({exc}): the WAL is the cluster's")
        return cls(conn, None)

    async def close(self) -> None:
        await self.conn.close()

    async def position(self) -> str:
        return str(await self.conn.fetchval("SELECT pg_current_wal_lsn()::text"))

    async def share(self, start: str, end: str, database: str) -> WalShare:
        total = int(
            await self.conn.fetchval(
                "SELECT pg_wal_lsn_diff($2::text::pg_lsn, $1::text::pg_lsn)::bigint", start, end
            )
        )
        if self.why_not is not None or total <= 0:
            return WalShare(total)
        # Records can be read only up to the flushed position (the walwriter's next round).
        deadline = time.monotonic() + 5
        while not await self.conn.fetchval("SELECT pg_current_wal_flush_lsn() >= $1::text::pg_lsn", end):
            if time.monotonic() > deadline:
                return WalShare(total)
            await asyncio.sleep(0.05)
        oid = await self.conn.fetchval("SELECT oid::text FROM pg_database WHERE datname = $1", database)
        try:
            row = await self.conn.fetchrow(WAL_OF_DATABASE, start, end, oid)
        except asyncpg.PostgresError as exc:  # e.g. the window's segments already recycled
            self.why_not = f"the window's WAL could not be read back ({exc})"
            return WalShare(total)
        return WalShare(total, int(row["records"]), int(row["database"]), int(row["database_fpi"]))


# --- samples and load loops -------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


@dataclass
class Sample:
    """Operations of one or more windows: count, units (events, rows...), errors, latencies (s)."""

    name: str
    ops: int = 0
    units: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])

    def merge(self, other: Sample, usage: Usage) -> None:
        self.ops += other.ops
        self.units += other.units
        self.errors += other.errors
        self.latencies += other.latencies
        self.error_samples += other.error_samples[: 5 - len(self.error_samples)]
        self.usage = self.usage + usage

    @property
    def rate(self) -> float:
        return self.ops / self.usage.seconds if self.usage.seconds else 0.0

    @property
    def unit_rate(self) -> float:
        return self.units / self.usage.seconds if self.usage.seconds else 0.0

    def ms(self, p: float) -> float:
        return 1e3 * percentile(self.latencies, p)

    def per_op(self, attr: str, scale: float = 1e3) -> float | None:
        """CPU (or WAL) per operation; ms for CPU by default."""
        v = getattr(self.usage, attr)
        return None if v is None or not self.ops else scale * v / self.ops

    def cost(self) -> float | None:
        """All CPU (this process + servers + PostgreSQL) per operation, seconds."""
        u = self.usage
        if u.server_cpu is None or u.db_cpu is None or not self.ops:
            return None
        return (u.client_cpu + u.server_cpu + u.db_cpu) / self.ops

    def as_row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ops": self.ops,
            "units": self.units,
            "errors": self.errors,
            "seconds": round(self.usage.seconds, 3),
            "ops_per_s": round(self.rate, 1),
            "units_per_s": round(self.unit_rate, 1),
            "p50_ms": round(self.ms(50), 2),
            "p99_ms": round(self.ms(99), 2),
            "client_cpu_ms_per_op": self.per_op("client_cpu"),
            "server_cpu_ms_per_op": self.per_op("server_cpu"),
            "postgres_cpu_ms_per_op": self.per_op("db_cpu"),
            "wal_bytes_per_op": self.per_op("wal_bytes", 1.0),
        }


def cost_ratio(ours: Sample, baseline: Sample) -> float | None:
    a, b = ours.cost(), baseline.cost()
    return b / a if a and b else None


Step = Callable[[int, int], Awaitable[int]]
"""One operation of a load loop: (worker or slot, k-th operation) -> units done; raises on error."""


async def closed_loop(name: str, workers: int, seconds: float, step: Step) -> Sample:
    """`workers` concurrent workers, each starting its next operation when the last one ends."""
    s = Sample(name)
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        k = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                units = await step(w, k)
            except Exception as exc:
                s.error(repr(exc))
            else:
                s.ops += 1
                s.units += units
            s.latencies.append(time.perf_counter() - t0)
            k += 1

    await asyncio.gather(*(worker(w) for w in range(workers)))
    return s


@dataclass
class OpenLoop:
    sample: Sample
    offered: float
    scheduled: int
    overloaded: bool  # stopped early: more than `max_backlog_s` of operations were waiting
    backlog: list[int]  # operations scheduled but not finished, once per second
    offered_seconds: float  # how long operations were started (shorter when overloaded)
    abandoned: int = 0  # scheduled but never sent: still waiting for a connection when the loop stopped

    @property
    def backlog_grows(self) -> bool:
        """Growing: overloaded, or the waiting operations at the end more than twice those after
        the first second and more than 0.1 s worth (a steady queue is not growth)."""
        if self.overloaded:
            return True
        if len(self.backlog) < 3:
            return False
        return self.backlog[-1] > max(2 * self.backlog[0], 0.1 * self.offered)

    @property
    def keeps_up(self) -> bool:
        answered = self.sample.ops / self.sample.usage.seconds if self.sample.usage.seconds else 0.0
        return not self.backlog_grows and self.sample.errors == 0 and answered >= 0.98 * self.offered


async def open_loop(
    name: str, rate: float, seconds: float, step: Step, *, max_in_flight: int, max_backlog_s: float = 2.0
) -> OpenLoop:
    """Operations started at a fixed rate whatever the answers (at most `max_in_flight` at once:
    the rest wait their turn); latency counts from each operation's scheduled time, so a queue
    cannot hide (no coordinated omission). Stops when more than `max_backlog_s` of operations
    wait."""
    s = Sample(name)
    slots: asyncio.Queue[int] = asyncio.Queue()
    for i in range(max_in_flight):
        slots.put_nowait(i)
    total = int(rate * seconds)
    pending: set[asyncio.Task[None]] = set()
    backlog: list[int] = []

    started: set[int] = set()

    async def one(k: int, due: float) -> None:
        slot = await slots.get()
        started.add(k)
        try:
            units = await step(slot, k)
        except Exception as exc:
            s.error(repr(exc))
        else:
            s.ops += 1
            s.units += units
        finally:
            slots.put_nowait(slot)
        s.latencies.append(time.perf_counter() - due)

    t0 = time.perf_counter() + 0.01
    launched, overloaded, next_probe = 0, False, t0 + 1.0
    while launched < total:
        now = time.perf_counter()
        due = min(total, int((now - t0) * rate) + 1) if now >= t0 else 0
        while launched < due:
            task = asyncio.create_task(one(launched, t0 + launched / rate), name=str(launched))
            pending.add(task)
            task.add_done_callback(pending.discard)
            launched += 1
        if now >= next_probe:
            backlog.append(len(pending))
            next_probe += 1.0
        if len(pending) > max_backlog_s * rate:
            overloaded = True
            break
        await asyncio.sleep(0.001)
    offered_seconds = time.perf_counter() - t0
    # Operations still waiting for a slot are abandoned (never sent); those sent get 10 s.
    waiting = [t for t in pending if int(t.get_name()) not in started]
    for t in waiting:
        t.cancel()
    abandoned = len(waiting)
    sent = [t for t in pending if int(t.get_name()) in started]
    if sent:
        _, late = await asyncio.wait(sent, timeout=10)
        for t in late:
            t.cancel()
            s.error("sent but unanswered 10 s after the last scheduled start")
    s.usage.seconds = time.perf_counter() - t0
    return OpenLoop(s, rate, launched, overloaded, backlog, offered_seconds, abandoned)


# --- HTTP --------------------------------------------------------------------------------------------


class HttpConnection:
    """A minimal keep-alive HTTP/1.1 client: requests pre-encoded, responses with Content-Length
    (what uvicorn sends) or chunked (a streamed one: /metrics). ~0.1 ms of CPU per request, a
    fraction of httpx's, so the load generator does not take the server's CPU on a small machine."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> HttpConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def request(
        self, method: bytes, path: bytes, headers: bytes = b"", body: bytes = b""
    ) -> tuple[int, bytes]:
        self.writer.write(
            b"%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%sContent-Length: %d\r\n\r\n%s"
            % (method, path, headers, len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        i = head.lower().find(b"\r\ncontent-length:")
        if i >= 0:
            n = int(head[i + 17 : head.index(b"\r\n", i + 2)])
            return status, await self.reader.readexactly(n)
        if b"\r\ntransfer-encoding: chunked\r\n" not in head.lower():
            raise ValueError(f"response without Content-Length or chunks: {head[:200]!r}")
        parts = []
        while n := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await self.reader.readexactly(n))
            await self.reader.readexactly(2)
        await self.reader.readuntil(b"\r\n")  # the last chunk's line end (no trailers)
        return status, b"".join(parts)

    def close(self) -> None:
        self.writer.close()


def bearer(token: str) -> bytes:
    return b"Authorization: Bearer %s\r\n" % token.encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def console_script(tree: Path = ROOT) -> list[str]:
    """The `modelforge-hw` entry point: for this checkout, the script installed next to this Python
    (else the entry-point object itself); for another checkout (`tree`, a baseline to compare
    with), the function its pyproject.toml names, imported from that tree by this Python."""
    if tree.resolve() != ROOT.resolve():
        import tomllib

        target = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["modelforge-hw"]
        module, func = target.split(":")
        code = f"import sys; sys.path.insert(0, {str(tree)!r}); import {module} as m; sys.exit(m.{func}())"
        return [sys.executable, "-c", code]
    script = Path(sys.executable).parent / "modelforge-hw"
    if script.exists():
        return [str(script)]
    found = shutil.which("modelforge-hw")
    if found:
        return [found]
    return [
        sys.executable,
        "-c",
        "import sys; from importlib.metadata import entry_points; "
        "sys.exit(entry_points(group='console_scripts')['modelforge-hw'].load()())",
    ]


async def spawn(
    name: str, argv: list[str], port: int, probe: str, workdir: Path, env: dict[str, str], tree: Path = ROOT
) -> Process:
    """A server subprocess (its output into `<workdir>/<name>.log`), ready when `probe` answers 200."""
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:  # noqa: ASYNC230 - before the loop has work
        proc = subprocess.Popen(  # noqa: ASYNC220
            argv,
            cwd=tree,
            env={**os.environ, "PYTHONPATH": str(tree), **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    p = Process(name, proc, port, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, ValueError):
            conn = await HttpConnection.open(port)
            try:
                status, _ = await conn.request(b"GET", probe.encode())
            finally:
                conn.close()
            if status == 200:
                return p
        await asyncio.sleep(0.2)
    p.stop()
    raise RuntimeError(f"{name} did not answer {probe} within 90 s: {log.read_text()[-2000:]}")


async def start_product_server(
    dsn: str,
    workdir: Path,
    name: str = "server",
    *,
    log_level: str = "INFO",
    retention: bool = True,
    tree: Path = ROOT,
    settings: dict[str, str] | None = None,
) -> Process:
    """`modelforge-hw serve` on a free port of 127.0.0.1, on `dsn`, with a known operator token,
    exactly as an operator starts it (migrations, pools, the retention loop; `settings`: more
    MODELFORGE_* variables); from this checkout, or from another one (`tree`) to compare with."""
    port = free_port()
    env = {
        "MODELFORGE_DATABASE_URL": dsn,
        "MODELFORGE_ADMIN_TOKEN": OPERATOR_TOKEN,
        "MODELFORGE_STATE_DIR": str(workdir / f"state-{name}"),
        "MODELFORGE_NODE_ID": f"bench-{name}",
        "MODELFORGE_LOG_LEVEL": log_level,
        "MODELFORGE_LOG_JSON": "1",
    }
    if not retention:
        env["MODELFORGE_RETENTION_INTERVAL"] = "0"
    env.update(settings or {})
    argv = [*console_script(tree), "serve", "--host", "127.0.0.1", "--port", str(port)]
    return await spawn(name, argv, port, "/api/v1/health", workdir, env, tree)


@contextlib.asynccontextmanager
async def workdir(prefix: str, *, keep: bool) -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=f"mf-bench-{prefix}-"))
    try:
        yield path
    finally:
        if keep:
            print(f"kept server logs in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


# --- wrk ---------------------------------------------------------------------------------------------

_WRK_SCRIPT = r"""
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


def require_wrk() -> str:
    found = shutil.which("wrk")
    if not found:
        raise SystemExit(WRK_MISSING)
    return found


@dataclass
class WrkRun:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    generator_cpu: float


async def run_wrk(
    base: str, paths: Sequence[str], seconds: float, connections: int, token: str, work: Path
) -> WrkRun:
    """wrk, one thread, `connections` keep-alive connections, closed loop, over `paths` round robin
    (non-2xx answers count as errors)."""
    wrk = require_wrk()
    paths_file = work / f"paths-{secrets.token_hex(4)}.txt"
    paths_file.write_text("\n".join(paths) + "\n")
    script = work / "bench.lua"
    script.write_text(_WRK_SCRIPT)
    before = os.times()
    proc = await asyncio.create_subprocess_exec(
        wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
        "-s", str(script), base + paths[0],
        env={**os.environ, "BENCH_PATHS": str(paths_file), "BENCH_TOKEN": token},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    after = os.times()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed: {err.decode()[-1000:]}")
    d = json.loads([ln for ln in out.decode().splitlines() if ln.startswith("{")][-1])
    return WrkRun(
        d["requests"],
        d["duration_us"] / 1e6,
        d["p50_us"] / 1e3,
        d["p99_us"] / 1e3,
        d["errors"],
        (after.children_user + after.children_system) - (before.children_user + before.children_system),
    )


# --- counting SQL statements on the wire ------------------------------------------------------------


@dataclass
class Statements:
    """Frontend messages seen by the counting proxy. `executions`: Execute messages plus simple
    Query messages (an `executemany` of 8 rows is 8 executions); `round_trips`: Sync messages
    plus simple queries (the times a client waits for PostgreSQL); `transactions`: COMMITs, plus
    statements run outside BEGIN (each its own implicit transaction, ended by its Sync)."""

    executions: int = 0
    round_trips: int = 0
    transactions: int = 0

    def __sub__(self, o: Statements) -> Statements:
        return Statements(
            self.executions - o.executions,
            self.round_trips - o.round_trips,
            self.transactions - o.transactions,
        )

    def copy(self) -> Statements:
        return Statements(self.executions, self.round_trips, self.transactions)


class StatementCounter:
    """A TCP proxy in front of PostgreSQL that parses the frontend side of the wire protocol and
    counts statements. pg_stat_statements would be the usual tool, but it must be preloaded at
    server start, which a shared PostgreSQL cannot be asked to do; counting on the wire is exact
    for every client that talks through the proxy, whatever the server's settings. It costs this
    process CPU and adds a hop, so it is used only in windows whose timings are not reported."""

    _SSL_REQUEST = 80877103
    _GSS_REQUEST = 80877104

    def __init__(self, target: str) -> None:
        u = urlsplit(target)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 5432
        # An embedded server (pgserver) is reached on a Unix socket named in the `host` parameter.
        socket_dir = dict(parse_qsl(u.query)).get("host", "")
        self.unix_socket = f"{socket_dir}/.s.PGSQL.{self.port}" if socket_dir.startswith("/") else None
        self.target = target
        self.counts = Statements()
        self.server: asyncio.base_events.Server | None = None
        self.listen_port = 0

    async def __aenter__(self) -> StatementCounter:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.listen_port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    @property
    def dsn(self) -> str:
        """The target's DSN through this proxy (no TLS: the proxy must read the messages)."""
        u = urlsplit(self.target)
        auth = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
        query = dict(parse_qsl(u.query))
        query.pop("host", None)
        query["sslmode"] = "disable"
        return urlunsplit((u.scheme, f"{auth}127.0.0.1:{self.listen_port}", u.path, urlencode(query), ""))

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.unix_socket is not None:
            up_reader, up_writer = await asyncio.open_unix_connection(self.unix_socket)
        else:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)

        async def downstream() -> None:
            with contextlib.suppress(Exception):
                while data := await up_reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        down = asyncio.create_task(downstream())
        try:
            # Untyped startup messages first (SSLRequest, GSSENCRequest, then StartupMessage).
            while True:
                head = await reader.readexactly(8)
                length, code = struct.unpack("!ii", head)
                rest = await reader.readexactly(length - 8)
                up_writer.write(head + rest)
                if code not in (self._SSL_REQUEST, self._GSS_REQUEST):
                    break
            in_block, implicit = False, False
            while True:
                head = await reader.readexactly(5)
                kind, length = head[:1], struct.unpack("!i", head[1:])[0]
                body = await reader.readexactly(length - 4)
                if kind == b"E":
                    self.counts.executions += 1
                    implicit = implicit or not in_block
                elif kind == b"S":
                    self.counts.round_trips += 1
                    self.counts.transactions += implicit
                    implicit = False
                elif kind == b"Q":
                    self.counts.executions += 1
                    self.counts.round_trips += 1
                    verb = body[:8].upper()
                    if verb.startswith((b"BEGIN", b"START")):
                        in_block = True
                    elif verb.startswith((b"COMMIT", b"ROLLBACK", b"END")):
                        in_block = False
                        self.counts.transactions += verb.startswith((b"COMMIT", b"END"))
                    elif not in_block:
                        self.counts.transactions += 1
                up_writer.write(head + body)
                await up_writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            up_writer.close()
            await asyncio.wait({down}, timeout=2)
            writer.close()
