"""Moments as whole microseconds since the Unix epoch: a datetime's own resolution, so exact both
ways. The time axis telemetry columns are stored (ledger/telemetry_hours.py) and bucketed
(domain/telemetry_buckets.py) on, as int64 arrays rather than a datetime object per sample."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def micros(at: datetime) -> int:
    """An aware moment as whole microseconds since the epoch."""
    return (at - EPOCH) // _MICROSECOND


def micros_of(times: Iterable[datetime]) -> npt.NDArray[np.int64]:
    return np.fromiter(((at - EPOCH) // _MICROSECOND for at in times), dtype=np.int64)


def moment(at_micros: int) -> datetime:
    """The aware UTC moment of whole microseconds since the epoch."""
    return EPOCH + at_micros * _MICROSECOND
