"""A pg_auto_failover formation on this machine, for tests/test_auto_failover.py: a monitor and two
PostgreSQL 15 nodes, each run by its own `pg_autoctl run` (Debian packages pg-auto-failover-cli
and postgresql-15-auto-failover), on free ports of 127.0.0.1 in one throwaway directory, as the
`postgres` user when this process is root (pg_autoctl refuses root).

    formation = Formation.create(Path(tmp))
    formation.uri()                 # what `pg_autoctl show uri` prints, with the user named
    formation.keeper("node1").kill()  # kill -9 of its pg_autoctl and of its PostgreSQL
    formation.wait_states({"node1": "demoted", "node2": "wait_primary"})

Every pg_autoctl keeps its configuration and state under the directory's own XDG folders, so
nothing is read from or written to the postgres user's home.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import replication

PACKAGES = ("pg-auto-failover-cli", "postgresql-15-auto-failover")
EXTENSION = Path("/usr/share/postgresql/15/extension/pgautofailover.control")
DATABASE = "modelforge"
# The monitor decides faster than its defaults (in comments) so that the test takes seconds, not
# a minute: a node is unhealthy once it has not reported for 2 s and a health check failed; a
# primary that cannot be reached is given 3 s to demote itself before the secondary is promoted.
MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": "1000",  # 5000 ms
    "pgautofailover.health_check_timeout": "1000",  # 5000 ms
    "pgautofailover.health_check_max_retries": "1",  # 2
    "pgautofailover.health_check_retry_delay": "500",  # 2000 ms
    "pgautofailover.node_considered_unhealthy_timeout": "2000",  # 20000 ms
    "pgautofailover.primary_demote_timeout": "3000",  # 30000 ms
    "pgautofailover.startup_grace_period": "1000",  # 10000 ms
    "shared_buffers": "'32MB'",
    "fsync": "off",
}
# The nodes as deploy/ha/primary.conf has them (remote_apply: nothing acknowledged is lost on
# failover); pg_auto_failover's own tuning would give each a quarter of the machine's memory.
NODE_SETTINGS = {
    "synchronous_commit": "remote_apply",
    "shared_buffers": "'128MB'",
    "max_connections": "200",
    "fsync": "off",  # the test kills processes, never the machine
}


def missing() -> str:
    """Why the formation cannot be run here ('' when it can)."""
    why = replication.missing()
    if why:
        return why
    if shutil.which("pg_autoctl") is None:
        return "pg_autoctl is missing (Debian package pg-auto-failover-cli)"
    if not EXTENSION.exists():
        return f"{EXTENSION} is missing (Debian package postgresql-15-auto-failover)"
    return ""


def _owner() -> dict[str, Any]:
    """subprocess arguments that run a program as `postgres` when we are root, else nothing."""
    if os.geteuid() != 0:
        return {}
    entry = pwd.getpwnam("postgres")
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
    except OSError:
        return False
    return True


def _alive(pid: int) -> bool:
    """A zombie (killed, its parent gone, not yet reaped) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass
