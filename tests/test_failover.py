"""Failover with real processes: a PostgreSQL 15 primary streaming to a hot standby (a replication
slot, `synchronous_commit = remote_apply`), `modelforge-hw serve` on the two-host URL
(`target_session_attrs=read-write`) and three agents (fake NVML) reporting through it. The
primary is killed with -9 mid-load and the standby promoted (`pg_ctl promote`); the same server
process, never restarted, reconnects to the new primary.

Asserted: every report accepted before the kill and every report spooled during the outage is
stored exactly once, no sequence gap; the server answered 503 problem+json with Retry-After
during the switch and never 500; it served again within RECOVERY_BOUND seconds of the promotion;
`verify` and `rebuild --verify` are clean; commit-order positions after the promotion all come
after those before it; and once the old primary has re-joined as a standby (`pg_rewind`), the
gap-safe read of the whole log on it equals the one on the promoted primary.

PostgreSQL 15's server programs are installed with apt-get when missing (the test fails, never
skips, when that is impossible). `pytest -s` prints the figures.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from pathlib import Path

import httpx

from bench import replication
from ledger.db import HostRotation, hosts_rotated
from ledger.reading import Checkpoint
from tests.agent_support import AgentProcess, ServerProcess, wait_for
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

# Seconds from `pg_ctl promote` returning until the server answers 200 again (its pool's next
# connection finds the new primary; nothing waits for a timer).
RECOVERY_BOUND = 15.0
OUTAGE_SECONDS = 1.5  # the primary is down this long before the promotion: reports spool


async def test_kill_the_primary_promote_the_standby_nothing_lost_nothing_twice(
    postgres_programs: None, workdir: Path
) -> None:
    started = time.monotonic()
    pair = await asyncio.to_thread(
        replication.ReplicatedPair.create, workdir / "pg", synchronous="remote_apply", fsync=False
    )
    tag = uuid.uuid4().hex[:6]
    server = ServerProcess(pair.dsn(), workdir, stale_after=30, offline_after=120)
    agents = [AgentProcess(workdir, f"failover-{tag}-{i}") for i in range(3)]
    db = Ledger(pair.dsn())
    watch = Watch(server.url)
    http = httpx.AsyncClient(timeout=10)
    try:
        await serve_with_agents(http, server, agents)
        watch.start()
        await more_reports(db, agents, {}, 30)  # type: ignore[arg-type]

        # Mid-load: what the primary holds, then kill -9 of its postmaster.
        before_kill = await stored(db, agents)
        # A catch-up reader's cursor on the old primary, just before it dies.
        read_before, cursor = await read_from(pair.dsn(), Checkpoint())
        await asyncio.to_thread(pair.primary.kill)
        await asyncio.sleep(OUTAGE_SECONDS)
        spooled_in_outage = sum(a.spooled() for a in agents)
        await asyncio.to_thread(pair.fail_over)
        promoted_at = time.monotonic()

        async def serving() -> bool:
            r = await http.get(server.url + "/api/v1/health")
            return r.status_code == 200

        await wait_for(serving, RECOVERY_BOUND, "the server serving from the promoted standby", every=0.05)
        recovery = time.monotonic() - promoted_at
        assert server.proc is not None and server.proc.poll() is None, "the server exited"
        await more_reports(db, agents, await snapshot(db, agents), 30)  # type: ignore[arg-type]

        async def drained() -> bool:
            return all(a.spooled() <= 1 for a in agents)

        await wait_for(drained, 30, "every spool drained (one report may be in flight)")
        await watch.stop()
        loaded = time.monotonic()
    finally:
        stop_agents(agents)
        await http.aclose()

    try:
        figures = await exactly_once(db, agents, before_kill, server.log_text())
        print(
            f"\nfailover: recovery {recovery:.2f}s after promotion (bound {RECOVERY_BOUND}s), "
            f"spooled during the outage {spooled_in_outage}, answers {sorted(watch.statuses.items())}, "
            "reports sent={sent} accepted={accepted} still spooled={spooled} lost={lost} "
            "duplicated={duplicated} sequence gaps={gaps}".format(**figures)
        )
        watch.assert_no_500_and_the_outage_seen()
        await assert_cursor_resumes(pair.dsn(), read_before, cursor)
        await assert_verify_clean(pair.dsn())
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]

    # The old primary re-joins as a standby; its gap-safe read of the log equals the primary's.
    try:
        checked = time.monotonic()
        await asyncio.to_thread(pair.rejoin)
        await asyncio.to_thread(pair.caught_up)
        await assert_same_replay(pair.primary.dsn(), pair.standby.dsn())
    finally:
        await asyncio.to_thread(pair.close)
    print(
        f"failover test: {time.monotonic() - started:.1f}s in all (to the end of the load "
        f"{loaded - started:.1f}s, checks {checked - loaded:.1f}s, re-join and replays "
        f"{time.monotonic() - checked:.1f}s)"
    )


def test_a_multi_host_url_turns_its_hosts_and_nothing_else() -> None:
    url = "postgresql://u:p%40w@h1:5432,h2:5433,h3/db?target_session_attrs=read-write"
    assert hosts_rotated(url, 0) == url
    assert (
        hosts_rotated(url, 1) == "postgresql://u:p%40w@h2:5433,h3,h1:5432/db?target_session_attrs=read-write"
    )
    assert (
        hosts_rotated(url, 5) == "postgresql://u:p%40w@h3,h1:5432,h2:5433/db?target_session_attrs=read-write"
    )
    assert hosts_rotated("postgresql://h1,h2?sslmode=require", 1) == "postgresql://h2,h1?sslmode=require"
    for one in ("postgresql://u@h1:5432/db", "postgresql://postgres:@/postgres?host=/run/pg", "dbname=x"):
        assert hosts_rotated(one, 1) == one


async def test_a_first_host_that_never_answers_does_not_hold_every_connection(
    postgres_programs: None, workdir: Path
) -> None:
    """A failed primary that drops packets instead of refusing: asyncpg's timeout covers every
    host of the URL together, so without turning the hosts each new connection would time out on
    the first one. Here the first host accepts TCP and never speaks; the pool still connects."""
    node = await asyncio.to_thread(replication.single, workdir / "pg", fsync=False)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes handshakes; nobody ever answers
    dsn = f"postgresql://postgres@127.0.0.1:{silent.getsockname()[1]},{node.host}/postgres"
    rotation = HostRotation(timeout=1.0)
    try:
        started = time.monotonic()
        first = await rotation.connect(dsn)
        took = time.monotonic() - started
        await first.close()
        started = time.monotonic()
        second = await rotation.connect(dsn)  # starts at the host that answered
        again = time.monotonic() - started
        await second.close()
    finally:
        silent.close()
        await asyncio.to_thread(node.stop)
    assert took < 5 and again < 0.9, (took, again)
