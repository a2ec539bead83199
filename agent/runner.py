"""The compute-node agent: enrollment, and the publish loop (collect -> spool -> send).

Outbound only: the agent opens no port; it calls the central API over HTTP(S). It observes the
host through the same collectors as the local refresh (`collectors.collector.observe`) and sends
what they observed; the server reconciles it through the same service. See
docs/NODE_AGENT_PROTOCOL.md for the protocol and the rules below.

- Collection runs every `interval` seconds whether or not the server answers; each report gets
  the next sequence of its stream and is written to the durable spool before any send.
- The sender sends the spool oldest first, one report at a time, and removes a report only once
  the server answered it for good: 200, or a refusal that a retry cannot change (a 4xx, or the
  same report answered 500 `quarantine_after` times in a row), which moves the report into the
  quarantine with the server's answer so that the reports behind it keep flowing. Unreachable
  server, 404, 408, 429, 502-504: exponential backoff with jitter (honouring Retry-After),
  rotating through the configured servers; nothing is lost while the spool has room.
- 401 (credential invalid or revoked), 410 (node decommissioned): the agent stops publishing,
  says why in its log, and exits with EXIT_STOPPED.
- One agent per state directory: `agent run` and `agent enroll` hold an flock on it.
- Nothing the server says crashes the agent; the credential is never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import signal
import socket
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import structlog

from agent import clock
from agent.protocol import (
    ENROLL_PATH,
    PROTOCOL_VERSION,
    REPORTS_PATH,
    SENT_AT_HEADER,
    STREAMS,
    EnrollRequest,
    EnrollResponse,
    Report,
    encode_report,
    sanitize_observation,
)
from agent.spool import MAX_ANSWER_BYTES, Quarantine, QuarantineAnswer, Spool, SpoolEntry
from agent.state import (
    QUARANTINE_DIR,
    SEQUENCES_FILE,
    SPOOL_DIR,
    AgentStatus,
    Credential,
    LastError,
    Sequences,
    StateError,
    StateLock,
    load_credential,
    load_status,
    save_credential,
    save_status,
)
from collectors.collector import HostCollector, NvmlCollector, observe
from collectors.identity import IdentityError, NodeIdentity, resolve_identity
from collectors.nvml import NvidiaNvmlCollector
from collectors.observations import ACCELERATOR_INVENTORY_FACTS, HardwareObservation, HostCollectionError
from collectors.system import SystemHostCollector
from runtime import settings

log = structlog.get_logger(__name__)

AGENT_VERSION = "0.1.0"
EXIT_OK = 0
EXIT_UNSENT = 1  # --once: reports are left in the spool (server unreachable)
EXIT_USAGE = 2  # not enrolled, bad state directory, enrollment refused
EXIT_STOPPED = 78  # EX_CONFIG: the server refused this agent for good (401/410); do not restart


class AgentError(Exception):
    """One line for the operator, and the exit code that goes with it."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# The defaults come from the one configuration model (runtime/settings.py), shared with the server.
DEFAULT_INTERVAL: float = settings.default("agent_interval")
DEFAULT_INVENTORY_EVERY: int = settings.default("agent_inventory_every")
DEFAULT_SPOOL_MAX: int = settings.default("agent_spool_max")
DEFAULT_BACKOFF_INITIAL: float = settings.default("agent_backoff_initial")
DEFAULT_BACKOFF_MAX: float = settings.default("agent_backoff_max")
DEFAULT_REQUEST_TIMEOUT: float = settings.default("agent_request_timeout")
DEFAULT_COLLECTOR_TIMEOUT: float = settings.default("collector_timeout")
# A report answered 500 this many times in a row is quarantined: enough to ride out a server
# restart or a short database hiccup, few enough that one poisoned report blocks for seconds.
DEFAULT_QUARANTINE_AFTER: int = settings.default("agent_quarantine_after")


