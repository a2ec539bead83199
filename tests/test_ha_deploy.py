"""deploy/ha/compose.yaml: the pg_auto_failover pair in containers (a monitor, node1, node2, the
server on the two-host URL). No Docker engine runs here, so what is checked is what can be
without one:

* the file as written: its services, the server's URL (both nodes, `target_session_attrs=
  read-write`, the database the nodes create), a named volume per database container, the same
  confinement as deploy/compose.yaml, and that HIGH_AVAILABILITY.md describes the same;
* `docker-compose config` (Debian's docker-compose 1.29, installed when missing: the test fails,
  never skips, when it cannot be): the file validates and interpolates, and refuses to run
  without its passwords;
* the image's Dockerfile: Debian's packages, the ones tests/test_auto_failover.py runs;
* the containers' entrypoint itself (deploy/ha/pgaf-entrypoint.sh), run on this machine as the
  containers run it: it makes a monitor and two nodes with scram-sha-256 and self-signed TLS,
  and the compose file's URL, with this machine's ports for the two hosts, reaches the primary as
  the `modelforge` role, over TLS, with `synchronous_commit = remote_apply`; `modelforge-hw
  migrate` applies the schema through it. Each container starts once the one before is healthy
  by the compose file's healthcheck (`pgaf-entrypoint.sh ready`), as compose starts them;
* a node whose registration the monitor failed at COMMIT (as a monitor restarting then does), or
  that stopped between pg_autoctl's creation and the entrypoint's own steps, comes up on its next
  start, with its role and settings once.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg
import pytest
import yaml

from bench import replication
from tests import auto_failover_support as paf
from tests import debian
from tests.cli_support import parse
from tests.failover_support import cli, postgres_programs, workdir
from tests.test_auto_failover import auto_failover_programs
from tests.test_deploy import assert_confined, dockerfile_instructions

__all__ = ["auto_failover_programs", "postgres_programs", "workdir"]  # the fixtures, used by name

ROOT = Path(__file__).resolve().parent.parent
HA = ROOT / "deploy" / "ha"
COMPOSE = HA / "compose.yaml"
DOCKERFILE = HA / "Dockerfile.pg_auto_failover"
ENTRYPOINT = HA / "pgaf-entrypoint.sh"
DOC = ROOT / "docs" / "operations" / "HIGH_AVAILABILITY.md"
PASSWORDS = {
    "POSTGRES_PASSWORD": "app-s3cret",
    "PGAF_AUTOCTL_NODE_PASSWORD": "node-s3cret",
    "PGAF_REPLICATION_PASSWORD": "repl-s3cret",
}
DATABASE_SERVICES = ("monitor", "node1", "node2")


def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def server_url() -> str:
    """The server's URL as the file writes it, with POSTGRES_PASSWORD as docker-compose fills it."""
    url = compose()["services"]["server"]["environment"]["MODELFORGE_DATABASE_URL"]
    return str(re.sub(r"\$\{POSTGRES_PASSWORD(:\?[^}]*)?\}", PASSWORDS["POSTGRES_PASSWORD"], url))


def test_the_pair_the_monitor_and_the_server_with_a_volume_each() -> None:
    config = compose()
    services = config["services"]
    assert set(services) == {*DATABASE_SERVICES, "server"}
    assert_confined(config, "deploy/ha/compose.yaml")
    mounts = {}
    for name in DATABASE_SERVICES:
        service = services[name]
        assert service["command"] == ["monitor" if name == "monitor" else "node"]
        assert service["hostname"] == service["environment"]["PGAF_HOSTNAME"] == name
        assert service["user"] == "postgres"
        # Healthy once the entrypoint has created the node, not while it restarts PostgreSQL.
        assert service["healthcheck"]["test"] == ["CMD", "/usr/local/bin/pgaf-entrypoint.sh", "ready"]
        (volume,) = service["volumes"]
        source, target = volume.split(":")
        assert target == "/var/lib/postgresql", "PGDATA and pg_autoctl's state live there"
        mounts[name] = source
    assert len(set(mounts.values())) == 3, mounts
    assert set(config["volumes"]) == {*mounts.values(), "modelforge-state"}
    # The secondary is copied from the primary on its first start.
    assert services["node2"]["depends_on"]["node1"]["condition"] == "service_healthy"
    # The server waits for no node's health: it must come up whichever node is the primary.
    assert all(d["condition"] == "service_started" for d in services["server"]["depends_on"].values())
    assert parse(services["server"]["command"]) == ("serve",)


