"""Pure presentation for the console: how a fact, an age or an event reads to an operator.

No I/O here, so every rule is tested without a server (tests/test_console_views.py).
"""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import urlsplit

from api.services.reads.bodies import HealthSignalsBody
from collectors.facts import Fact
from collectors.gpu_health import CLOCK_EVENT_REASONS, ECC_COUNTERS, REMAPPED_ROWS, RETIRED_PAGES


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


def moment(value: datetime | None) -> str:
    """UTC, to the second: the ledger's clock, the same for every reader."""
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ordered(group: str, facts: dict[str, Fact], names: tuple[str, ...]) -> list[tuple[str, Fact]]:
    # The collector's order first (how nvidia-smi -q lists them), then anything newer.
    keys = [n for n in names if n in facts] + sorted(set(facts) - set(names))
    return [(f"{group}.{k}", facts[k]) for k in keys]


def signal_rows(signals: HealthSignalsBody) -> list[tuple[str, Fact]]:
    """The health signals as (name, fact) rows, grouped as docs/gpu-health.md lists them."""
    return [
        ("ecc_mode", signals.ecc_mode),
        *_ordered("ecc_errors", signals.ecc_errors, ECC_COUNTERS),
        *_ordered("remapped_rows", signals.remapped_rows, REMAPPED_ROWS),
        *_ordered("retired_pages", signals.retired_pages, RETIRED_PAGES),
        ("pcie_replay_count", signals.pcie_replay_count),
        *_ordered("clock_event_reasons", signals.clock_event_reasons, tuple(CLOCK_EVENT_REASONS)),
        ("xid_events", signals.xid_events),
    ]


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
