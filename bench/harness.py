"""What every benchmark in bench/ measures with and reports through: throwaway databases, load
loops (closed and open), latency percentiles, CPU meters (this process, the server processes, the
PostgreSQL backends), CPU steal readings, ratio verdicts and JSON output. The product's server
processes and the HTTP client are in bench/servers.py, the WAL of one database in bench/wal.py,
the statement counter in bench/statements.py, `wrk` in bench/wrk.py.

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
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/test"
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


def parse_sized(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, quick: Mapping[str, object]
) -> argparse.Namespace:
    """`p`'s options from `argv`; with --quick, `quick`'s sizes are the defaults, so that a size
    given on the command line stands (`--quick --rounds 4`: four rounds of a quick run)."""
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    return args


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
# 1.4x between consecutive runs on one of them (docs/performance.md: the runs on a VM half as
# fast, and the levers outside the code). The share of the CPUs' time the hypervisor gave other
# guests (steal) while a run ran says whether its neighbours were busy.


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