class AgentConfig(msgspec.Struct, kw_only=True):
    servers: list[str] = []  # empty: the server the agent enrolled with
    state_dir: Path
    node_id: str | None = None  # MODELFORGE_NODE_ID
    interval: float = DEFAULT_INTERVAL
    inventory_every: int = DEFAULT_INVENTORY_EVERY  # an inventory report at least every N reports
    spool_max: int = DEFAULT_SPOOL_MAX
    backoff_initial: float = DEFAULT_BACKOFF_INITIAL
    backoff_max: float = DEFAULT_BACKOFF_MAX
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    collector_timeout: float = DEFAULT_COLLECTOR_TIMEOUT
    quarantine_after: int = DEFAULT_QUARANTINE_AFTER
    ca_file: str | None = None
    once: bool = False


def _verify(ca_file: str | None) -> ssl.SSLContext | bool:
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def _base(url: str) -> str:
    return url.rstrip("/")


def _problem(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _describe(response: httpx.Response) -> str:
    p = _problem(response)
    detail = p.get("detail") or p.get("title") or response.reason_phrase
    return f"HTTP {response.status_code}: {detail}"


def _warn_plain_http(url: str) -> None:
    parsed = httpx.URL(url)
    if parsed.scheme == "http" and parsed.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "agent.plain_http",
            server=url,
            hint="the credential crosses the network in clear text; put TLS in front of the server",
        )


# --- enrollment --------------------------------------------------------------------------------


def resolve_agent_identity(state_dir: Path, configured: str | None) -> NodeIdentity:
    try:
        return resolve_identity(configured=configured, state_dir=state_dir)
    except IdentityError as exc:
        raise AgentError(str(exc)) from exc


