"""A primary and a hot standby of PostgreSQL 15 on this machine, for the failover test and
`bench.ingest --replica`: real clusters (initdb, a replication slot, `pg_basebackup -R -S`), each
on a free port of 127.0.0.1 in a throwaway directory, run as the `postgres` user when this
process is root (initdb refuses root).

    pair = ReplicatedPair.create(Path(tmp), synchronous="remote_apply")
    pair.dsn()            # postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/postgres?target_session_attrs=read-write
    pair.primary.kill()   # kill -9 of the postmaster
    pair.standby.promote()
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

PG_BIN = Path(os.environ.get("MODELFORGE_PG_BIN", "/usr/lib/postgresql/15/bin"))
PG_PACKAGE = "postgresql-15"
SLOT = "mf_standby"
STANDBY_NAME = "mf_standby"
# remote_apply: a commit returns once the standby has applied it (no accepted report is lost on
# failover, and a read of the standby sees it); on: once the standby has flushed it; local: the
# primary's disk only (asynchronous replication).
SYNCHRONOUS = ("remote_apply", "on", "local")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> list[str]:
    """The prefix that runs a PostgreSQL program as `postgres` when we are root (initdb and the
    postmaster refuse root), else nothing."""
    if os.geteuid() != 0:
        return []
    return ["runuser", "-u", "postgres", "--"]


def _owner_ids() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    entry = pwd.getpwnam("postgres")
    return entry.pw_uid, entry.pw_gid


def missing() -> str:
    """Why the PostgreSQL 15 server programs cannot be used here ('' when they can)."""
    if not (PG_BIN / "initdb").exists():
        return f"{PG_BIN}/initdb is missing (Debian package {PG_PACKAGE})"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run PostgreSQL as"
    return ""


def _pg(program: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*_run_as(), str(PG_BIN / program), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd="/",
    )
    if done.returncode != 0:
        raise RuntimeError(f"{program} {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done


@dataclass
class Node:
    """One cluster: its data directory, its port, its postmaster."""

    name: str
    data: Path
    port: int
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.data.parent / f"{self.name}.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        _pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "start")

    def stop(self) -> None:
        if self.running():
            _pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def postmaster_pid(self) -> int | None:
        pid_file = self.data / "postmaster.pid"
        try:
            return int(pid_file.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def running(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            # A killed postmaster whose parent is gone may stay a zombie where nothing reaps it.
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")

    def kill(self) -> None:
        """kill -9 of the postmaster (its backends exit on their own once it is gone), waiting
        until the port is free again."""
        pid = self.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            except OSError:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name}: port {self.port} still answers after kill -9")

    def promote(self) -> None:
        """Promote this standby, then stop waiting for a synchronous standby it does not have (it
        inherited the primary's `synchronous_standby_names`; its commits would wait forever)."""
        _pg("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")
        self.psql("ALTER SYSTEM SET synchronous_standby_names = ''")
        self.psql("SELECT pg_reload_conf()")

    def psql(self, sql: str) -> str:
        return _pg("psql", "-X", "-qtA", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                   "-d", "postgres", "-c", sql).stdout.strip()  # fmt: skip


def _primary(root: Path, synchronous: str, fsync: bool) -> Node:
    """An initialised primary (not started) set up to stream to the standby named STANDBY_NAME."""
    root.mkdir(parents=True, exist_ok=True)
    owner = _owner_ids()
    if owner is not None:
        os.chown(root, *owner)
        root.chmod(0o755)
    primary = Node("primary", root / "primary", free_port())
    _pg("initdb", "-D", str(primary.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
    sockets = root / "sockets"
    sockets.mkdir(exist_ok=True)
    if owner is not None:
        os.chown(sockets, *owner)
    with (primary.data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"\nlisten_addresses = '127.0.0.1'\nport = {primary.port}\n"
            f"unix_socket_directories = '{sockets}'\n"
            "wal_level = replica\nmax_wal_senders = 5\nmax_replication_slots = 5\n"
            "hot_standby = on\nhot_standby_feedback = on\nwal_keep_size = '256MB'\n"
            # pg_rewind needs hint bits WAL-logged to re-join a failed primary as a standby.
            "wal_log_hints = on\n"
            f"fsync = {'on' if fsync else 'off'}\nmax_connections = 200\n"
            f"synchronous_commit = {synchronous}\n"
            # With `local` no standby is waited for; otherwise this standby, by its name.
            f"synchronous_standby_names = '{'' if synchronous == 'local' else STANDBY_NAME}'\n"
        )
    with (primary.data / "pg_hba.conf").open("a") as hba:
        hba.write("\nhost replication postgres 127.0.0.1/32 trust\n")
    return primary


def single(root: Path, *, fsync: bool = True) -> Node:
    """A primary without a standby (the benchmark's "no replica"), started."""
    why = missing()
    if why:
        raise RuntimeError(why)
    node = _primary(root, "local", fsync)
    node.start()
    return node


@dataclass
class ReplicatedPair:
    """A primary streaming to one hot standby through a physical replication slot."""

    root: Path
    primary: Node
    standby: Node
    synchronous: str

    @classmethod
    def create(cls, root: Path, *, synchronous: str = "remote_apply", fsync: bool = True) -> ReplicatedPair:
        if synchronous not in SYNCHRONOUS:
            raise ValueError(f"synchronous must be one of {', '.join(SYNCHRONOUS)}")
        why = missing()
        if why:
            raise RuntimeError(why)
        primary = _primary(root, synchronous, fsync)
        standby = Node("standby", root / "standby", free_port())
        primary.start()
        primary.psql(f"SELECT pg_create_physical_replication_slot('{SLOT}')")
        conninfo = f"host=127.0.0.1 port={primary.port} user=postgres application_name={STANDBY_NAME}"
        _pg("pg_basebackup", "-d", conninfo, "-D", str(standby.data), "-R", "-S", SLOT, "-X", "stream",
            "--checkpoint=fast", "--no-sync", timeout=300)  # fmt: skip
        with (standby.data / "postgresql.conf").open("a") as conf:
            conf.write(f"\nport = {standby.port}\n")
        standby.start()
        pair = cls(root, primary, standby, synchronous)
        pair.wait_streaming()
        return pair

    def dsn(self, database: str = "postgres") -> str:
        """The servers' multi-host URL: whichever of the two accepts writes."""
        return (
            f"postgresql://postgres@{self.primary.host},{self.standby.host}/{database}"
            "?target_session_attrs=read-write"
        )

    def wait_streaming(self, within: float = 60) -> None:
        deadline = time.monotonic() + within
        state = ""
        while time.monotonic() < deadline:
            state = self.primary.psql(
                f"SELECT state || ' ' || sync_state FROM pg_stat_replication WHERE application_name = '{STANDBY_NAME}'"
            )
            if state.startswith("streaming"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the standby is not streaming after {within}s ({state!r})")

    def fail_over(self) -> None:
        """The standby becomes the primary; the old primary is expected to be down already."""
        self.standby.promote()
        self.primary, self.standby = self.standby, self.primary

    def rejoin(self) -> None:
        """The failed old primary (now `standby`, down) re-joins as a standby of the promoted one:
        a slot on the new primary, `pg_rewind -R` (it runs crash recovery on the target first),
        the old port back (pg_rewind copies the source's configuration), then start."""
        old, new = self.standby, self.primary
        if old.running():
            raise RuntimeError("stop the old primary before it re-joins")
        # Its killed postmaster may linger as a zombie where nothing reaps orphans (a container
        # without an init): PostgreSQL would take its pid file for a live server.
        (old.data / "postmaster.pid").unlink(missing_ok=True)
        new.psql(f"SELECT pg_create_physical_replication_slot('{SLOT}') "
                 f"WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '{SLOT}')")  # fmt: skip
        # pg_rewind reads the source's timeline from its control file, which a promotion updates
        # only at its next checkpoint: without one it sees no divergence and rewinds nothing.
        new.psql("CHECKPOINT")
        conninfo = f"host=127.0.0.1 port={new.port} user=postgres application_name={STANDBY_NAME}"
        _pg("pg_rewind", "-D", str(old.data), "--source-server", conninfo, "-R", timeout=300)
        with (old.data / "postgresql.conf").open("a") as conf:
            conf.write(f"\nport = {old.port}\nprimary_slot_name = '{SLOT}'\n")
        old.start()
        self.wait_streaming()

    def caught_up(self, within: float = 60) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        target = self.primary.psql("SELECT pg_current_wal_lsn()")
        deadline = time.monotonic() + within
        replayed = ""
        while time.monotonic() < deadline:
            replayed = self.standby.psql("SELECT pg_last_wal_replay_lsn()")
            if self.standby.psql(f"SELECT '{replayed}'::pg_lsn >= '{target}'::pg_lsn") == "t":
                return
            time.sleep(0.1)
        log = self.standby.log.read_text(errors="replace")[-3000:] if self.standby.log.exists() else ""
        raise RuntimeError(f"the standby replayed up to {replayed}, not {target}, after {within}s:\n{log}")

    def close(self) -> None:
        for node in (self.standby, self.primary):
            if node.running():
                try:
                    node.stop()
                except (RuntimeError, subprocess.TimeoutExpired):
                    node.kill()
        shutil.rmtree(self.root, ignore_errors=True)
