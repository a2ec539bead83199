"""The compute-node agent's run: two loops, collect -> spool and spool -> send.

Outbound only: the agent opens no port; it calls the central API over HTTP(S). It observes the host
with the same collectors as the local refresh (`collectors.collector.observe`) and sends what they
observed; the server reconciles it through the same service. See docs/NODE_AGENT_PROTOCOL.md.

- Collection runs every `interval` seconds whether or not the server answers; each report gets
  the next sequence of its stream and is written to the durable spool before any send
  (agent/reports.py).
- The sender sends the spool oldest first, one report at a time, and settles each by the server's
  answer (agent/sending.py); on a transient failure it waits and tries again.
- 401 (credential invalid or revoked), 410 (node decommissioned): the agent stops publishing,
  says why in its log, and exits with EXIT_STOPPED.
- One agent per state directory: `agent run` and `agent enroll` hold an flock on it.
- Nothing the server says crashes the agent; the credential is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from pathlib import Path

import httpx
import structlog

from agent import clock
from agent.client import servers_for, tls_verify, warn_plain_http
from agent.config import AgentConfig
from agent.enrollment import resolve_agent_identity
from agent.errors import EXIT_OK, EXIT_STOPPED, EXIT_UNSENT, AgentError
from agent.reports import ReportWriter
from agent.sanitize import sanitize_observation
from agent.sending import ReportSender
from agent.spool import Quarantine, Spool, SpoolEntry
from agent.state import (
    QUARANTINE_DIR,
    SPOOL_DIR,
    Credential,
    Sequences,
    StateError,
    StateLock,
    load_credential,
)
from collectors.collector import HostCollector, NvmlCollector, observe
from collectors.identity import NodeIdentity
from collectors.nvml import NvidiaNvmlCollector
from collectors.observations import HardwareObservation, HostCollectionError
from collectors.system import SystemHostCollector

log = structlog.get_logger(__name__)


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        *,
        host_collector: HostCollector | None = None,
        nvml_collector: NvmlCollector | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        self.state_dir = config.state_dir
        self.host_collector = host_collector or SystemHostCollector(
            config.state_dir, Path("/"), timeout_seconds=config.collector_timeout
        )
        self.nvml_collector = nvml_collector or NvidiaNvmlCollector(timeout_seconds=config.collector_timeout)
        self.transport = transport
        self.stopping = asyncio.Event()
        self.wake = asyncio.Event()
        self.exit_code = EXIT_OK
        self._collection_done = False

    # -- setup ---------------------------------------------------------------------------------

    def _prepare(self) -> tuple[Credential, NodeIdentity, Sequences, Spool, Quarantine]:
        try:
            credential = load_credential(self.state_dir)
        except StateError as exc:
            raise AgentError(str(exc)) from exc
        if credential is None:
            raise AgentError(
                f"not enrolled: no credential in {self.state_dir}; run `modelforge-hw agent enroll "
                "--server URL --token TOKEN` first"
            )
        identity = resolve_agent_identity(self.state_dir, self.config.node_id)
        if identity.key != credential.identity_key:
            raise AgentError(
                f"this host's identity ({identity.source}) is not the one the credential in "
                f"{self.state_dir} was issued for (node {credential.node_id}); enroll again with --force",
                EXIT_STOPPED,
            )
        try:
            sequences = Sequences(self.state_dir)
            spool = Spool(self.state_dir / SPOOL_DIR, self.config.spool_max)
            quarantine = Quarantine(self.state_dir / QUARANTINE_DIR)
        except (OSError, StateError) as exc:
            raise AgentError(f"cannot use the state directory {self.state_dir}: {exc}") from exc
        return credential, identity, sequences, spool, quarantine

    # -- run -----------------------------------------------------------------------------------

    async def run(self) -> int:
        try:
            lock = StateLock(self.state_dir).acquire()
        except StateError as exc:
            raise AgentError(str(exc)) from exc
        try:
            return await self._run()
        finally:
            lock.release()

    async def _run(self) -> int:
        credential, identity, sequences, spool, quarantine = self._prepare()
        self.spool = spool
        self.writer = ReportWriter(
            credential, identity, sequences, spool, inventory_every=self.config.inventory_every
        )
        servers = servers_for(self.config.servers, credential)
        for server in servers:
            warn_plain_http(server)
        log.info(
            "agent.started",
            node_id=credential.node_id,
            servers=servers,
            interval=self.config.interval,
            spooled=len(spool),
        )
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
                installed.append(sig)
        try:
            async with httpx.AsyncClient(
                verify=tls_verify(self.config.ca_file),
                timeout=self.config.request_timeout,
                transport=self.transport,
                follow_redirects=False,
            ) as client:
                self.sender = ReportSender(self.config, credential, spool, sequences, quarantine, client)
                collector = asyncio.create_task(self._collect_loop(), name="agent-collect")
                sender = asyncio.create_task(self._send_loop(), name="agent-send")
                await asyncio.wait({collector, sender}, return_when=asyncio.FIRST_COMPLETED)
                if self.config.once and not sender.done():
                    await asyncio.wait({sender})
                self.stopping.set()
                self.wake.set()
                # A send in flight may finish (its report stays spooled either way: an unchanged
                # retry is idempotent), but shutdown does not wait on a slow server for long.
                _, pending = await asyncio.wait({collector, sender}, timeout=self.config.request_timeout)
                for task in pending:
                    task.cancel()
                await asyncio.gather(collector, sender, return_exceptions=True)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
        log.info("agent.stopped", exit_code=self.exit_code, spooled=len(spool))
        return self.exit_code

    def stop(self, reason: str = "requested") -> None:
        if not self.stopping.is_set():
            log.info("agent.stopping", reason=reason)
        self.stopping.set()
        self.wake.set()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await self.stopping.wait()

    # -- collection ----------------------------------------------------------------------------

    async def observe(self) -> HardwareObservation:
        t0 = time.perf_counter()
        obs = await observe(self.host_collector, self.nvml_collector, clock.now())
        log.debug("agent.collected", seconds=round(time.perf_counter() - t0, 3))
        return obs

    async def collect_once(self) -> SpoolEntry | None:
        try:
            obs = sanitize_observation(await self.observe())
        except HostCollectionError as exc:
            log.warning("agent.collection_failed", error=str(exc), hint="no report this round")
            return None
        entry = self.writer.write(obs)
        self.wake.set()
        return entry

    async def _collect_loop(self) -> None:
        while not self.stopping.is_set():
            started = time.monotonic()
            try:
                await self.collect_once()
            except Exception as exc:  # a broken collection round must never end the agent
                log.error("agent.collect_error", error=f"{type(exc).__name__}: {exc}")
            if self.config.once:
                break
            await self._sleep(self.config.interval - (time.monotonic() - started))
        self._collection_done = True
        self.wake.set()

    # -- sending -------------------------------------------------------------------------------

    async def _send_loop(self) -> None:
        while not self.stopping.is_set():
            entries = self.spool.entries()
            if not entries:
                if self._collection_done:
                    return
                self.wake.clear()
                if self.spool.entries():
                    continue
                await self.wake.wait()
                continue
            entry = entries[0]
            body = self.spool.read(entry)
            if body is None:
                continue  # dropped by the bound meanwhile
            delivery = await self.sender.deliver(entry, body, spooled=len(entries))
            if delivery.kind == "stop":
                self.exit_code = EXIT_STOPPED
                self.stop("publishing stopped")
                return
            if delivery.kind == "retry":
                if self.config.once:
                    self.exit_code = EXIT_UNSENT
                    return
                await self._sleep(delivery.retry_in)


async def run_agent(
    config: AgentConfig,
    *,
    host_collector: HostCollector | None = None,
    nvml_collector: NvmlCollector | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> int:
    agent = Agent(config, host_collector=host_collector, nvml_collector=nvml_collector, transport=transport)
    return await agent.run()
