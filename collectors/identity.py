"""The stable identity key of this compute node (docs/architecture.md, "Identity").

Order: a configured ID, else (in a container) a UUID created once in the state directory, else
(on a host) a UUIDv5 of the OS machine ID, else an error. Hostname, container ID and image ID are
never used: they change on rename or redeploy, and would split one node into many.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Literal, TypeAlias

import msgspec

from collectors.statefiles import fsync_directory

IdentitySource: TypeAlias = Literal["configured", "state_file", "machine_id"]

# uuid5(NAMESPACE_URL, "https://modelforge.dev/hardware-plane/node"), written out so that no
# refactoring of this module can ever change every node's identity key.
NODE_IDENTITY_NAMESPACE = uuid.UUID("827065fd-0f15-5150-bf6c-6a108101d32b")
# Fixed: the same node and GPU give the same accelerator id on any machine, in any process.
ACCELERATOR_ID_NAMESPACE = uuid.UUID("0b9e3f5c-7a2d-5c41-8e36-9d1f2a4b6c80")
STATE_FILE_NAME = "node-id"
MAX_IDENTITY_LENGTH = 128
DEFAULT_MACHINE_ID_PATHS: tuple[Path, ...] = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


# Here rather than in the domain: the ledger's compact bodies leave out an id derived so
# (ledger/compact.py), and the ledger may not import the domain. Cached: every report derives
# each GPU's id again (uuid5 is a SHA-1 each); the cache holds a 10,000-node fleet of eight-GPU nodes.
@lru_cache(maxsize=131_072)
def accelerator_id_for(node_id: str, gpu_uuid: str) -> str:
    """Accelerators reconcile by (compute node, GPU UUID); the internal id is derived from both."""
    return str(uuid.uuid5(ACCELERATOR_ID_NAMESPACE, f"{node_id}/{gpu_uuid}"))


# systemd writes this placeholder before the first boot has committed a real machine ID.
_UNINITIALIZED_MACHINE_ID = "uninitialized"


class IdentityError(Exception):
    """No usable identity: the node must not be observed under a made-up one."""


class NodeIdentity(msgspec.Struct, frozen=True):
    key: str
    source: IdentitySource


def validate_identity_key(value: str, what: str = "MODELFORGE_NODE_ID") -> str:
    """The key with surrounding whitespace removed; IdentityError when it cannot be an identity."""
    key = value.strip()
    if not key:
        raise IdentityError(f"{what} is empty")
    if len(key) > MAX_IDENTITY_LENGTH:
        raise IdentityError(
            f"{what} is {len(key)} characters long; at most {MAX_IDENTITY_LENGTH} are allowed"
        )
    if not key.isprintable():
        raise IdentityError(f"{what} contains non-printable characters")
    return key


def running_in_container(root: Path = Path("/"), environ: Mapping[str, str] | None = None) -> bool:
    """Docker (/.dockerenv), Podman (/run/.containerenv), systemd-nspawn/LXC ($container), Kubernetes.

    Kubernetes with containerd leaves none of the files, and images often ship a baked-in
    /etc/machine-id shared by every container, so the service-host variable counts too.
    """
    env = os.environ if environ is None else environ
    if env.get("container") or env.get("KUBERNETES_SERVICE_HOST"):
        return True
    return (root / ".dockerenv").exists() or (root / "run" / ".containerenv").exists()


def resolve_identity(
    *,
    configured: str | None,
    state_dir: Path,
    in_container: bool | None = None,
    machine_id_paths: Sequence[Path] = DEFAULT_MACHINE_ID_PATHS,
) -> NodeIdentity:
    if configured is not None:
        return NodeIdentity(key=validate_identity_key(configured), source="configured")
    if in_container is None:
        in_container = running_in_container()
    if in_container:
        # Never fall through to the machine ID here: inside a container it belongs to the image.
        return NodeIdentity(key=state_file_identity(Path(state_dir)), source="state_file")
    machine_id = read_machine_id(machine_id_paths)
    if machine_id is not None:
        return NodeIdentity(key=str(uuid.uuid5(NODE_IDENTITY_NAMESPACE, machine_id)), source="machine_id")
    searched = ", ".join(str(p) for p in machine_id_paths)
    raise IdentityError(
        f"cannot determine a stable node identity: no machine ID in {searched}; "
        "set MODELFORGE_NODE_ID to a unique, stable ID for this node"
    )


def read_machine_id(paths: Sequence[Path] = DEFAULT_MACHINE_ID_PATHS) -> str | None:
    """The first non-empty, initialized machine ID among `paths`, stripped; None when none."""
    for path in paths:
        try:
            value = path.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:  # missing or unreadable: try the next source
            continue
        if value and value != _UNINITIALIZED_MACHINE_ID:
            return value
    return None


def state_file_identity(state_dir: Path) -> str:
    """The UUID kept in `state_dir/node-id`, created (once, atomically, mode 0600) if absent."""
    path = state_dir / STATE_FILE_NAME
    existing = _read_state_file(path)
    if existing is not None:
        return existing
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        return _create_state_file(path, str(uuid.uuid4()))
    except OSError as err:
        raise IdentityError(
            f"cannot create the node identity file {path}: {err}; mount a writable "
            "MODELFORGE_STATE_DIR (the modelforge-state volume) or set MODELFORGE_NODE_ID"
        ) from err


def _read_state_file(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as err:
        raise IdentityError(
            f"cannot read the node identity file {path}: {err}; make MODELFORGE_STATE_DIR a readable, "
            "writable directory or set MODELFORGE_NODE_ID"
        ) from err
    # A damaged file is an error, not a reason to mint a new identity (that would duplicate the node).
    try:
        return validate_identity_key(text, what=f"the node identity file {path}")
    except IdentityError as err:
        raise IdentityError(
            f"{err}; remove it to generate a new identity, or set MODELFORGE_NODE_ID"
        ) from err


def _create_state_file(path: Path, key: str) -> str:
    """Write `key` to a temporary file and link it into place; the first writer wins."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(key + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, 0o600)  # the umask may have narrowed it further, never widened; be exact
        try:
            # link() fails if another process created the file first; then its ID is the identity.
            os.link(temporary, path)
        except FileExistsError:
            existing = _read_state_file(path)
            if existing is None:
                raise
            return existing
        except OSError:
            # Some volume drivers do not support hard links; rename is still atomic.
            os.replace(temporary, path)
        fsync_directory(path.parent)
        return key
    finally:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
