"""The benchmarks stay runnable (their timed runs are not tests: bench/ prints ratios, never
asserts a timing), and the harness's statement counter counts what PostgreSQL is really sent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from bench.harness import OpenLoop, Sample, cpu_ticks, steal_share
from bench.statements import StatementCounter
from bench.wal import WalInspector

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("bench", ["ingest", "ledger", "api", "replay", "history", "health_backtest"])
def test_each_benchmark_imports_and_explains_itself(bench: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{bench}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout and "--json" in done.stdout


async def test_the_bare_scans_decode_a_log_of_compact_and_jsonb_observations(pool: asyncpg.Pool) -> None:
    """bench.ledger's and bench.replay's ceilings read every event as the rebuild does: a snapshot
    stored compact has no jsonb to decode, and a scan reading only `data` fails on it."""
    from bench.ledger import bare_scan
    from bench.replay import scan
    from tests.telemetry_support import seed

    await seed(pool, "node-scan", "acc-scan", "GPU-00000000-0000-4000-8000-000000000001")
    async with pool.acquire() as conn:
        compact, total = await conn.fetchrow("SELECT count(body), count(*) FROM events")
        assert compact > 0 and compact < total
        assert await bare_scan(pool) == total
        assert await scan(conn, None, None) == total


async def test_statement_counter_counts_statements_round_trips_and_transactions(database_dsn: str) -> None:
    async with StatementCounter(database_dsn) as counter:
        conn = await asyncpg.connect(counter.dsn)
        try:
            await conn.fetchval("SELECT 1")  # prepared: Parse, Describe, Sync, then Bind, Execute, Sync
            before = counter.counts.copy()
            await conn.fetchval("SELECT $1::int", 2)
            one = counter.counts - before
            await conn.execute("CREATE TABLE t (x int)")
            before = counter.counts.copy()
            async with conn.transaction():
                await conn.executemany("INSERT INTO t VALUES ($1)", [(1,), (2,), (3,)])
                await conn.fetchval("SELECT count(*) FROM t")
            block = counter.counts - before
        finally:
            await conn.close()
    assert one.executions == 1 and one.transactions == 1
    # BEGIN, three rows of one executemany, the count, COMMIT: six executions, one transaction.
    assert block.executions == 6, block
    assert block.transactions == 1, block
    assert block.round_trips < block.executions  # the executemany's rows share one round trip


async def test_wal_of_one_database_is_told_from_the_clusters(database_dsn: str, empty_database: str) -> None:
    # The WAL position is the cluster's: another database writing in the same window must not
    # count as the measured database's WAL.
    measured, other = await asyncpg.connect(database_dsn), await asyncpg.connect(empty_database)
    wal = await WalInspector.open(empty_database)
    try:
        assert wal.why_not is None, wal.why_not
        for conn in (measured, other):
            await conn.execute("CREATE TABLE filler (x int, pad text)")
        start = await wal.position()
        for i in range(100):
            await measured.execute("INSERT INTO filler VALUES ($1, repeat('m', 1000))", i)
            await other.execute(
                "INSERT INTO filler VALUES ($1, repeat('o', 1000)), ($1, repeat('o', 1000))", i
            )
        end = await wal.position()
        name = await measured.fetchval("SELECT current_database()")
        share = await wal.share(start, end, name)
    finally:
        await wal.close()
        await measured.close()
        await other.close()
    assert share.database is not None and share.others is not None and share.records is not None
    # 100 rows of ~1 KB and their commits; the other database's 200 rows are someone else's.
    assert 100_000 < share.database < 150_000, share
    assert share.others > 200_000 and share.total >= share.records > share.database, share


def test_open_loop_backlog_growth_is_told_from_a_steady_queue() -> None:
    steady = OpenLoop(Sample("s", ops=1000), 100.0, 1000, False, [3, 5, 4, 6, 5], 5.0)
    growing = OpenLoop(Sample("g", ops=500), 100.0, 1000, False, [3, 20, 45, 80, 120], 5.0)
    assert not steady.backlog_grows and growing.backlog_grows
    assert OpenLoop(Sample("o"), 100.0, 300, True, [50, 150], 2.0).backlog_grows


def test_steal_is_read_from_the_eighth_figure_of_proc_stat() -> None:
    # Two readings of /proc/stat's first line: 40 of the 400 ticks between them were stolen.
    start = cpu_ticks("cpu  1000 0 200 5000 10 0 5 100 0 0\ncpu0 500 0 100 2500 5 0 2 50 0 0\n")
    end = cpu_ticks("cpu  1200 0 250 5100 10 0 15 140 0 0\ncpu0 600 0 125 2550 5 0 7 70 0 0\n")
    assert start == (100, 6315) and end == (140, 6715)
    assert steal_share(start, end) == 40 / 400
    assert steal_share(None, end) is None and steal_share(end, end) is None


def test_quick_sizes_a_run_but_a_size_given_stands() -> None:
    from bench import api, history, ingest, ledger

    quick = ingest.parse_args(["--quick"])
    assert (quick.nodes, quick.rounds, quick.duration, quick.open_seconds, quick.count) == (
        500,
        2,
        3.0,
        15.0,
        200,
    )
    full = ingest.parse_args([])
    assert (full.nodes, full.rounds, full.duration, full.open_seconds, full.count) == (
        1000,
        2,
        10.0,
        60.0,
        400,
    )
    given = ingest.parse_args(["--quick", "--rounds", "4", "--nodes", "300"])
    assert (given.rounds, given.nodes, given.duration) == (4, 300, 3.0)
    assert (api.parse_args(["--quick", "--rounds", "5"]).rounds, api.parse_args(["--quick"]).rounds) == (5, 2)
    assert ledger.parse_args(["--quick", "--events", "20000"]).events == 20_000
    assert history.parse_args(["--quick"]).requests == 20
