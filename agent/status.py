"""`modelforge-hw agent status`: what the agent on this host has left to send, has set aside and
last failed at, read from its state directory beside a running agent (no lock taken)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from agent.spool import Quarantine, Spool
from agent.state import (
    QUARANTINE_DIR,
    SPOOL_DIR,
    LastError,
    StateError,
    load_credential,
    load_status,
    lock_holder,
)


class StatusView(msgspec.Struct, frozen=True):
    """`agent status --json`: what an operator or a monitoring script checks."""

    state_dir: str
    enrolled: bool
    node_id: str | None
    server: str | None
    running_pid: int | None
    spooled: int
    spooled_by_stream: dict[str, int]
    quarantined: int  # kept in the quarantine folder now (the newest ones)
    quarantined_total: int  # ever, by this state directory
    quarantine_dir: str
    last_error: LastError | None


def agent_status(state_dir: Path) -> StatusView:
    """Read-only: works beside a running agent and takes no lock."""
    try:
        credential = load_credential(state_dir)
    except StateError:
        credential = None
    spool_dir, quarantine_dir = state_dir / SPOOL_DIR, state_dir / QUARANTINE_DIR
    spooled = Spool(spool_dir).entries() if spool_dir.is_dir() else []
    by_stream: dict[str, int] = {}
    for entry in spooled:
        by_stream[entry.stream] = by_stream.get(entry.stream, 0) + 1
    quarantined = len(Quarantine(quarantine_dir)) if quarantine_dir.is_dir() else 0
    status = load_status(state_dir)
    return StatusView(
        state_dir=str(state_dir),
        enrolled=credential is not None,
        node_id=credential.node_id if credential else None,
        server=credential.server if credential else None,
        running_pid=lock_holder(state_dir),
        spooled=len(spooled),
        spooled_by_stream=by_stream,
        quarantined=quarantined,
        quarantined_total=max(status.quarantined_total, quarantined),
        quarantine_dir=str(quarantine_dir),
        last_error=status.last_error,
    )
