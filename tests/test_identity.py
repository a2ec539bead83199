"""Node identity resolution, every rung of docs/architecture.md, "Identity"."""

from __future__ import annotations

import stat
import threading
import uuid
from pathlib import Path

import pytest

from collectors import identity
from collectors.identity import (
    NODE_IDENTITY_NAMESPACE,
    IdentityError,
    NodeIdentity,
    resolve_identity,
    running_in_container,
)

MACHINE_ID = "0123456789abcdef0123456789abcdef"
# uuid5(NODE_IDENTITY_NAMESPACE, MACHINE_ID), computed once: a change here re-keys every host node.
MACHINE_ID_KEY = "f44c90ca-2c48-5370-aeb2-3c7926d66be8"


@pytest.fixture
def machine_id_paths(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "etc" / "machine-id", tmp_path / "var" / "lib" / "dbus" / "machine-id"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_namespace_is_the_documented_constant() -> None:
    assert NODE_IDENTITY_NAMESPACE == uuid.uuid5(
        uuid.NAMESPACE_URL, "https://modelforge.dev/hardware-plane/node"
    )
    assert str(NODE_IDENTITY_NAMESPACE) == "827065fd-0f15-5150-bf6c-6a108101d32b"


# -- configured -------------------------------------------------------------------------------


def test_configured_id_wins_everywhere(tmp_path: Path, machine_id_paths: tuple[Path, Path]) -> None:
    write(machine_id_paths[0], MACHINE_ID)
    for in_container in (True, False):
        resolved = resolve_identity(
            configured="  gpu-node-07 \n",
            state_dir=tmp_path / "state",
            in_container=in_container,
            machine_id_paths=machine_id_paths,
        )
        assert resolved == NodeIdentity(key="gpu-node-07", source="configured")
    assert not (tmp_path / "state").exists()  # no state file is created when configured


@pytest.mark.parametrize(
    ("configured", "message"),
    [("", "empty"), ("   ", "empty"), ("x" * 129, "129 characters"), ("node\x00id", "non-printable")],
)
def test_invalid_configured_id(configured: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match=message):
        resolve_identity(configured=configured, state_dir=tmp_path, in_container=False)


def test_configured_id_of_128_characters_is_accepted(tmp_path: Path) -> None:
    key = "n" * 128
    assert resolve_identity(configured=key, state_dir=tmp_path, in_container=False).key == key


# -- container: state file --------------------------------------------------------------------


def test_container_creates_the_state_file_once_and_reuses_it(
    tmp_path: Path, machine_id_paths: tuple[Path, Path]
) -> None:
    write(machine_id_paths[0], MACHINE_ID)  # baked into the image: must be ignored
    state_dir = tmp_path / "modelforge-state" / "nested"
    first = resolve_identity(
        configured=None, state_dir=state_dir, in_container=True, machine_id_paths=machine_id_paths
    )
    assert first.source == "state_file"
    assert uuid.UUID(first.key).version == 4
    assert first.key != MACHINE_ID_KEY

    state_file = state_dir / "node-id"
    assert state_file.read_text().strip() == first.key
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    assert [p.name for p in state_dir.iterdir()] == ["node-id"]  # no temporary file left behind

    mtime = state_file.stat().st_mtime_ns
    second = resolve_identity(
        configured=None, state_dir=state_dir, in_container=True, machine_id_paths=machine_id_paths
    )
    assert second == first
    assert state_file.stat().st_mtime_ns == mtime  # reused, not rewritten


def test_container_reuses_an_existing_state_file(tmp_path: Path) -> None:
    write(tmp_path / "node-id", "11111111-2222-4333-8444-555555555555\n")
    resolved = resolve_identity(configured=None, state_dir=tmp_path, in_container=True)
    assert resolved == NodeIdentity(key="11111111-2222-4333-8444-555555555555", source="state_file")


def test_damaged_state_file_is_an_error_not_a_new_identity(tmp_path: Path) -> None:
    write(tmp_path / "node-id", "\n")
    with pytest.raises(IdentityError, match="remove it"):
        resolve_identity(configured=None, state_dir=tmp_path, in_container=True)
    assert (tmp_path / "node-id").read_text() == "\n"


def test_unwritable_state_dir_is_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory should be")
    with pytest.raises(IdentityError, match="MODELFORGE_NODE_ID"):
        resolve_identity(configured=None, state_dir=blocker / "sub", in_container=True)


def test_concurrent_first_starts_agree_on_one_identity(tmp_path: Path) -> None:
    barrier = threading.Barrier(8)
    keys: list[str] = []

    def start() -> None:
        barrier.wait()
        keys.append(identity.state_file_identity(tmp_path))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8
    assert len(set(keys)) == 1
    assert (tmp_path / "node-id").read_text().strip() == keys[0]


# -- host: machine ID -------------------------------------------------------------------------


def test_machine_id_gives_a_stable_uuid5(tmp_path: Path, machine_id_paths: tuple[Path, Path]) -> None:
    write(machine_id_paths[0], MACHINE_ID + "\n")
    first = resolve_identity(
        configured=None, state_dir=tmp_path / "state", in_container=False, machine_id_paths=machine_id_paths
    )
    second = resolve_identity(
        configured=None, state_dir=tmp_path / "state", in_container=False, machine_id_paths=machine_id_paths
    )
    assert first == second == NodeIdentity(key=MACHINE_ID_KEY, source="machine_id")
    assert uuid.UUID(first.key).version == 5
    assert not (tmp_path / "state").exists()  # a host needs no state file


@pytest.mark.parametrize("etc_content", [None, "", "  \n", "uninitialized\n"])
def test_falls_back_to_the_dbus_machine_id(
    etc_content: str | None, tmp_path: Path, machine_id_paths: tuple[Path, Path]
) -> None:
    if etc_content is not None:
        write(machine_id_paths[0], etc_content)
    write(machine_id_paths[1], MACHINE_ID)
    resolved = resolve_identity(
        configured=None, state_dir=tmp_path, in_container=False, machine_id_paths=machine_id_paths
    )
    assert resolved == NodeIdentity(key=MACHINE_ID_KEY, source="machine_id")


def test_etc_machine_id_comes_first(tmp_path: Path, machine_id_paths: tuple[Path, Path]) -> None:
    write(machine_id_paths[0], MACHINE_ID)
    write(machine_id_paths[1], "ffffffffffffffffffffffffffffffff")
    resolved = resolve_identity(
        configured=None, state_dir=tmp_path, in_container=False, machine_id_paths=machine_id_paths
    )
    assert resolved.key == MACHINE_ID_KEY


def test_no_identity_at_all_is_a_clear_error(tmp_path: Path, machine_id_paths: tuple[Path, Path]) -> None:
    write(machine_id_paths[0], "")
    with pytest.raises(IdentityError, match="MODELFORGE_NODE_ID") as raised:
        resolve_identity(
            configured=None, state_dir=tmp_path, in_container=False, machine_id_paths=machine_id_paths
        )
    assert str(machine_id_paths[1]) in str(raised.value)


def test_hostname_is_never_identity(
    tmp_path: Path, machine_id_paths: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    write(machine_id_paths[0], MACHINE_ID)
    keys = set()
    for hostname in ("node-a", "node-b"):
        monkeypatch.setattr("socket.gethostname", lambda hostname=hostname: hostname)
        monkeypatch.setattr("platform.node", lambda hostname=hostname: hostname)
        keys.add(
            resolve_identity(
                configured=None, state_dir=tmp_path, in_container=False, machine_id_paths=machine_id_paths
            ).key
        )
    assert keys == {MACHINE_ID_KEY}


# -- container detection ----------------------------------------------------------------------


def test_container_detection(tmp_path: Path) -> None:
    assert not running_in_container(tmp_path, environ={})
    assert running_in_container(tmp_path, environ={"container": "podman"})
    assert running_in_container(tmp_path, environ={"KUBERNETES_SERVICE_HOST": "10.0.0.1"})
    (tmp_path / ".dockerenv").touch()
    assert running_in_container(tmp_path, environ={})
    (tmp_path / ".dockerenv").unlink()
    write(tmp_path / "run" / ".containerenv", "")
    assert running_in_container(tmp_path, environ={})


def test_detected_container_uses_the_state_file(
    tmp_path: Path, machine_id_paths: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    write(machine_id_paths[0], MACHINE_ID)
    monkeypatch.setattr(identity, "running_in_container", lambda: True)
    assert (
        resolve_identity(configured=None, state_dir=tmp_path, machine_id_paths=machine_id_paths).source
        == "state_file"
    )
    monkeypatch.setattr(identity, "running_in_container", lambda: False)
    assert (
        resolve_identity(configured=None, state_dir=tmp_path, machine_id_paths=machine_id_paths).source
        == "machine_id"
    )
