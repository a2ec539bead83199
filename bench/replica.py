"""`python -m bench.ingest --replica`: what a hot standby costs agent ingest, in one run.

Four PostgreSQL 15 clusters of this machine's (bench/replication.py): one without a standby, and
three primaries each streaming to a standby through a slot, with `synchronous_commit` = `local`
(asynchronous replication), `on` (a commit waits for the standby's flush) and `remote_apply` (it
waits until the standby has applied it: no accepted report lost on failover, and a read of the
standby sees it). One `modelforge-hw serve` per cluster on its two-host URL, the same simulated
agents enrolled on each, then the closed loop of `bench.ingest` (reports in flight, keep-alive)
in interleaved rounds. Printed: reports/s and p50/p99 per mode, and the ratios remote_apply / no
replica, remote_apply / asynchronous, on / no replica (the aim for `on`: >= 0.7). Every cluster
runs with fsync on, as a production one does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path

from bench import harness as h
from bench import replication
from bench.agents import Load, enroll
from bench.servers import HttpConnection, Process, start_product_server, workdir

MODES = (
    ("no replica", None),
    ("asynchronous standby (synchronous_commit=local)", "local"),
    ("synchronous standby, synchronous_commit=on", "on"),
    ("synchronous standby, synchronous_commit=remote_apply", "remote_apply"),
)
ON_TARGET = 0.7  # the aim for `on` against no replica


class Mode:
    def __init__(self, label: str, dsn: str, server: Process, load: Load) -> None:
        self.label = label
        self.dsn = dsn
        self.server = server
        self.load = load
        self.sample = h.Sample(label)


async def prepare(
    label: str, synchronous: str | None, root: Path, work: Path, args: argparse.Namespace
) -> Mode:
    if synchronous is None:
        node = await asyncio.to_thread(replication.single, root)
        dsn = node.dsn()
    else:
        pair = await asyncio.to_thread(replication.ReplicatedPair.create, root, synchronous=synchronous)
        dsn = pair.dsn()
    name = f"server-{synchronous or 'alone'}"
    server = await start_product_server(dsn, work, name)
    agents = await enroll(server.port, args.nodes, args.variants, 8)
    conns = [await HttpConnection.open(server.port) for _ in range(8)]

    async def discover(c: int) -> None:
        for a in agents[c::8]:
            await a.send(conns[c], "inventory")

    try:
        await asyncio.gather(*(discover(c) for c in range(8)))
    finally:
        for conn in conns:
            conn.close()
    load = Load(agents)
    await load.http("warm-up", [server.port], args.connections, 2.0)
    return Mode(label, dsn, server, load)


def stop_clusters(root: Path) -> None:
    for data in sorted(root.glob("*/*/PG_VERSION")):
        node = replication.Node(data.parent.name, data.parent, 0)
        if node.running():
            with contextlib.suppress(RuntimeError):
                node.stop()


async def run_replica(args: argparse.Namespace) -> int:
    report = h.Report("ingest --replica")
    await h.describe_environment(report, "ingest --replica")
    why = replication.missing()
    if why:
        print(f"cannot run: {why}")
        return 2
    async with contextlib.AsyncExitStack() as stack:
        work = await stack.enter_async_context(workdir("replica", keep=args.keep))
        work.chmod(0o755)
        clusters = work / "clusters"
        stack.callback(stop_clusters, clusters)
        modes: list[Mode] = []
        stack.callback(lambda: [m.server.stop() for m in modes])
        t0 = time.perf_counter()
        for k, (label, synchronous) in enumerate(MODES):
            modes.append(await prepare(label, synchronous, clusters / f"c{k}", work, args))
        print(f"setup: 4 clusters, 4 servers, {args.nodes:,} nodes each in {time.perf_counter() - t0:.0f} s")
        c = args.connections
        for _ in range(args.rounds):
            for m in modes:
                started = time.perf_counter()
                s = await m.load.http(m.label, [m.server.port], c, args.duration)
                m.sample.merge(s, h.Usage(seconds=time.perf_counter() - started))
        samples = [m.sample for m in modes]
        h.table(
            ["mode", "reports/s", "p50 ms", "p99 ms", "errors"],
            [[s.name, s.rate, s.ms(50), s.ms(99), s.errors] for s in samples],
            first_width=56,
        )
        for s in samples:
            report.row(**s.as_row())
        alone, asynchronous, on, remote_apply = samples
        report.ratio(h.Ratio("remote_apply / no replica (reports/s)", remote_apply.rate / alone.rate, None))
        report.ratio(
            h.Ratio("remote_apply / asynchronous (reports/s)", remote_apply.rate / asynchronous.rate, None)
        )
        report.ratio(h.Ratio("on / no replica (reports/s)", on.rate / alone.rate, ON_TARGET))
        report.ratio(h.Ratio("asynchronous / no replica (reports/s)", asynchronous.rate / alone.rate, None))
        report.ratio(h.Ratio("p99 remote_apply / p99 no replica", remote_apply.ms(99) / alone.ms(99), None))
        report.ratio(
            h.Ratio("p99 remote_apply / p99 asynchronous", remote_apply.ms(99) / asynchronous.ms(99), None)
        )
        report.note(
            f"closed loop, {c} reports in flight, {args.rounds} interleaved rounds of {args.duration:g} s per mode; "
            "each mode its own cluster(s) and server on this machine (the standby shares the CPUs)"
        )
        report.finish(args.json)
        return 1 if any(s.errors for s in samples) else 0
