"""Times and durations as an operator types them: `--since 1h`, `--as-of 2026-11-24T14:00:00`,
`--ttl 7d`."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import typer

from api.cli.errors import CliError

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_moment(text: str, now: datetime) -> datetime:
    """An ISO 8601 time (without an offset: UTC, the ledger's clock) or a duration before `now`
    (`90s`, `15m`, `1h`, `2d`, `1w`)."""
    match = _AGO.match(text)
    if match:
        return now - timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError as exc:
        raise CliError(
            f"{text!r} is neither an ISO 8601 time (2026-11-24T14:00:00Z) nor a duration (30m, 1h, 2d)"
        ) from exc
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def moment(text: str | None) -> datetime | None:
    """`parse_moment` counted back from now; None stays None."""
    return None if text is None else parse_moment(text, datetime.now(UTC))


def duration_option(name: str, help_: str) -> Any:
    """A `--ttl`/`--since` option taking 90s, 15m, 1h or 7d: `<duration>` in --help, where its
    value (seconds, a float) and a default in seconds would say nothing; `help_` names the default."""
    return typer.Option(name, parser=parse_duration, metavar="<duration>", show_default=False, help=help_)


def parse_duration(text: str | float) -> float:
    """'90', '90s', '15m', '1h', '7d' -> seconds (a usage error naming the flag otherwise). A
    number is seconds already: click passes an option's default through its parser too."""
    if isinstance(text, int | float):
        return float(text)
    match = _TTL.match(text.lower())
    if not match:
        raise typer.BadParameter(f"not a duration: {text!r} (examples: 90s, 15m, 1h, 7d)")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
