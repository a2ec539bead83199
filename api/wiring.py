"""The one place that builds the services: the server (`api.http.server`), the CLI (`api.cli`)
and the tests all call `build_services`, so a service is constructed the same way everywhere."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from api.config import ServerConfig
from api.services.audit import AuditRepository
from api.services.credentials import CredentialService
from api.services.decommission import DecommissionService
from api.services.enrollment import EnrollmentService
from api.services.inventory import HardwareInventoryService
from api.services.reads.hot import HardwareReads
from api.services.reads.liveness import LivenessPolicy
from api.services.reads.rendered import DEFAULT_MAX_BYTES, RenderedReads
from api.services.reads.repository import HardwareRepository
from api.services.reports import REPORT_TRANSACTIONS, ReportService
from api.services.webhooks import WebhookService
from collectors.identity import NodeIdentity, resolve_identity
from collectors.nvml import NvidiaNvmlCollector
from collectors.system import SystemHostCollector
from ledger.schema import migrate
from ledger.state_cache import STATE_CACHE_STREAMS
from ledger.store import EventStore
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild_outdated


class Services:
    """Every service of one process, over one pool."""

    def __init__(
        self,
        inventory: HardwareInventoryService,
        repository: HardwareRepository,
        *,
        rendered_reads_bytes: int = DEFAULT_MAX_BYTES,
        report_transactions: int = REPORT_TRANSACTIONS,
        webhook_allow_private: bool = False,
    ) -> None:
        pool = inventory.pool
        self.pool = pool
        self.inventory = inventory
        # The agent plane: credentials are what enrollment issues and what every report is
        # checked against, so both are given the one instance.
        self.credentials = CredentialService(inventory)
        self.enrollment = EnrollmentService(inventory, self.credentials)
        self.reports = ReportService(inventory, self.credentials, report_transactions=report_transactions)
        self.decommission = DecommissionService(inventory)
        self.repository = repository
        # The read side, on the repository's pool: the primary's, or a read standby's. The rendered
        # reads probe the log where they load their rows, so what they keep is never behind it.
        self.audit = AuditRepository(repository.pool, repository.liveness)
        # Node and accelerator-page reads rendered once per change (api/services/reads/rendered.py).
        self.rendered = RenderedReads(repository.pool, max_bytes=rendered_reads_bytes)
        self.reads = HardwareReads(self.rendered, repository)
        self.webhooks = WebhookService(inventory.store, allow_private=webhook_allow_private)


def event_store(pool: asyncpg.Pool, state_cache_streams: int = STATE_CACHE_STREAMS) -> EventStore:
    """The event store with every inline projection."""
    return EventStore(pool, ALL_PROJECTIONS, state_cache_streams=state_cache_streams)


def local_identity(config: ServerConfig) -> NodeIdentity:
    return resolve_identity(configured=config.node_id, state_dir=config.state_dir)


def build_service(
    pool: asyncpg.Pool, config: ServerConfig, *, nvml: object = None, root: Path | None = None
) -> HardwareInventoryService:
    """The inventory service with this host's collectors (a server that may refresh itself)."""
    host = SystemHostCollector(config.state_dir, root or Path("/"), timeout_seconds=config.collector_timeout)
    return HardwareInventoryService(
        event_store(pool, config.state_cache_streams),
        identity=local_identity(config),
        host_collector=host,
        nvml_collector=NvidiaNvmlCollector(nvml=nvml, timeout_seconds=config.collector_timeout),
    )


def build_services(
    pool: asyncpg.Pool,
    config: ServerConfig | None = None,
    *,
    nvml: object = None,
    inventory: HardwareInventoryService | None = None,
    repository: HardwareRepository | None = None,
    read_pool: asyncpg.Pool | None = None,
) -> Services:
    """Every service over `pool`. With `config`, the inventory service has this host's collectors
    and the read side its liveness policy; without, the services only touch the database (the
    CLI's `token`, `lease`, `decommission` commands). With `read_pool` (a hot standby), the read
    side reads there; every write, and what a write decides on, stays on `pool`."""
    if inventory is None:
        inventory = (
            build_service(pool, config, nvml=nvml)
            if config is not None
            else HardwareInventoryService(event_store(pool))
        )
    if repository is None:
        liveness = LivenessPolicy(config.stale_after, config.offline_after) if config is not None else None
        repository = HardwareRepository(read_pool or pool, liveness)
    budget = config.rendered_reads_mib * 2**20 if config is not None else DEFAULT_MAX_BYTES
    lanes = config.report_transactions if config is not None else REPORT_TRANSACTIONS
    return Services(
        inventory,
        repository,
        rendered_reads_bytes=budget,
        report_transactions=lanes,
        webhook_allow_private=config.webhook_allow_private if config is not None else False,
    )


async def prepare_database(pool: asyncpg.Pool) -> int:
    """Bring a database to this release: the schema's numbered steps, then a rebuild from the log
    of every read model whose shape changed (docs/upgrades.md). Returns the schema version.
    A hot standby is read as it is: its primary migrates and rebuilds, replication brings both."""
    async with pool.acquire() as conn:
        version = await migrate(conn)
        standby = await conn.fetchval("SELECT pg_is_in_recovery()")
    if not standby:
        await rebuild_outdated(pool, ALL_PROJECTIONS)
    return version
