"""HardwareRepository: the read side as the one object the routes and the console take. It holds
the read module of each kind (nodes, accelerators, the fleet, the log, telemetry history, service
discovery, a GPU's history by UUID, lemon GPUs), which callers ask directly, and the one liveness
policy and clock by which they all judge."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import asyncpg

from api.services.clock import central_now
from api.services.reads.accelerators import AcceleratorReads
from api.services.reads.discovery import DiscoveryReads
from api.services.reads.events import EventReads
from api.services.reads.fleet import FleetReads
from api.services.reads.gpu_history import GpuHistoryReads
from api.services.reads.lemons import LemonReads
from api.services.reads.liveness import LivenessPolicy
from api.services.reads.nodes import NodeReads
from api.services.reads.telemetry import TelemetryReads


class HardwareRepository:
    def __init__(
        self,
        pool: asyncpg.Pool,
        liveness: LivenessPolicy | None = None,
        *,
        clock: Callable[[], datetime] = central_now,
    ) -> None:
        self.pool = pool
        self.liveness = liveness or LivenessPolicy()
        self.clock = clock
        self.nodes = NodeReads(pool, self.liveness, clock)
        self.accelerators = AcceleratorReads(pool)
        self.fleet = FleetReads(pool, self.liveness, clock)
        self.events = EventReads(pool)
        self.telemetry = TelemetryReads(pool)
        self.discovery = DiscoveryReads(pool, self.liveness, clock)
        self.gpu_history = GpuHistoryReads(pool)
        self.lemons = LemonReads(pool, clock)
