"""Failover by pg_auto_failover, with real processes: a monitor and two PostgreSQL 15 nodes, each
under its own `pg_autoctl run` (tests/auto_failover_support.py), `modelforge-hw serve` on the URL
`pg_autoctl show uri` prints (both nodes, `target_session_attrs=read-write`) and three agents
reporting through it. The primary host dies: its PostgreSQL and its pg_autoctl keeper are killed
with -9. Nothing in the test promotes anything: the monitor notices and promotes the secondary.

Asserted, as in tests/test_failover.py: every report accepted before the kill and every report
spooled during the outage stored exactly once, no sequence gap, never an HTTP 500 (503 +
Retry-After during the switch), the same server process serving again within RECOVERY_BOUND
seconds of the kill, a cursor taken on the old primary resumed on the new one, `verify` and
`rebuild --verify` clean.

Then fencing, the returning old primary never taking a write:
* its keeper started while the monitor is unreachable never starts PostgreSQL;
* its keeper started with the monitor up is told it was demoted: PostgreSQL runs crash recovery
  without listening, pg_rewind, and comes back a standby; a probe polling its port all the while
  never finds it writable, and the monitor shows it `secondary`;
* with it back first in the URL and accepting connections, the URL's
  `target_session_attrs=read-write` still lands on the new primary: a fresh server process on
  that URL takes writes, and a plain connection names the new primary's port.
Finally the re-joined node's gap-safe read of the log and its `replay` equal the new primary's.

The Debian packages are installed with apt-get when missing (the test fails, never skips, when
that is impossible). `pytest -s` prints the figures.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from ledger.reading import Checkpoint
from tests import auto_failover_support as paf
from tests import debian
from tests.agent_support import AgentProcess, ServerProcess, create_token, wait_for
from tests.failover_support import (
    Ledger,
    Watch,
    assert_cursor_resumes,
    assert_same_replay,
    assert_verify_clean,
    exactly_once,
    postgres_programs,
    read_from,
    serve_with_agents,
    stop_agents,
    stored,
    workdir,
)
from tests.test_faults import more_reports, snapshot

__all__ = ["postgres_programs", "workdir"]  # the fixtures, used by name

# Seconds from the kill until the server answers 200 again. The monitor's part, with the
# formation's settings (auto_failover_support.MONITOR_SETTINGS): about 2 s to find the primary
# unhealthy, 3 s given to it to demote itself, then the promotion.
RECOVERY_BOUND = 60.0
# Seconds a keeper that cannot reach its monitor is watched for a PostgreSQL of its own.
WITHOUT_MONITOR = 6.0


@pytest.fixture(scope="module")
def auto_failover_programs(postgres_programs: None) -> None:
    if paf.missing():
        for package in paf.PACKAGES:
            problem = debian.install(package)
            assert not problem, problem
    why = paf.missing()
    assert not why, why


@pytest.fixture
def formation(auto_failover_programs: None, workdir: Path) -> Iterator[paf.Formation]:
    made = paf.Formation.create(workdir / "paf")
    try:
        yield made
    finally:
        made.close()


class Probe:
    """Connects to one node every 50 ms and keeps what it was: (in recovery, read only), or
    nothing when it refused or was not ready."""

    def __init__(self, port: int) -> None:
        self.dsn = f"postgresql://postgres@127.0.0.1:{port}/{paf.DATABASE}"
        self.answers: list[tuple[bool, bool]] = []
        self.refused = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            try:
                conn = await asyncpg.connect(self.dsn, timeout=1)
                try:
                    row = await conn.fetchrow(
                        "SELECT pg_is_in_recovery() AS standby, "
                        "current_setting('transaction_read_only') = 'on' AS read_only"
                    )
                finally:
                    await conn.close()
                assert row is not None
                self.answers.append((row["standby"], row["read_only"]))
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                self.refused += 1
            await asyncio.sleep(0.05)

    def start(self) -> Probe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    def writable(self) -> list[tuple[bool, bool]]:
        return [a for a in self.answers if not a[0] and not a[1]]


async def caught_up(primary: paf.Keeper, standby: paf.Keeper, within: float = 60) -> None:
    conn = await asyncpg.connect(primary.dsn(), timeout=5)
    try:
        target = await conn.fetchval("SELECT pg_current_wal_lsn()::text")
    finally:
        await conn.close()

    async def replayed() -> bool:
        conn = await asyncpg.connect(standby.dsn(), timeout=5)
        try:
            return bool(await conn.fetchval("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", target))
        finally:
            await conn.close()

    await wait_for(replayed, within, f"the standby replaying up to {target}")


async def test_the_monitor_promotes_the_standby_nothing_lost_and_the_old_primary_returns_fenced(
    formation: paf.Formation, workdir: Path
) -> None:
    started = time.monotonic()
    old, new = formation.keeper("node1"), formation.keeper("node2")
    dsn = formation.uri()
    assert dsn == (
        f"postgresql://postgres@127.0.0.1:{old.port},127.0.0.1:{new.port}/{paf.DATABASE}"
        "?target_session_attrs=read-write&sslmode=prefer"
    )
    tag = uuid.uuid4().hex[:6]
    server = ServerProcess(dsn, workdir, stale_after=30, offline_after=120)
    agents = [AgentProcess(workdir, f"autofail-{tag}-{i}") for i in range(3)]
    db = Ledger(dsn)
    watch = Watch(server.url)
    http = httpx.AsyncClient(timeout=10)
    second: ServerProcess | None = None
    try:
        await serve_with_agents(http, server, agents)
        watch.start()
        await more_reports(db, agents, {}, 30)  # type: ignore[arg-type]

        # Mid-load: what the primary holds, a reader's cursor on it, then its host dies.
        before_kill = await stored(db, agents)
        read_before, cursor = await read_from(dsn, Checkpoint())
        loaded = time.monotonic()
        await asyncio.to_thread(old.kill)
        killed_at = time.monotonic()
        spooled_in_outage = 0

        async def serving() -> bool:
            nonlocal spooled_in_outage
            spooled_in_outage = max(spooled_in_outage, sum(a.spooled() for a in agents))
            r = await http.get(server.url + "/api/v1/health")
            return r.status_code == 200

        await wait_for(serving, RECOVERY_BOUND, "the server serving from the standby the monitor promoted")
        recovery = time.monotonic() - killed_at
        assert server.proc is not None and server.proc.poll() is None, "the server exited"
        # The monitor's doing: it assigned the promotion (the keeper may not have reported it yet).
        states = formation.states()
        assert states["node2"][1] in ("wait_primary", "primary") and states["node1"][1] == "demoted", states
        await more_reports(db, agents, await snapshot(db, agents), 30)  # type: ignore[arg-type]

        # Fencing without the monitor: the old primary's keeper, unable to learn that it was
        # demoted, does not start PostgreSQL at all.
        await asyncio.to_thread(formation.monitor.stop)
        probe = Probe(old.port).start()
        old.start()
        gave_up = await asyncio.to_thread(old.exited, WITHOUT_MONITOR)
        await asyncio.to_thread(old.stop)
        await probe.stop()
        assert probe.answers == [], f"the old primary served without its monitor: {probe.answers}"
        assert not old.postgres_running(), old.log_text()[-3000:]
        formation.monitor.start()

        # Fencing by the monitor: the keeper is told it was demoted and re-joins as a standby.
        probe = Probe(old.port).start()
        returned_at = time.monotonic()
        old.start()
        await asyncio.to_thread(formation.wait_states, {"node1": "secondary", "node2": "primary"}, 120)
        rejoin = time.monotonic() - returned_at

        async def answered() -> bool:
            return bool(probe.answers)

        await wait_for(answered, 10, "the standby answering the probe")
        await probe.stop()
        assert not probe.writable(), f"the old primary answered read-write: {probe.writable()}"
        assert all(a == (True, True) for a in probe.answers), probe.answers

        # The old primary now accepts connections and comes first in the URL; the URL's
        # target_session_attrs=read-write passes it by. A fresh server (its first connection
        # tries the hosts in the URL's order) takes a write.
        conn = await asyncpg.connect(dsn.replace("read-write", "any"), timeout=5)
        assert await conn.fetchval("SELECT inet_server_port()") == old.port
        await conn.close()
        conn = await asyncpg.connect(dsn, timeout=5)
        assert await conn.fetchval("SELECT inet_server_port()") == new.port
        await conn.close()
        second = ServerProcess(dsn, workdir / "second", stale_after=30, offline_after=120)
        second.start()
        await second.wait_healthy(within=60)
        await create_token(http, second.url, uses=1)  # a write; it answers 201 or fails here
        await more_reports(db, agents, await snapshot(db, agents), 30)  # type: ignore[arg-type]

        async def drained() -> bool:
            return all(a.spooled() <= 1 for a in agents)

        await wait_for(drained, 30, "every spool drained (one report may be in flight)")
        await watch.stop()
    finally:
        stop_agents(agents)
        await http.aclose()
        if second is not None:
            assert second.stop() == 0, second.log_text()[-3000:]

    try:
        checked = time.monotonic()
        figures = await exactly_once(db, agents, before_kill, server.log_text())
        assert second is not None and "Traceback" not in second.log_text(), second.log_text()[-3000:]
        watch.assert_no_500_and_the_outage_seen()
        await assert_cursor_resumes(dsn, read_before, cursor)
        await assert_verify_clean(dsn)
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]
    await caught_up(new, old)
    await assert_same_replay(new.dsn(), old.dsn())
    print(
        f"\nauto failover: server and agents loaded {loaded - started:.1f}s after the formation was up; "
        f"kill -9 to serving {recovery:.2f}s (bound {RECOVERY_BOUND}s); without its monitor the old "
        f"primary's keeper {'gave up' if gave_up else 'waited'} and never served; with it, back as a "
        f"standby {rejoin:.2f}s after its keeper started ({len(probe.answers)} probe answers, all "
        f"read-only); spooled during the outage {spooled_in_outage}; answers "
        f"{sorted(watch.statuses.items())}; reports sent={figures['sent']} accepted={figures['accepted']} "
        f"still spooled={figures['spooled']} lost={figures['lost']} duplicated={figures['duplicated']} "
        f"sequence gaps={figures['gaps']}; checks {time.monotonic() - checked:.1f}s; "
        f"{time.monotonic() - started:.1f}s in all"
    )
