"""Lemon GPUs: the GPUs that keep failing wherever they are put, ranked by failures per day of
service (docs/lemons.md). Pure: the failures read from the log and each GPU's time on each node
in, the ranking out; no I/O.

A failure is one health transition into `failed` (`ACCELERATOR_HEALTH_CHANGED` with `after` =
`failed`), whatever rule or policy decided it: one failure episode counts once however many XIDs
or ECC errors it took, and a GPU that stays failed does not pile up failures while it sits there.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta

import msgspec

DAY = timedelta(days=1)
# A GPU seen for an hour with one failure is one failure per day, not 24: the time in service is
# counted as at least a day, so a new GPU's first failure cannot outrank a repeat offender.
MIN_SERVICE_DAYS = 1.0
DEFAULT_SINCE = "90d"
# Ten years back is older than any GPU in service; further is a typo.
MAX_SPAN = timedelta(days=3660)
_DURATION = re.compile(r"^([0-9]{1,7})([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class SinceRefused(ValueError):
    """A `since` that names no usable window; the text says why, for the operator."""


class Failure(msgspec.Struct, frozen=True):
    """One failure of a GPU as the log holds it: the event, when it was received (the central
    clock), on which node and which of its accelerators, and the reason codes of the verdict."""

    global_position: int
    event_type: str
    at: datetime
    node_id: str
    accelerator_id: str
    uuid: str
    reasons: list[str]


class Tenure(msgspec.Struct, frozen=True):
    """A GPU's time on one node: first seen there to last seen there (its last sample's receive
    time while it is present, the time it went missing after)."""

    node_id: str
    first_seen_at: datetime
    last_seen_at: datetime


class Lemon(msgspec.Struct, frozen=True):
    uuid: str
    failures: int
    service_days: float  # in the window, on every node together
    failures_per_day: float  # failures / max(service_days, MIN_SERVICE_DAYS)
    evidence: list[Failure]  # in the order of the log


def since_of(text: str, now: datetime) -> datetime:
    """What an operator types for the window's start: a duration back from now (`90d`, `12h`,
    `2w`; units s, m, h, d, w) or an RFC 3339 time (without an offset: UTC), checked as
    `checked_since` checks it. SinceRefused for anything else."""
    value = text.strip()
    match = _DURATION.match(value)
    if match is not None:
        seconds = int(match.group(1)) * _UNITS[match.group(2)]
        if seconds == 0:
            raise SinceRefused(f"since {value!r} is an empty window: give a duration above 0")
        if seconds > MAX_SPAN.total_seconds():
            raise SinceRefused(f"since {value!r} is more than {MAX_SPAN.days} days back")
        return now - timedelta(seconds=seconds)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise SinceRefused(
            f"since {value!r} is neither a duration (90d, 12h, 2w) nor an RFC 3339 time"
        ) from None
    return checked_since(moment, now)


def checked_since(moment: datetime, now: datetime) -> datetime:
    """The window's start as given (without an offset: UTC); SinceRefused when it is not before
    now or more than ten years back."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    if moment >= now:
        raise SinceRefused(f"since {moment.isoformat()} is not before now ({now.isoformat()})")
    if now - moment > MAX_SPAN:
        raise SinceRefused(f"since {moment.isoformat()} is more than {MAX_SPAN.days} days back")
    return moment


def service_days(tenures: Iterable[Tenure], since: datetime, until: datetime) -> float:
    """Days in service within [since, until): the union of the GPU's times on its nodes, each cut
    to the window (a GPU is in one host at a time, but two rows that overlap count once)."""
    spans = sorted(
        (max(t.first_seen_at, since), min(t.last_seen_at, until))
        for t in tenures
        if t.last_seen_at > since and t.first_seen_at < until
    )
    total = timedelta(0)
    start: datetime | None = None
    end: datetime | None = None
    for s, e in spans:
        if e <= s:
            continue
        if end is None or s > end:
            if start is not None and end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if start is not None and end is not None:
        total += end - start
    return total / DAY


def rank(
    failures: Sequence[Failure], tenures: Mapping[str, Sequence[Tenure]], since: datetime, until: datetime
) -> list[Lemon]:
    """Every GPU with a failure in [since, until), most failures per day of service first; ties:
    more failures first, then by UUID (a stable order for the same log)."""
    by_gpu: dict[str, list[Failure]] = {}
    for f in sorted(failures, key=lambda f: f.global_position):
        if since <= f.at < until:
            by_gpu.setdefault(f.uuid, []).append(f)
    lemons = []
    for gpu_uuid, evidence in by_gpu.items():
        days = service_days(tenures.get(gpu_uuid, ()), since, until)
        lemons.append(
            Lemon(
                uuid=gpu_uuid,
                failures=len(evidence),
                service_days=days,
                failures_per_day=len(evidence) / max(days, MIN_SERVICE_DAYS),
                evidence=evidence,
            )
        )
    return sorted(lemons, key=lambda x: (-x.failures_per_day, -x.failures, x.uuid))