class Keeper:
    """One `pg_autoctl run` over one data directory: the monitor's, or a node's keeper with the
    PostgreSQL it starts and stops as the monitor tells it."""

    name: str
    pgdata: Path
    port: int
    env: dict[str, str]
    # What runs it: `pg_autoctl run` over an existing node, or a script that creates one first.
    command: list[str] = field(default_factory=list)
    log: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.log = self.pgdata.parent / f"{self.name}.log"
        self.command = self.command or ["pg_autoctl", "run", "--pgdata", str(self.pgdata)]

    def dsn(self, database: str = DATABASE) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        assert not self.running(), f"{self.name}: pg_autoctl already runs"
        self.proc = subprocess.Popen(
            self.command,
            env=self.env,
            cwd="/",
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its services and its PostgreSQL
            **_owner(),
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self, within: float) -> bool:
        """Whether pg_autoctl exits by itself within that many seconds."""
        assert self.proc is not None
        try:
            self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            return False
        return True

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None

    def postgres_running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and _alive(pid)

    def kill(self) -> None:
        """kill -9 of everything on this node, as a dead host: pg_autoctl, its services, the
        postmaster (its backends exit once it is gone). Returns once the port refuses."""
        postmaster = self.postmaster_pid()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if postmaster is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(postmaster, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _port_open(self.port) or (postmaster is not None and _alive(postmaster)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: still up 30 s after kill -9")
            time.sleep(0.05)
        # A killed postmaster whose parent is gone may stay a zombie until something reaps it:
        # PostgreSQL would take its pid file for a live server. A rebooted host has no such file.
        if postmaster is not None and Path(f"/proc/{postmaster}").exists():
            (self.pgdata / "postmaster.pid").unlink(missing_ok=True)

    def stop(self, timeout: float = 60) -> None:
        """pg_autoctl's own shutdown (SIGTERM: PostgreSQL stopped fast), else kill -9."""
        if not self.running():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        """A program with this keeper's environment and user (a container's healthcheck)."""
        return subprocess.run(
            list(command), env=self.env, cwd="/", capture_output=True, text=True, timeout=60,
            check=False, **_owner(),
        )  # fmt: skip

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def prepare(root: Path) -> dict[str, str]:
    """The directory, owned by `postgres`, and the environment every pg_autoctl of it runs with:
    its own XDG folders for pg_autoctl's configuration, state and pid files."""
    root.mkdir(parents=True, exist_ok=True)
    xdg = {"XDG_CONFIG_HOME": root / "xdg-config", "XDG_DATA_HOME": root / "xdg-data",
           "XDG_RUNTIME_DIR": root / "xdg-run"}  # fmt: skip
    for path in (root, *xdg.values()):
        path.mkdir(exist_ok=True)
        path.chmod(0o700 if path.name == "xdg-run" else 0o755)
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(path, entry.pw_uid, entry.pw_gid)
    return {
        "PATH": f"{replication.PG_BIN}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(root),
        "LANG": "C.UTF-8",
        "PG_CONFIG": str(replication.PG_BIN / "pg_config"),
        **{k: str(v) for k, v in xdg.items()},
    }


@dataclass
class Formation:
    """The monitor and two nodes, node1 created first (the primary), node2 from it."""

    root: Path
    monitor: Keeper
    nodes: dict[str, Keeper]
    env: dict[str, str]
    monitor_dsn: str  # how the test reads the monitor's tables

    @classmethod
    def create(cls, root: Path) -> Formation:
        why = missing()
        if why:
            raise RuntimeError(why)
        env = prepare(root)
        monitor = Keeper("monitor", root / "monitor", replication.free_port(), env)
        formation = cls(root, monitor, {}, env, monitor.dsn("pg_auto_failover"))
        try:
            formation._create_monitor()
            for name in ("node1", "node2"):
                formation._create_node(name)
            formation.wait_states({"node1": "primary", "node2": "secondary"}, within=120)
        except BaseException:
            formation.close()
            raise
        return formation

    def autoctl(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run(
            ["pg_autoctl", *args], env=self.env, cwd="/", capture_output=True, text=True,
            timeout=timeout, check=False, **_owner(),
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"pg_autoctl {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def _common(self) -> list[str]:
        return ["--hostname", "127.0.0.1", "--auth", "trust", "--no-ssl",
                "--pgctl", str(replication.PG_BIN / "pg_ctl")]  # fmt: skip

    def _create_monitor(self) -> None:
        m = self.monitor
        self.autoctl("create", "monitor", "--pgdata", str(m.pgdata), "--pgport", str(m.port), *self._common())
        _settings(m.pgdata, MONITOR_SETTINGS)
        m.start()
        self.wait_monitor()

    def wait_monitor(self, within: float = 60) -> None:
        self._wait(lambda: self.monitor_sql("SELECT count(*) FROM pgautofailover.formation") != "", within,
                   "the monitor answering")  # fmt: skip

    def monitor_uri(self) -> str:
        return f"postgres://autoctl_node@127.0.0.1:{self.monitor.port}/pg_auto_failover"

    def _create_node(self, name: str) -> None:
        node = Keeper(name, self.root / name, replication.free_port(), self.env)
        self.nodes[name] = node
        # node2 is made from node1 by pg_basebackup, NODE_SETTINGS included.
        self.autoctl("create", "postgres", "--pgdata", str(node.pgdata), "--pgport", str(node.port),
                     "--listen", "127.0.0.1", "--name", name, "--dbname", DATABASE,
                     "--monitor", self.monitor_uri(), *self._common())  # fmt: skip
        if name == "node1":
            _settings(node.pgdata, NODE_SETTINGS)
        node.start()

    def keeper(self, name: str) -> Keeper:
        return self.nodes[name]

    def monitor_sql(self, sql: str) -> str:
        """One statement on the monitor's database; '' when the monitor does not answer."""
        done = subprocess.run(
            [str(replication.PG_BIN / "psql"), "-X", "-qtA", "-d", self.monitor_dsn, "-c", sql],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        return done.stdout.strip() if done.returncode == 0 else ""

    def states(self) -> dict[str, tuple[str, str]]:
        """Per node: (the state its keeper reported, the state the monitor assigned)."""
        rows = self.monitor_sql("SELECT nodename, reportedstate, goalstate FROM pgautofailover.node")
        return {n: (r, g) for n, r, g in (line.split("|") for line in rows.splitlines() if line)}

    def wait_states(self, expected: dict[str, str], within: float = 60) -> None:
        """Until each named node has reached (reported and been assigned) its state."""
        self._wait(lambda: all(self.states().get(n) == (s, s) for n, s in expected.items()), within,
                   f"states {expected}")  # fmt: skip

    def _wait(self, done: Any, within: float, what: str) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if done():
                return
            time.sleep(0.1)
        logs = "\n".join(
            f"--- {k.name}\n{k.log_text()[-2500:]}" for k in (self.monitor, *self.nodes.values())
        )
        raise RuntimeError(f"no {what} after {within}s (monitor: {self.states()}):\n{logs}")

    def uri(self) -> str:
        """The formation's URI as `pg_autoctl show uri` prints it (both nodes,
        target_session_attrs=read-write), with the database user named."""
        out = self.autoctl("show", "uri", "--pgdata", str(self.monitor.pgdata), "--formation", "default")
        found = re.search(r"postgres://\S+", out)
        assert found, out
        return found.group(0).replace("postgres://", "postgresql://postgres@", 1)

    def close(self) -> None:
        """Every keeper stopped at once (each shutdown takes seconds), then the directory gone."""

        def stop(keeper: Keeper) -> None:
            try:
                keeper.stop()
            except (OSError, RuntimeError, subprocess.SubprocessError):
                keeper.kill()

        with ThreadPoolExecutor(max_workers=3) as pool:
            list(pool.map(stop, (*self.nodes.values(), self.monitor)))
        shutil.rmtree(self.root, ignore_errors=True)


def _settings(pgdata: Path, settings: dict[str, str]) -> None:
    """Settings that win over pg_auto_failover's own file: postgresql.auto.conf is read last."""
    with (pgdata / "postgresql.auto.conf").open("a") as conf:
        conf.write("".join(f"{k} = {v}\n" for k, v in settings.items()))
