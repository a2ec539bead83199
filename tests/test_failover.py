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
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from bench import replication
from ledger.db import HostRotation, hosts_rotated
from ledger.reading import Checkpoint, read_log
from tests.agent_support import OPERATOR, ROOT, AgentProcess, ServerProcess, clean_env, create_token, wait_for
from tests.test_deploy import _apt_install
from tests.test_faults import account, more_reports, snapshot

# Seconds from `pg_ctl promote` returning until the server answers 200 again (its pool's next
# connection finds the new primary; nothing waits for a timer).
RECOVERY_BOUND = 15.0
OUTAGE_SECONDS = 1.5  # the primary is down this long before the promotion: reports spool


class Ledger:
    """Reads through the two-host URL (or one node's), one short connection at a time: a pool
    would break with the primary it is about to lose."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.dsn, timeout=5)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()


@pytest.fixture(scope="module")
def postgres_programs() -> None:
    why = replication.missing()
    if why and not (replication.PG_BIN / "initdb").exists():
        problem = _apt_install(replication.PG_PACKAGE)
        assert not problem, problem
        why = replication.missing()
    assert not why, why


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mf-failover-"))
    path.chmod(0o755)  # the postgres user reaches its data directories below it
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Watch:
    """Polls a read route and the health route throughout; every answer's status is kept, and
    every 503 must be problem+json with Retry-After."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.statuses: dict[tuple[str, int], int] = {}
        self.bad: list[str] = []
        self.last_ok = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=10) as http:
            while True:
                for name, path, headers in (
                    ("nodes", "/api/v1/hardware/nodes", OPERATOR),
                    ("accelerators", "/api/v1/hardware/accelerators", OPERATOR),  # a rendered read
                    ("events", "/api/v1/hardware/events?limit=5", OPERATOR),
                    ("health", "/api/v1/health", {}),
                ):
                    r = await http.get(self.url + path, headers=headers)
                    key = (name, r.status_code)
                    self.statuses[key] = self.statuses.get(key, 0) + 1
                    if (
                        r.status_code == 503
                        and name != "health"
                        and (
                            not r.headers.get("content-type", "").startswith("application/problem+json")
                            or "retry-after" not in r.headers
                        )
                    ):
                        self.bad.append(f"{path}: 503 without problem+json and Retry-After: {r.headers}")
                    if r.status_code >= 500 and r.status_code != 503:
                        self.bad.append(f"{path}: {r.status_code} {r.text[:300]}")
                await asyncio.sleep(0.05)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()  # an httpx error here is a failure of the server
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


async def stored(db: Ledger, agents: list[AgentProcess]) -> set[tuple[str, str, int]]:
    rows = await db.fetch(
        "SELECT stream_id, metadata->>'agent_stream' AS stream, (metadata->>'agent_sequence')::bigint AS seq "
        "FROM events WHERE stream_id = ANY($1::text[]) AND event_type = 'NODE_TELEMETRY_OBSERVED'",
        [a.expected_node_id for a in agents],
    )
    return {(r["stream_id"], r["stream"], r["seq"]) for r in rows}


async def read_from(dsn: str, after: Checkpoint) -> tuple[list[int], Checkpoint]:
    """Every event after `after` through the one gap-safe read, page by page, in commit order
    (global positions), and the cursor to resume from."""
    conn = await asyncpg.connect(dsn, timeout=10)
    ids: list[int] = []
    try:
        while True:
            page = await read_log(conn, after, limit=500)
            ids.extend(e.global_position for e in page.entries)
            after = page.resume
            if not page.more:
                return ids, after
    finally:
        await conn.close()


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args],
        env=clean_env(MODELFORGE_DATABASE_URL=dsn),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


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
        server.start()
        await server.wait_healthy(within=60)
        token = (await create_token(http, server.url, uses=3))["token"]
        enrolled = await asyncio.gather(*(a.enroll(server.url, token) for a in agents))
        assert all(e.returncode == 0 for e in enrolled), [a.log_text() for a in agents]
        for a in agents:
            a.start(server.url, interval=0.2)
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
        for a in agents:
            if a.proc is not None and a.proc.poll() is None:
                assert a.stop() == 0, a.log_text()[-3000:]
        await http.aclose()

    try:
        figures = await account(db, agents)  # type: ignore[arg-type]
        after = await stored(db, agents)
        log = server.log_text()
        print(
            f"\nfailover: recovery {recovery:.2f}s after promotion (bound {RECOVERY_BOUND}s), "
            f"spooled during the outage {spooled_in_outage}, answers {sorted(watch.statuses.items())}, "
            "reports sent={sent} accepted={accepted} still spooled={spooled} lost={lost} "
            "duplicated={duplicated} sequence gaps={gaps}".format(**figures)
        )
        assert not watch.bad, watch.bad[:5]
        assert not [k for k in watch.statuses if k[1] >= 500 and k[1] != 503], watch.statuses
        assert ("health", 503) in watch.statuses, "the outage was never seen"
        assert before_kill <= after, "a report accepted before the kill is missing"
        assert figures["lost"] == 0 and figures["duplicated"] == 0 and figures["gaps"] == 0, figures
        assert "http.unexpected_error" not in log and "Traceback" not in log, log[-5000:]
        # What the rendered reads kept from the old primary's probes is not trusted on the new one.
        assert "rendered.server_changed" in log

        # The cursor taken on the old primary resumes on the promoted one: every event once.
        read_after, _ = await read_from(pair.dsn(), cursor)
        everything, _ = await read_from(pair.dsn(), Checkpoint())
        assert not set(read_before) & set(read_after)
        assert read_before + read_after == everything

        checks = await asyncio.gather(
            *(asyncio.to_thread(cli, pair.dsn(), *args) for args in (("verify",), ("rebuild", "--verify")))
        )
        for done in checks:
            assert done.returncode == 0, (done.args, done.stdout + done.stderr)
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]

    # The old primary re-joins as a standby; its gap-safe read of the log equals the primary's.
    try:
        checked = time.monotonic()
        await asyncio.to_thread(pair.rejoin)
        await asyncio.to_thread(pair.caught_up)
        on_primary, _ = await read_from(pair.primary.dsn(), Checkpoint())
        on_standby, _ = await read_from(pair.standby.dsn(), Checkpoint())
        assert on_standby == on_primary and len(set(on_primary)) == len(on_primary)
        replays = await asyncio.gather(
            *(
                asyncio.to_thread(cli, n.dsn(), "replay", "--format", "jsonl")
                for n in (pair.primary, pair.standby)
            )
        )
        for done in replays:
            assert done.returncode == 0, done.stdout + done.stderr
        assert replays[0].stdout == replays[1].stdout and replays[0].stdout.count("\n") >= len(on_primary)
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