def test_the_server_url_names_both_nodes_and_asks_for_the_writable_one() -> None:
    parts = urlsplit(server_url())
    assert parts.netloc == "modelforge:app-s3cret@node1:5432,node2:5432"
    assert parts.path == "/modelforge"
    assert parse_qs(parts.query) == {"target_session_attrs": ["read-write"], "sslmode": ["require"]}
    # The database the nodes create and the role they give it to.
    script = ENTRYPOINT.read_text(encoding="utf-8")
    assert "--dbname modelforge" in script and "CREATE ROLE modelforge LOGIN" in script
    assert "synchronous_commit = 'remote_apply'" in script


def test_the_docs_describe_this_file() -> None:
    doc = DOC.read_text(encoding="utf-8")
    assert "deploy/ha/compose.yaml" in doc
    for name in (*DATABASE_SERVICES, "node1:5432,node2:5432", *PASSWORDS, "docker-compose config"):
        assert name in doc, f"HIGH_AVAILABILITY.md does not mention {name}"
    example = (HA / "env.example").read_text(encoding="utf-8")
    for variable in PASSWORDS:
        assert f"\n{variable}=\n" in example, variable


def test_the_image_is_debians_packages_run_as_postgres() -> None:
    instructions = dockerfile_instructions(DOCKERFILE)
    assert [a for w, a in instructions if w == "FROM"] == ["debian:bookworm-slim"]
    (install,) = [a for w, a in instructions if w == "RUN"]
    for package in ("postgresql-15", *paf.PACKAGES):
        assert f" {package}" in install, package
    assert [a for w, a in instructions if w == "USER"] == ["postgres"]
    (copy,) = [a.split() for w, a in instructions if w == "COPY"]
    assert (HA / copy[0]).is_file() and copy[1] == "/usr/local/bin/pgaf-entrypoint.sh"
    # The build context (deploy/ha) sends the entrypoint alone: never deploy/ha/.env's passwords.
    ignore = (HA / ".dockerignore").read_text(encoding="utf-8").splitlines()
    assert "*" in ignore and f"!{copy[0]}" in ignore
    (entrypoint,) = [yaml.safe_load(a) for w, a in instructions if w == "ENTRYPOINT"]
    assert entrypoint == [copy[1]]
    assert os.access(ENTRYPOINT, os.X_OK)
    assert subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=False).returncode == 0


@pytest.fixture(scope="module")
def docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        why = debian.install("docker-compose")
        path = shutil.which("docker-compose")
        assert path is not None, f"docker-compose cannot be installed: {why or 'not on PATH after install'}"
    return path


