"""deploy/: the container image, the compose files and the systemd units.

What runs where:

* Static checks (always): the Dockerfile (base, non-root user, state volume, entrypoints, every
  package copied), the compose files as YAML (no top-level `name:`, nothing privileged, no Docker
  socket, no host path mounted, only named volumes), the units' hardening, and that every command
  line they start parses as the real `modelforge-hw` parses it.
* `docker-compose config` on `compose.yaml` and on `compose.yaml` + `compose.gpu.yaml` (and the
  overlay alone): Debian's `docker-compose` 1.29 validates and interpolates compose files without
  a Docker engine. When it is missing, a session fixture installs it with apt-get (updating the
  package lists first if the install fails), under a timeout; when it cannot be installed (no
  apt-get, not root, no network) these tests fail and say why: a check not run is not passed.
* `systemd-analyze verify` on every unit in deploy/systemd/ (installed with apt-get the same way
  when missing; failing, with the reason, when it cannot be had).
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import debian
from tests.cli_support import parse

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_GPU = DEPLOY / "compose.gpu.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
STATE_DIR = "/var/lib/modelforge"


# --- tools, installed once per session ----------------------------------------------------------


@pytest.fixture(scope="session")
def docker_compose() -> str:
    return debian.require("docker-compose", "docker-compose")


@pytest.fixture(scope="session")
def systemd_analyze() -> str:
    return debian.require("systemd-analyze", "systemd")


# --- the image ----------------------------------------------------------------------------------


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text(encoding="utf-8"))
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_image_is_python_slim_and_runs_as_an_unprivileged_user() -> None:
    instructions = dockerfile_instructions()
    froms = [args for word, args in instructions if word == "FROM"]
    assert froms[-1].split()[0] == "python:3.11-slim"
    users = [args for word, args in instructions if word == "USER"]
    assert users, "the image must switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"the final USER is {users[-1]}"
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "docker.sock" not in text and "--privileged" not in text


def test_image_has_the_state_volume_and_both_entrypoints() -> None:
    instructions = dockerfile_instructions()
    volumes = " ".join(args for word, args in instructions if word == "VOLUME")
    assert STATE_DIR in volumes
    env = " ".join(args for word, args in instructions if word == "ENV")
    assert f"MODELFORGE_STATE_DIR={STATE_DIR}" in env
    (entrypoint,) = [yaml.safe_load(args) for word, args in instructions if word == "ENTRYPOINT"]
    assert entrypoint == ["modelforge-hw"]
    (cmd,) = [yaml.safe_load(args) for word, args in instructions if word == "CMD"]
    assert cmd[:3] == ["serve", "--host", "0.0.0.0"]
    # Both entrypoints are real command lines of this CLI.
    assert parse(cmd) == ("serve",)
    assert parse(["agent", "run"]) == ("agent", "run")


def test_image_copies_every_package_of_the_distribution() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "packages"
    ]
    instructions = dockerfile_instructions()
    sources = [s for word, args in instructions if word == "COPY" for s in args.split()[:-1]]
    assert sources, "nothing is copied into the image"
    for source in sources:
        assert not source.startswith("--"), f"unexpected COPY option {source}"
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
    # A subpackage (api.http.console) comes with its parent's COPY.
    for needed in [
        *dict.fromkeys(p.split(".")[0] for p in packages),
        "pyproject.toml",
        "README.md",
        "schema.sql",
    ]:
        assert needed in sources, f"the Dockerfile does not COPY {needed}"
    assert any(word == "RUN" and "pip install" in args for word, args in instructions)
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    for source in sources:
        assert f"!{source.rstrip('/')}" in ignore, f"Dockerfile.dockerignore does not re-include {source}"


# --- compose: static ----------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def mount_source(volume: Any) -> str:
    if isinstance(volume, dict):
        assert volume.get("type", "volume") == "volume", f"not a named volume: {volume}"
        return str(volume["source"])
    return str(volume).split(":", 1)[0]


def assert_confined(compose: dict[str, Any], where: str) -> None:
    """No privileged mode, Docker socket, host mount or host namespace in any service."""
    assert "name" not in compose, f"{where}: docker-compose 1.29 refuses a top-level `name:`"
    named = set((compose.get("volumes") or {}).keys())
    assert "docker.sock" not in yaml.safe_dump(compose)
    for service_name, service in compose["services"].items():
        what = f"{where}: service {service_name}"
        assert not service.get("privileged"), f"{what} is privileged"
        assert not service.get("cap_add"), f"{what} adds capabilities"
        assert "devices" not in service, f"{what} maps host devices (use a device reservation)"
        for key in ("network_mode", "pid", "ipc", "userns_mode"):
            assert service.get(key) != "host", f"{what} uses the host's {key}"
        for volume in service.get("volumes") or []:
            source = mount_source(volume)
            assert source in named, f"{what} mounts {source!r}, which is not a named volume"
        if service_name != "postgres":
            assert str(service.get("user", "")).split(":")[0] not in ("", "0", "root"), f"{what} runs as root"
            assert "no-new-privileges:true" in (service.get("security_opt") or []), what
            assert service.get("cap_drop") == ["ALL"], what


def test_compose_files_are_confined_as_written() -> None:
    assert_confined(load(COMPOSE), "compose.yaml")
    assert_confined(load(COMPOSE_GPU), "compose.gpu.yaml")


def test_compose_commands_parse_with_the_cli() -> None:
    for path in (COMPOSE, COMPOSE_GPU):
        for name, service in load(path)["services"].items():
            if "command" in service:
                command = service["command"]
                argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
                assert parse(argv), f"{path.name}: {name}: {argv}"


# --- compose: docker-compose config -------------------------------------------------------------


@pytest.fixture
def compose_config(docker_compose: str, tmp_path: Path) -> Iterator[Any]:
    """`docker-compose config` of some files with exactly the given variables (never the
    developer's deploy/.env or environment): (returncode, parsed config or None, stderr)."""

    def run(files: list[Path], variables: dict[str, str]) -> tuple[int, dict[str, Any] | None, str]:
        env_file = tmp_path / "test.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in variables.items()), encoding="utf-8")
        command = [docker_compose, "--env-file", str(env_file)]
        for f in files:
            command += ["-f", str(f)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
        done = subprocess.run(
            [*command, "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
        )
        config = yaml.safe_load(done.stdout) if done.returncode == 0 else None
        return done.returncode, config, done.stderr

    yield run


def test_compose_yaml_validates_with_postgres_and_the_server(compose_config: Any) -> None:
    code, config, err = compose_config(
        [COMPOSE], {"POSTGRES_PASSWORD": "s3cret", "MODELFORGE_ADMIN_TOKEN": "operator-token"}
    )
    assert code == 0, err
    assert set(config["services"]) == {"postgres", "server"}
    postgres, server = config["services"]["postgres"], config["services"]["server"]
    assert postgres["image"].startswith("postgres:16")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    assert server["depends_on"]["postgres"]["condition"] == "service_healthy"
    env = server["environment"]
    assert env["MODELFORGE_DATABASE_URL"] == "postgresql://modelforge:s3cret@postgres:5432/modelforge"
    assert env["MODELFORGE_ADMIN_TOKEN"] == "operator-token"
    assert env["MODELFORGE_STATE_DIR"] == STATE_DIR
    assert server["command"][:3] == ["serve", "--host", "0.0.0.0"]
    assert any(str(p).split(":")[-1].startswith("8080") for p in server["ports"]), server["ports"]
    assert f"modelforge-state:{STATE_DIR}:rw" in server["volumes"]
    assert config["volumes"]["modelforge-state"]["name"] == "modelforge-state"
    assert_confined(config, "docker-compose config compose.yaml")


def test_compose_yaml_refuses_to_run_without_a_database_password(compose_config: Any) -> None:
    code, _, err = compose_config([COMPOSE], {})
    assert code != 0
    assert "POSTGRES_PASSWORD" in err


def test_gpu_overlay_validates_and_adds_the_agent_with_the_intended_gpus(compose_config: Any) -> None:
    code, config, err = compose_config(
        [COMPOSE, COMPOSE_GPU], {"POSTGRES_PASSWORD": "s3cret", "MF_AGENT_GPUS": "1,GPU-5f3c0d1e"}
    )
    assert code == 0, err
    assert set(config["services"]) == {"postgres", "server", "agent"}
    agent = config["services"]["agent"]
    assert agent["command"] == ["agent", "run"]
    (device,) = agent["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    assert device["device_ids"] == ["1,GPU-5f3c0d1e"]
    env = agent["environment"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == "1,GPU-5f3c0d1e"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["MODELFORGE_SERVER_URL"] == "http://server:8080"
    # Its identity lives on its own state volume, not in the image.
    assert env["MODELFORGE_STATE_DIR"] == STATE_DIR
    assert f"modelforge-agent-state:{STATE_DIR}:rw" in agent["volumes"]
    assert config["volumes"]["modelforge-agent-state"]["name"] == "modelforge-agent-state"
    assert_confined(config, "docker-compose config compose.yaml + compose.gpu.yaml")


def test_gpu_overlay_alone_runs_an_agent_for_a_remote_server(compose_config: Any) -> None:
    code, config, err = compose_config([COMPOSE_GPU], {"MODELFORGE_SERVER_URL": "https://hw.example.com"})
    assert code == 0, err
    assert set(config["services"]) == {"agent"}
    agent = config["services"]["agent"]
    assert agent["environment"]["MODELFORGE_SERVER_URL"] == "https://hw.example.com"
    assert agent["environment"]["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert agent["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["all"]
    assert_confined(config, "docker-compose config compose.gpu.yaml")


# --- systemd units ------------------------------------------------------------------------------


def read_unit(path: Path) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text(encoding="utf-8"), source=str(path))
    return parser


def test_there_are_server_and_agent_units() -> None:
    names = {u.name for u in UNITS}
    assert {"modelforge-server.service", "modelforge-agent.service"} <= names, names


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_is_hardened_and_starts_a_real_command(unit: Path) -> None:
    service = read_unit(unit)["Service"]
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }
    for key, value in expected.items():
        assert service.get(key) == value, f"{unit.name}: {key}={service.get(key)}, expected {value}"
    assert (service.get("StateDirectory") or "").startswith("modelforge"), unit.name
    assert service.get("RestrictAddressFamilies"), unit.name
    assert service.get("DynamicUser") == "yes" or service.get("User") not in (None, "", "root", "0"), (
        f"{unit.name} runs as root"
    )
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "modelforge-hw", argv
    assert parse(argv[1:])  # raises on an unknown subcommand or flag


def test_server_unit_serves_without_observing_the_api_host() -> None:
    service = read_unit(DEPLOY / "systemd" / "modelforge-server.service")["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[1] == "serve" and "--no-startup-refresh" in argv
    assert service.get("StateDirectory") == "modelforge"
    assert service.get("PrivateDevices") == "yes"
    assert service.get("CapabilityBoundingSet") == ""


def _verifiable_copy(unit: Path, directory: Path) -> Path:
    """The unit with every Exec*= program that does not exist here replaced by a stub of the
    same name, so that `systemd-analyze verify` checks everything else strictly."""
    stubs = directory / "bin"
    stubs.mkdir(exist_ok=True)
    lines = []
    for line in unit.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^(Exec[A-Za-z]*=)([-@:+!]*)(\S+)(.*)$", line)
        if m and m.group(3).startswith("/") and not Path(m.group(3)).exists():
            stub = stubs / Path(m.group(3)).name
            stub.write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
            stub.chmod(0o755)
            line = f"{m.group(1)}{m.group(2)}{stub}{m.group(4)}"
        lines.append(line)
    copy = directory / unit.name
    copy.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return copy


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_verifies_with_systemd_analyze(unit: Path, systemd_analyze: str, tmp_path: Path) -> None:
    """`systemd-analyze verify` refuses a unit whose ExecStart program is missing, and the units
    name the installed console script (/opt/modelforge/bin/modelforge-hw), which does not exist
    on a test machine. Rather than filtering its error text (which would also hide real errors),
    the test verifies a temporary copy whose missing Exec*= programs are replaced by stubs of the
    same name; every other line is the unit's own. Unknown keys and unparsable values are only
    warnings to systemd (exit 0), so any output line about the unit fails the test too."""
    copy = _verifiable_copy(unit, tmp_path)
    done = subprocess.run(
        [systemd_analyze, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""},
    )
    output = (done.stdout + done.stderr).strip()
    about_unit = [line for line in output.splitlines() if unit.name in line or str(copy) in line]
    assert done.returncode == 0 and not about_unit, f"systemd-analyze verify {unit.name}:\n{output}"


def test_server_unit_exposure_stays_low(systemd_analyze: str, tmp_path: Path) -> None:
    """`systemd-analyze security --offline` scores the hardening (0 best, 10 worst)."""
    copy = _verifiable_copy(DEPLOY / "systemd" / "modelforge-server.service", tmp_path)
    done = subprocess.run(
        [systemd_analyze, "security", "--offline=yes", "--no-pager", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
    if m is None and "offline" in done.stderr:
        pytest.fail(f"this systemd-analyze has no offline security analysis: {done.stderr.strip()}")
    assert m is not None, done.stdout + done.stderr
    assert float(m.group(1)) <= 2.5, done.stdout


# --- the CLI the images and units start ---------------------------------------------------------


def test_console_script_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "api.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.startswith("modelforge-hw "), done.stdout + done.stderr
