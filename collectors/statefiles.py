"""Small, durable, private files in a state directory (identity, credentials, tokens, spool).

Here, at the bottom of the layering, so the collectors (node identity), the agent (credential,
sequences, spool) and the server (operator token) share one careful implementation.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def fsync_directory(directory: Path) -> None:
    """Make a rename or link in `directory` durable (best effort where the filesystem refuses)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_private(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`, mode 0600, durable when this returns."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # the umask may only have narrowed it; be exact
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