def compose_config(docker_compose: str, tmp_path: Path, variables: dict[str, str]) -> tuple[int, Any, str]:
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in variables.items()), encoding="utf-8")
    done = subprocess.run(
        [docker_compose, "--env-file", str(env_file), "-f", str(COMPOSE), "config"],
        cwd=ROOT,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, yaml.safe_load(done.stdout) if done.returncode == 0 else None, done.stderr


def test_docker_compose_config_validates_it(docker_compose: str, tmp_path: Path) -> None:
    code, config, err = compose_config(docker_compose, tmp_path, PASSWORDS)
    assert code == 0, err
    server = config["services"]["server"]
    assert server["environment"]["MODELFORGE_DATABASE_URL"] == (
        "postgresql://modelforge:app-s3cret@node1:5432,node2:5432/modelforge"
        "?target_session_attrs=read-write&sslmode=require"
    )
    for name in ("node1", "node2"):
        env = config["services"][name]["environment"]
        assert {k: env[k] for k in PASSWORDS} == PASSWORDS
        assert env["PGAF_HOSTNAME"] == name
    assert config["services"]["monitor"]["environment"]["PGAF_AUTOCTL_NODE_PASSWORD"] == "node-s3cret"
    assert config["services"]["node1"]["build"]["context"] == str(HA)
    assert_confined(config, "docker-compose config deploy/ha/compose.yaml")


@pytest.mark.parametrize("absent", sorted(PASSWORDS))
def test_docker_compose_refuses_it_without_a_password(
    docker_compose: str, tmp_path: Path, absent: str
) -> None:
    code, _, err = compose_config(
        docker_compose, tmp_path, {k: v for k, v in PASSWORDS.items() if k != absent}
    )
    assert code != 0 and absent in err, err


class Containers:
    """The three database containers as compose runs them, on this machine: each one the
    entrypoint under its own pg_autoctl directory, started and restarted by the test."""

    def __init__(self, workdir: Path) -> None:
        self.root = workdir / "compose-pgaf"
        self.env = {**paf.prepare(self.root), **PASSWORDS}
        self.monitor_port = replication.free_port()
        self.tag = uuid.uuid4().hex[:6]
        self.monitor = self.keeper("monitor", self.monitor_port)
        self.nodes = {n: self.keeper(n, replication.free_port()) for n in ("node1", "node2")}
        self.names = {n: f"{n}-{self.tag}" for n in self.nodes}
        monitor_dsn = (
            f"postgresql://autoctl_node:{PASSWORDS['PGAF_AUTOCTL_NODE_PASSWORD']}@127.0.0.1:"
            f"{self.monitor_port}/pg_auto_failover?sslmode=require"
        )
        self.formation = paf.Formation(self.root, self.monitor, self.nodes, self.env, monitor_dsn)

    def keeper(self, name: str, port: int) -> paf.Keeper:
        role = "monitor" if name == "monitor" else "node"
        # Each container's hostname is 127.0.0.1 here; names tell the nodes apart on the monitor.
        own = {"PGDATA": str(self.root / name), "PGAF_HOSTNAME": "127.0.0.1", "PGAF_NAME": f"{name}-{self.tag}",
               "PGAF_PORT": str(port), "PGAF_MONITOR_HOST": "127.0.0.1", "PGAF_MONITOR_PORT": str(self.monitor_port)}  # fmt: skip
        return paf.Keeper(name, self.root / name, port, {**self.env, **own}, command=[str(ENTRYPOINT), role])

    def healthy(self, keeper: paf.Keeper) -> bool:
        """The compose file's healthcheck of that container."""
        return keeper.run(str(ENTRYPOINT), "ready").returncode == 0

    def wait_healthy(self, keeper: paf.Keeper, within: float) -> None:
        deadline = time.monotonic() + within
        while not self.healthy(keeper):
            assert keeper.running(), f"{keeper.name} exited:\n{keeper.log_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{keeper.name} not healthy after {within}s"
            time.sleep(0.1)

    def created_mark(self, keeper: paf.Keeper) -> Path:
        return Path(self.env["XDG_CONFIG_HOME"], f"pg_autoctl{keeper.pgdata}", "modelforge-created")

    def node_sql(self, name: str, sql: str) -> str:
        done = subprocess.run(
            [str(replication.PG_BIN / "psql"), "-X", "-qtA", "-v", "ON_ERROR_STOP=1",
             "-d", self.nodes[name].dsn(), "-c", sql],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return done.stdout.strip()

    def dump_logs(self) -> None:
        for k in (self.monitor, *self.nodes.values()):
            print(f"--- {k.name}\n{k.log_text()[-3000:]}")

    def close(self) -> None:
        self.formation.close()


async def test_the_entrypoint_makes_the_formation_the_compose_url_reaches(
    auto_failover_programs: None, workdir: Path
) -> None:
    c = Containers(workdir)
    nodes, names = c.nodes, c.names
    try:
        # compose's order: node1 once the monitor is healthy, node2 once node1 is.
        c.monitor.start()
        await asyncio.to_thread(c.wait_healthy, c.monitor, 120)
        nodes["node1"].start()
        await asyncio.to_thread(c.wait_healthy, nodes["node1"], 120)
        assert c.formation.states() == {names["node1"]: ("single", "single")}
        nodes["node2"].start()
        await asyncio.to_thread(
            c.formation.wait_states, {names["node1"]: "primary", names["node2"]: "secondary"}, 180
        )
        # The compose file's URL, with this machine's address and ports for node1 and node2.
        url = server_url().replace(
            "node1:5432,node2:5432", f"127.0.0.1:{nodes['node1'].port},127.0.0.1:{nodes['node2'].port}"
        )
        printed = c.formation.monitor_sql(
            "SELECT pgautofailover.formation_uri('default', 'default', 'require')"
        )
        assert printed.replace("postgres://", "postgresql://modelforge:app-s3cret@", 1) == url, printed
        conn = await asyncpg.connect(url, timeout=10)
        try:
            row = await conn.fetchrow(
                "SELECT current_user AS role, inet_server_port() AS port, "
                "current_setting('synchronous_commit') AS sync, "
                "(SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()) AS tls"
            )
        finally:
            await conn.close()
        assert row is not None
        assert dict(row) == {
            "role": "modelforge",
            "port": nodes["node1"].port,
            "sync": "remote_apply",
            "tls": True,
        }
        done = await asyncio.to_thread(cli, url, "migrate")
        assert done.returncode == 0, done.stdout + done.stderr
    except BaseException:
        c.dump_logs()
        raise
    finally:
        await asyncio.to_thread(c.close)


# Fails the COMMIT of the first node registration, as a monitor that restarts then does: the
# monitor forgets the node, which keeps pg_autoctl's init file and no state file.
FAIL_FIRST_REGISTRATION = """
CREATE SEQUENCE public.registrations;
CREATE FUNCTION public.fail_first_registration() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
  IF nextval('public.registrations') = 1 THEN
    RAISE EXCEPTION 'the monitor went away';
  END IF;
  RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER fail_first_registration AFTER INSERT ON pgautofailover.node
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.fail_first_registration();
"""


def test_a_node_comes_up_on_the_start_after_an_interrupted_creation(
    auto_failover_programs: None, workdir: Path
) -> None:
    c = Containers(workdir)
    node1 = c.nodes["node1"]
    try:
        c.monitor.start()
        c.wait_healthy(c.monitor, 120)
        done = subprocess.run(
            [str(replication.PG_BIN / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1",
             "-d", c.monitor.dsn("pg_auto_failover"), "-c", FAIL_FIRST_REGISTRATION],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        node1.start()
        assert node1.exited(within=90), "the node's creation went on though its registration failed"
        assert node1.proc is not None and node1.proc.returncode != 0
        assert "Failed to COMMIT register_node transaction" in node1.log_text()
        # The container's restart policy starts it again.
        node1.start()
        c.wait_healthy(node1, 120)
        assert c.formation.states() == {c.names["node1"]: ("single", "single")}
        assert (
            c.node_sql("node1", "SELECT rolname FROM pg_roles WHERE rolname = 'modelforge'") == "modelforge"
        )
        # Stopped after pg_autoctl's creation and before the entrypoint's own steps: the next
        # start does them again, and they hold once.
        node1.stop()
        c.created_mark(node1).unlink()
        node1.start()
        c.wait_healthy(node1, 120)
        assert c.formation.states() == {c.names["node1"]: ("single", "single")}
        assert c.node_sql("node1", "SELECT count(*) FROM pg_roles WHERE rolname = 'modelforge'") == "1"
        assert c.node_sql("node1", "SHOW synchronous_commit") == "remote_apply"
    except BaseException:
        c.dump_logs()
        raise
    finally:
        c.close()
