"""The agent's clock: only observation and send times come from it; the server judges liveness by
its own clock. One function, so a test can run an agent whose clock is hours off."""

from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    return datetime.now(UTC)
