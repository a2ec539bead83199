"""Pure presentation for the console: how a fact, an age or an event reads to an operator.

No I/O here, so every rule is tested without a server (tests/test_console_views.py).
"""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import urlsplit


def age(then: datetime | None, now: datetime | None = None) -> str:
    """How long ago, in the largest unit that keeps it short ("never" when it never happened)."""
    if then is None:
        return "never"
    seconds = int(((now or datetime.now(UTC)) - then).total_seconds())
    if seconds < 0:
        return "in the future"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def skew(seconds: float) -> str:
    """A clock skew to a tenth of a second: a skew that rounds to nothing reads "0.0 s", not
    "-0.0 s"."""
    return f"{round(seconds, 1) + 0.0:.1f} s"


def moment(value: datetime | None) -> str:
    """UTC, to the second: the ledger's clock, the same for every reader."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def parse_moment(text: str | None) -> datetime | None:
    """A form's date-time (`2026-12-01T02:10`, seconds optional) or ISO 8601; no offset means UTC.
    ValueError, naming the expected form, for anything else."""
    if text is None or not text.strip():
        return None
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a date and time (expected e.g. 2026-12-01T02:10, UTC)") from exc
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def form_moment(value: datetime | None) -> str:
    """A moment as a datetime-local input shows it (UTC, to the second)."""
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S")


def destination(url: str) -> str:
    """A webhook URL's origin (scheme://host:port): its path and query may hold a receiver's token."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{parts.hostname or ''}" + (f":{port}" if port else "")
