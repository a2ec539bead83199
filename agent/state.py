"""What the agent keeps in its state directory (`MODELFORGE_STATE_DIR`), all written atomically
(temporary file, fsync, rename, fsync of the directory) and readable by its owner only:

    agent-credential.json   the node credential from enrollment (mode 0600; a secret)
    agent-sequences.json    the last sequence used per stream, and the spool order counter
    agent-spool/            reports not yet accepted by the server (see agent.spool)
    agent-quarantine/       reports the server refused for good, each with its answer
    agent-status.json       counters and the last error, for `agent status`
    agent.lock              held (flock) by the one agent process using this directory
    node-id                 the identity file (containers; collectors.identity)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from datetime import datetime
from pathlib import Path

import msgspec

from collectors.statefiles import write_private

CREDENTIAL_FILE = "agent-credential.json"
SEQUENCES_FILE = "agent-sequences.json"
SPOOL_DIR = "agent-spool"
QUARANTINE_DIR = "agent-quarantine"
STATUS_FILE = "agent-status.json"
LOCK_FILE = "agent.lock"


class StateError(Exception):
    """The state directory cannot be used as it is; the message says what to do."""


class Credential(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The agent's node credential. `credential` is the secret: never logged, never printed."""

    server: str
    node_id: str
    identity_key: str
    credential_id: str
    credential: str
    enrolled_at: datetime

    def __repr__(self) -> str:  # keep the secret out of any accidental repr in a log or traceback
        return f"Credential(node_id={self.node_id!r}, credential_id={self.credential_id!r})"


def load_credential(state_dir: Path) -> Credential | None:
    path = state_dir / CREDENTIAL_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc}") from exc
    try:
        return msgspec.json.decode(raw, type=Credential)
    except msgspec.MsgspecError as exc:
        raise StateError(f"{path} is damaged ({exc}); enroll again with --force") from exc


def save_credential(state_dir: Path, credential: Credential) -> Path:
    path = state_dir / CREDENTIAL_FILE
    write_private(path, msgspec.json.encode(credential))
    return path


class _Counters(msgspec.Struct):
    order: int = 0
    streams: dict[str, int] = {}


class Sequences:
    """Per-stream sequence numbers that survive restarts and are never reused: a number is
    persisted (fsync) before the report that carries it is written to the spool, so a crash in
    between costs a gap (which the server accepts and records), never a reuse."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / SEQUENCES_FILE
        self._counters = self._load()

    def _load(self) -> _Counters:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return _Counters()
        try:
            return msgspec.json.decode(raw, type=_Counters)
        except msgspec.MsgspecError as exc:
            # Guessing would risk reusing numbers; the operator decides (see the deployment docs).
            raise StateError(
                f"{self.path} is damaged ({exc}); enroll again with --force to continue above the "
                "server's last accepted sequences"
            ) from exc

    def last(self, stream: str) -> int:
        return self._counters.streams.get(stream, 0)

    def allocate(self, stream: str) -> tuple[int, int]:
        """(spool order, sequence) for the next report of `stream`, persisted before returning."""
        counters = _Counters(
            order=self._counters.order + 1,
            streams={**self._counters.streams, stream: self.last(stream) + 1},
        )
        write_private(self.path, msgspec.json.encode(counters))
        self._counters = counters
        return counters.order, counters.streams[stream]

    def reset(self, streams: dict[str, int]) -> None:
        """Start over at the server's positions: only for a different node than before (its
        numbers were another node's)."""
        counters = _Counters(order=self._counters.order, streams=dict(streams))
        write_private(self.path, msgspec.json.encode(counters))
        self._counters = counters

    def raise_to(self, floors: dict[str, int]) -> bool:
        """Continue above the server's last accepted sequences (after enrollment, or a 409 that
        says our numbers fell behind, e.g. a restored backup of the state directory)."""
        streams = dict(self._counters.streams)
        changed = False
        for stream, floor in floors.items():
            if floor > streams.get(stream, 0):
                streams[stream] = floor
                changed = True
        if changed:
            counters = _Counters(order=self._counters.order, streams=streams)
            write_private(self.path, msgspec.json.encode(counters))
            self._counters = counters
        return changed


# --- one agent per state directory -----------------------------------------------------------------


class StateLocked(StateError):
    """Another process holds the state directory."""


class StateLock:
    """An exclusive flock on `<state>/agent.lock`, holding the owner's pid. The kernel releases it
    when the process dies in any way (kill -9 included), so a stale lock file never blocks."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> StateLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateError(f"cannot use the state directory {self.path.parent}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"pid {holder}" if holder else "another process"
            raise StateLocked(
                f"the state directory {self.path.parent} is in use by another agent ({who}); "
                "one agent per state directory"
            ) from None
        # Ours now: record who holds it, for the message above and `agent status`.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def lock_holder(state_dir: Path) -> int | None:
    """The pid of the agent running on the state directory, or None. Informational only: it reads
    the pid rather than probing the lock, so that `agent status` can never make a starting agent
    find the lock taken."""
    try:
        fd = os.open(state_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        pid = _read_pid(fd)
    finally:
        os.close(fd)
    if pid is None:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # killed without a chance to clear the file (kill -9)
    except PermissionError:
        pass  # alive, another user's
    return pid


# --- what `agent status` shows -----------------------------------------------------------------------


class LastError(msgspec.Struct, frozen=True):
    at: datetime
    stream: str
    sequence: int
    status: int | None
    detail: str


class AgentStatus(msgspec.Struct, frozen=True):
    """Counters that outlive the process (the spool and the quarantine folder are counted live)."""

    quarantined_total: int = 0
    last_error: LastError | None = None


def load_status(state_dir: Path) -> AgentStatus:
    try:
        return msgspec.json.decode((state_dir / STATUS_FILE).read_bytes(), type=AgentStatus)
    except (OSError, msgspec.MsgspecError):
        return AgentStatus()  # informational only: a damaged file starts the counters again


def save_status(state_dir: Path, status: AgentStatus) -> None:
    write_private(state_dir / STATUS_FILE, msgspec.json.encode(status))
