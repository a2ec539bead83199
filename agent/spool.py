"""The durable, bounded spool: every report is written here (one file, fsynced) before it is sent,
and removed only when the server has answered it for good. So a report survives a server outage,
an agent restart and a crash, and the exact bytes are retried (an unchanged retry is idempotent).

Files are named `<order>-<stream>-<sequence>.json` with a zero-padded global order, so a directory
listing is the send order. When the spool is full, the oldest telemetry report is dropped first
(inventory reports only when no telemetry is left); each drop is logged and leaves a sequence gap
that the server records.

The quarantine (`Quarantine`) is where a report goes that the server refused for good: moved out
of the spool (so the reports behind it keep flowing) together with the server's answer, for an
operator to look at. It keeps the newest reports only, so a server that refuses everything cannot
fill the disk.
"""

from __future__ import annotations

import os
import re
import uuid
from datetime import datetime
from pathlib import Path

import msgspec
import structlog

from collectors.statefiles import fsync_directory, write_private

log = structlog.get_logger(__name__)

_NAME = re.compile(r"^(\d{16})-([a-z]+)-(\d+)\.json$")


class SpoolEntry(msgspec.Struct, frozen=True, order=True):
    order: int
    stream: str
    sequence: int
    name: str


def entries_in(directory: Path) -> list[SpoolEntry]:
    """The reports in a spool or quarantine directory, in send order (their names' order)."""
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            found.append(SpoolEntry(int(m.group(1)), m.group(2), int(m.group(3)), name))
    return sorted(found)


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
        return entries_in(self.directory)

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


MAX_QUARANTINED = 100
MAX_ANSWER_BYTES = 64 * 1024
ANSWER_SUFFIX = ".answer.json"


class QuarantineAnswer(msgspec.Struct, frozen=True):
    """Kept next to a quarantined report: why it was moved aside."""

    quarantined_at: datetime
    stream: str
    sequence: int
    status: int | None
    detail: str
    attempts: int
    answer: str  # the server's response body (truncated)


class Quarantine:
    def __init__(self, directory: Path, max_reports: int = MAX_QUARANTINED) -> None:
        self.directory = directory
        self.max_reports = max(1, max_reports)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def entries(self) -> list[SpoolEntry]:
        return entries_in(self.directory)

    def __len__(self) -> int:
        return len(self.entries())

    def answer(self, entry: SpoolEntry) -> QuarantineAnswer | None:
        try:
            raw = (self.directory / (entry.name + ANSWER_SUFFIX)).read_bytes()
            return msgspec.json.decode(raw, type=QuarantineAnswer)
        except (OSError, msgspec.MsgspecError):
            return None

    def add(self, spool: Spool, entry: SpoolEntry, answer: QuarantineAnswer) -> None:
        """Move a spooled report here with the server's answer. The answer is written first: a
        crash in between leaves the report in the spool, to be refused and moved again."""
        write_private(self.directory / (entry.name + ANSWER_SUFFIX), msgspec.json.encode(answer))
        try:
            os.replace(spool.directory / entry.name, self.directory / entry.name)
        except FileNotFoundError:
            pass  # dropped by the spool's bound meanwhile; the answer still says what happened
        fsync_directory(self.directory)
        fsync_directory(spool.directory)
        for old in self.entries()[: -self.max_reports]:
            (self.directory / old.name).unlink(missing_ok=True)
            (self.directory / (old.name + ANSWER_SUFFIX)).unlink(missing_ok=True)
            log.warning(
                "quarantine.pruned",
                stream=old.stream,
                sequence=old.sequence,
                reason=f"the quarantine keeps the newest {self.max_reports} reports",
            )
