"""The central clock: when a report was received, an operator acted, and until when a liveness
verdict holds. Each service takes a clock as a parameter, so a test can move it; this is the
default they all share."""

from __future__ import annotations

from datetime import UTC, datetime


def central_now() -> datetime:
    return datetime.now(UTC)
