"""The durable, bounded spool: every report is written here (one file, fsynced) before it is sent,
and removed only when the server has answered it for good. So a report survives a server outage,
an agent restart and a crash, and the exact bytes are retried (an unchanged retry is idempotent).

Files are named `<order>-<stream>-<sequence>.json` with a zero-padded global order, so a directory
listing is the send order. When the spool is full, the oldest telemetry report is dropped first
(inventory reports only when no telemetry is left); each drop is logged and leaves a sequence gap
that the server records.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import msgspec
import structlog

from collectors.statefiles import fsync_directory

log = structlog.get_logger(__name__)

_NAME = re.compile(r"^(\d{16})-([a-z]+)-(\d+)\.json$")


class SpoolEntry(msgspec.Struct, frozen=True, order=True):
    order: int
    stream: str
    sequence: int
    name: str


class Spool:
    def __init__(self, directory: Path, max_reports: int = 1000) -> None:
        if max_reports < 1:
            raise ValueError("the spool must hold at least one report")
        self.directory = directory
        self.max_reports = max_reports
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.in_flight: str | None = None
        for stray in self.directory.glob(".*.tmp"):  # a crash while writing: never complete
            stray.unlink(missing_ok=True)

    def entries(self) -> list[SpoolEntry]:
        found = []
        for name in os.listdir(self.directory):
            m = _NAME.match(name)
            if m:
                found.append(SpoolEntry(int(m.group(1)), m.group(2), int(m.group(3)), name))
        return sorted(found)

    def __len__(self) -> int:
        return len(self.entries())

    def add(self, order: int, stream: str, sequence: int, body: bytes) -> list[SpoolEntry]:
        """Write one report durably; returns the reports dropped to stay within the bound."""
        name = f"{order:016d}-{stream}-{sequence}.json"
        tmp = self.directory / f".{name}.{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_directory(self.directory)
        return self._enforce_bound()

    def _enforce_bound(self) -> list[SpoolEntry]:
        entries = self.entries()
        dropped: list[SpoolEntry] = []
        while len(entries) > self.max_reports:
            candidates = [e for e in entries if e.name != self.in_flight]
            victim = next((e for e in candidates if e.stream == "telemetry"), None) or (
                candidates[0] if candidates else None
            )
            if victim is None:
                break
            self.remove(victim)
            entries.remove(victim)
            dropped.append(victim)
            log.warning(
                "spool.dropped",
                stream=victim.stream,
                sequence=victim.sequence,
                reason=f"spool full ({self.max_reports} reports); the oldest telemetry goes first",
            )
        return dropped

    def read(self, entry: SpoolEntry) -> bytes | None:
        try:
            return (self.directory / entry.name).read_bytes()
        except FileNotFoundError:
            return None

    def remove(self, entry: SpoolEntry) -> None:
        (self.directory / entry.name).unlink(missing_ok=True)
