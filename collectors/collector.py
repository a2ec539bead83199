"""The one collector interface, and `observe`: one observation of a host from its collectors.

The server's local refresh and the agent both observe through `observe`, so a host is seen the
same way whichever of the two reports it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from datetime import datetime
from typing import Protocol, TypeVar

from collectors.observations import CollectorRun, HardwareObservation, HostObservation, NvmlScan

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


class Collector(Protocol[T_co]):
    """Something that observes one part of a host without blocking the event loop."""

    async def collect_async(self) -> T_co: ...


HostCollector = Collector[HostObservation]
NvmlCollector = Collector[NvmlScan]


async def _timed(name: str, work: Awaitable[T]) -> tuple[T | Exception, CollectorRun]:
    started = time.perf_counter()
    try:
        value = await work
    except Exception as exc:
        return exc, CollectorRun(name, False, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
    return value, CollectorRun(name, True, time.perf_counter() - started)


async def observe(host: HostCollector, nvml: NvmlCollector, observed_at: datetime) -> HardwareObservation:
    """Run both collectors concurrently, each to its end, and record how long each took and whether
    it failed. An exception is raised once both have finished, the host's first: a host that cannot
    be observed (`HostCollectionError`) means no observation at all."""
    (host_seen, host_run), (scan, nvml_run) = await asyncio.gather(
        _timed("system", host.collect_async()),
        _timed("nvml", nvml.collect_async()),
    )
    if isinstance(host_seen, Exception):
        raise host_seen
    if isinstance(scan, Exception):
        raise scan
    return HardwareObservation(
        observed_at=observed_at, host=host_seen, nvml=scan, collectors=[host_run, nvml_run]
    )