async def enroll(
    server: str,
    token: str,
    state_dir: Path,
    *,
    node_id: str | None = None,
    force: bool = False,
    ca_file: str | None = None,
    request_timeout: float = 10.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Credential:
    """Exchange an enrollment token for this node's credential and keep it in the state directory
    (mode 0600). Raises AgentError with a one-line reason."""
    try:
        lock = StateLock(state_dir).acquire()
    except StateError as exc:
        raise AgentError(str(exc)) from exc
    try:
        return await _enroll(
            server,
            token,
            state_dir,
            node_id=node_id,
            force=force,
            ca_file=ca_file,
            request_timeout=request_timeout,
            transport=transport,
        )
    finally:
        lock.release()


async def _enroll(
    server: str,
    token: str,
    state_dir: Path,
    *,
    node_id: str | None,
    force: bool,
    ca_file: str | None,
    request_timeout: float,
    transport: httpx.AsyncBaseTransport | None,
) -> Credential:
    try:
        existing = load_credential(state_dir)
    except StateError as exc:
        if not force:
            raise AgentError(str(exc)) from exc
        existing = None
    if existing is not None and not force:
        raise AgentError(
            f"already enrolled as node {existing.node_id} (credential {existing.credential_id}); "
            "use --force to enroll again (the old credential is then revoked)"
        )
    identity = resolve_agent_identity(state_dir, node_id)
    _warn_plain_http(server)
    request = EnrollRequest(
        identity_key=identity.key,
        identity_source=identity.source,
        hostname=socket.gethostname(),
        agent_version=AGENT_VERSION,
    )
    async with httpx.AsyncClient(
        verify=_verify(ca_file), timeout=request_timeout, transport=transport, follow_redirects=False
    ) as client:
        try:
            response = await client.post(
                _base(server) + ENROLL_PATH,
                content=msgspec.json.encode(request),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise AgentError(f"cannot reach {server}: {type(exc).__name__}: {exc}", 1) from exc
    if response.status_code != 201:
        raise AgentError(f"enrollment refused by {server}: {_describe(response)}")
    try:
        answer = msgspec.json.decode(response.content, type=EnrollResponse)
    except msgspec.MsgspecError as exc:
        raise AgentError(f"{server} answered enrollment with an unexpected body: {exc}", 1) from exc
    credential = Credential(
        server=_base(server),
        node_id=answer.node_id,
        identity_key=answer.identity_key,
        credential_id=answer.credential_id,
        credential=answer.credential,
        enrolled_at=clock.now(),
    )
    try:
        path = save_credential(state_dir, credential)
        try:
            sequences: Sequences | None = Sequences(state_dir)
        except StateError:
            (state_dir / SEQUENCES_FILE).unlink()  # damaged: the server's positions are the truth
            sequences = None
        spool = Spool(state_dir / SPOOL_DIR)
        if existing is not None and existing.node_id != answer.node_id:
            # Another identity than before: the spooled reports and numbers were another node's.
            for entry in spool.entries():
                spool.remove(entry)
            sequences = None
            log.warning("agent.identity_changed", previous_node_id=existing.node_id, node_id=answer.node_id)
        # Continue above what the server accepted and what is still spooled.
        floors = dict(answer.streams)
        for entry in spool.entries():
            floors[entry.stream] = max(floors.get(entry.stream, 0), entry.sequence)
        if sequences is None:
            Sequences(state_dir).reset(floors)
        else:
            sequences.raise_to(floors)
    except (OSError, StateError) as exc:
        raise AgentError(f"enrolled, but cannot keep the credential in {state_dir}: {exc}") from exc
    log.info(
        "agent.enrolled",
        node_id=answer.node_id,
        key_id=answer.credential_id,
        path=str(path),
        superseded=answer.superseded_credentials,
    )
    return credential


# --- the publish loop ----------------------------------------------------------------------------


SendKind = Literal["done", "quarantine", "retry", "stop"]

# 5xx answers that say the server (or a proxy, or its database) is unavailable rather than that
# this report is wrong: retried however often they come, never held against the report.
UNAVAILABLE = frozenset({502, 503, 504})


class SendResult(msgspec.Struct, frozen=True):
    kind: SendKind
    status: int | None
    detail: str
    problem: dict[str, Any] = {}
    retry_after: float | None = None
    body: str = ""  # the server's answer, kept with a quarantined report


def classify(response: httpx.Response) -> SendResult:
    """What a response means for the spooled report (docs/NODE_AGENT_PROTOCOL.md, status codes)."""
    status = response.status_code
    detail = _describe(response)
    problem = _problem(response)
    body = response.content[:MAX_ANSWER_BYTES].decode("utf-8", "replace")
    if status == 200:
        return SendResult("done", status, str(problem.get("status", "accepted")), problem)
    if status in (401, 410):
        return SendResult("stop", status, detail, problem, body=body)
    # 404: the route is not there (a wrong --server path, a proxy), which says nothing of the report.
    if status == 429 or status >= 500 or status in (404, 408):
        retry_after = None
        header = response.headers.get("retry-after")
        if header is not None:
            with contextlib.suppress(ValueError):
                retry_after = max(0.0, float(header))
        return SendResult("retry", status, detail, problem, retry_after, body)
    # 400, 403, 409, 413, 422 and any other 4xx: sending the same bytes again cannot succeed.
    return SendResult("quarantine", status, detail, problem, body=body)


def held_against_report(result: SendResult) -> bool:
    """A retryable answer that counts towards quarantining the report: a 5xx that is not the
    server saying it is unavailable (a report PostgreSQL refuses comes back 500 every time)."""
    return result.status is not None and result.status >= 500 and result.status not in UNAVAILABLE


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
        self.collected = 0
        self._collection_done = False
        self._inventory_signature: str | None = None
        self._server_index = 0

    # -- setup ---------------------------------------------------------------------------------

    def _prepare(self) -> tuple[Credential, Sequences, Spool]:
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
            self.quarantine = Quarantine(self.state_dir / QUARANTINE_DIR)
        except (OSError, StateError) as exc:
            raise AgentError(f"cannot use the state directory {self.state_dir}: {exc}") from exc
        self.identity = identity
        return credential, sequences, spool

    @property
    def servers(self) -> list[str]:
        return [_base(s) for s in self.config.servers] or [self.credential.server]

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
        self.credential, self.sequences, self.spool = self._prepare()
        for server in self.servers:
            _warn_plain_http(server)
        log.info(
            "agent.started",
            node_id=self.credential.node_id,
            servers=self.servers,
            interval=self.config.interval,
            spooled=len(self.spool),
        )
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
                installed.append(sig)
        try:
            async with httpx.AsyncClient(
                verify=_verify(self.config.ca_file),
                timeout=self.config.request_timeout,
                transport=self.transport,
                follow_redirects=False,
            ) as client:
                self.client = client
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
        log.info("agent.stopped", exit_code=self.exit_code, spooled=len(self.spool))
        return self.exit_code

    def stop(self, reason: str = "requested") -> None:
        if not self.stopping.is_set():
            log.info("agent.stopping", reason=reason)
        self.stopping.set()
        self.wake.set()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout=max(0.0, seconds))

    # -- collection ----------------------------------------------------------------------------

    async def observe(self) -> HardwareObservation:
        t0 = time.perf_counter()
        obs = await observe(self.host_collector, self.nvml_collector, clock.now())
        log.debug("agent.collected", seconds=round(time.perf_counter() - t0, 3))
        return obs

    @staticmethod
    def inventory_signature(obs: HardwareObservation) -> str:
        """A digest of the inventory facts only (telemetry excluded): a change means a report
        on the inventory stream."""
        host, nvml = obs.host, obs.nvml
        doc = {
            "hostname": host.hostname,
            "os": host.os,
            "cpu": host.cpu,
            "memory_total_bytes": host.memory_total_bytes,
            "nvml": [nvml.status, nvml.driver_version, nvml.cuda_driver_version],
            "accelerators": [
                [a.uuid, *(getattr(a, name) for name in ACCELERATOR_INVENTORY_FACTS)]
                for a in sorted(nvml.accelerators, key=lambda a: a.uuid)
            ],
        }
        return hashlib.sha256(msgspec.json.encode(doc)).hexdigest()

    def _stream_for(self, obs: HardwareObservation) -> str:
        signature = self.inventory_signature(obs)
        every = max(1, self.config.inventory_every)
        changed = signature != self._inventory_signature
        self._inventory_signature = signature
        return "inventory" if changed or self.collected % every == 0 else "telemetry"

    async def collect_once(self) -> SpoolEntry | None:
        try:
            obs = sanitize_observation(await self.observe())
        except HostCollectionError as exc:
            log.warning("agent.collection_failed", error=str(exc), hint="no report this round")
            return None
        stream = self._stream_for(obs)
        order, sequence = self.sequences.allocate(stream)
        report = Report(
            protocol=PROTOCOL_VERSION,
            node_id=self.credential.node_id,
            identity_key=self.identity.key,
            identity_source=self.identity.source,
            stream=stream,
            sequence=sequence,
            observed_at=obs.observed_at,
            observation=obs,
        )
        self.spool.add(order, stream, sequence, encode_report(report))
        self.collected += 1
        self.wake.set()
        return SpoolEntry(order, stream, sequence, "")

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

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Exponential backoff with jitter: a random delay in [d/2, d], d = initial * 2^(attempt-1)
        capped at `backoff_max`; at least the server's Retry-After (also capped)."""
        cap = self.config.backoff_max
        delay = min(cap, self.config.backoff_initial * (2 ** max(0, attempt - 1)))
        delay = random.uniform(delay / 2, delay)
        if retry_after is not None:
            delay = max(delay, min(cap, retry_after))
        return delay

    async def send(self, body: bytes) -> SendResult:
        server = self.servers[self._server_index % len(self.servers)]
        headers = {
            "Authorization": f"Bearer {self.credential.credential}",
            "Content-Type": "application/json",
            SENT_AT_HEADER: clock.now().isoformat(),
        }
        try:
            response = await self.client.post(server + REPORTS_PATH, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return SendResult("retry", None, f"{server} unreachable: {type(exc).__name__}: {exc}")
        return classify(response)

    def _record_error(self, entry: SpoolEntry, result: SendResult, *, quarantined: bool = False) -> None:
        status = load_status(self.state_dir)
        try:
            save_status(
                self.state_dir,
                AgentStatus(
                    quarantined_total=status.quarantined_total + (1 if quarantined else 0),
                    last_error=LastError(
                        clock.now(), entry.stream, entry.sequence, result.status, result.detail
                    ),
                ),
            )
        except OSError as exc:  # informational: never worth stopping the sender for
            log.warning("agent.status_not_saved", error=str(exc))

    def _quarantine(self, entry: SpoolEntry, result: SendResult, attempts: int, why: str) -> None:
        self.quarantine.add(
            self.spool,
            entry,
            QuarantineAnswer(
                quarantined_at=clock.now(),
                stream=entry.stream,
                sequence=entry.sequence,
                status=result.status,
                detail=result.detail,
                attempts=attempts,
                answer=result.body,
            ),
        )
        self._record_error(entry, result, quarantined=True)
        log.error(
            "agent.report_quarantined",
            stream=entry.stream,
            sequence=entry.sequence,
            status=result.status,
            detail=result.detail,
            attempts=attempts,
            reason=why,
            path=str(self.quarantine.directory / entry.name),
        )

    async def _send_loop(self) -> None:
        attempt = 0
        # Consecutive answers held against the report at the head of the spool (held_against_report).
        poisoned: tuple[str, int] = ("", 0)
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
            self.spool.in_flight = entry.name
            try:
                result = await self.send(body)
            except Exception as exc:  # never let one odd answer end the agent
                result = SendResult("retry", None, f"{type(exc).__name__}: {exc}")
            finally:
                self.spool.in_flight = None
            if result.kind == "retry" and held_against_report(result):
                count = poisoned[1] + 1 if poisoned[0] == entry.name else 1
                poisoned = (entry.name, count)
                if count >= self.config.quarantine_after:
                    result = msgspec.structs.replace(result, kind="quarantine")
            if result.kind == "done":
                self.spool.remove(entry)
                if attempt:
                    log.info(
                        "agent.server_reachable_again", failed_attempts=attempt, spooled=len(entries) - 1
                    )
                attempt = 0
                gap = result.problem.get("gap")
                # Routine success is debug; what an operator may want to know is info.
                (log.info if gap or result.detail != "accepted" else log.debug)(
                    "agent.report_sent",
                    stream=entry.stream,
                    sequence=entry.sequence,
                    outcome=result.detail,
                    gap=gap,
                )
            elif result.kind == "quarantine":
                attempts = poisoned[1] if poisoned[0] == entry.name else 1
                why = (
                    f"answered HTTP {result.status} {attempts} times in a row"
                    if attempts > 1
                    else "refused for good: a retry of the same bytes cannot succeed"
                )
                self._quarantine(entry, result, attempts, why)
                attempt = 0
                poisoned = ("", 0)
                last = result.problem.get("last_sequence")
                if result.status == 409 and isinstance(last, int) and entry.stream in STREAMS:
                    if self.sequences.raise_to({entry.stream: last}):
                        log.warning(
                            "agent.sequence_resynchronized",
                            stream=entry.stream,
                            continue_after=last,
                            reason="the server had accepted higher sequences (restored state directory?)",
                        )
            elif result.kind == "stop":
                self.exit_code = EXIT_STOPPED
                self._record_error(entry, result)
                why = {
                    401: "the server does not accept this node's credential (revoked or unknown)",
                    410: "the node is decommissioned",
                }.get(result.status or 0, "refused")
                log.error(
                    "agent.publishing_stopped",
                    status=result.status,
                    reason=why,
                    detail=result.detail,
                    hint="if this is wrong, enroll again: `modelforge-hw agent enroll --force`",
                )
                self.stop("publishing stopped")
                return
            else:
                attempt += 1
                delay = self.backoff(attempt, result.retry_after)
                if len(self.servers) > 1:
                    self._server_index += 1
                self._record_error(entry, result)
                log.warning(
                    "agent.send_failed",
                    status=result.status,
                    detail=result.detail,
                    attempt=attempt,
                    retry_in=round(delay, 2),
                    spooled=len(entries),
                )
                if self.config.once:
                    self.exit_code = EXIT_UNSENT
                    return
                await self._sleep(delay)


async def run_agent(
    config: AgentConfig,
    *,
    host_collector: HostCollector | None = None,
    nvml_collector: NvmlCollector | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> int:
    agent = Agent(config, host_collector=host_collector, nvml_collector=nvml_collector, transport=transport)
    return await agent.run()


def parse_servers(values: Sequence[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or ():
        out += [s.strip() for s in v.split(",") if s.strip()]
    return out
