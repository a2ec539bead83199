"""Sending the spool: what each server answer means for the report at its head, and what the
sender then does with it (remove, quarantine, stop, or retry later).

The sender sends the exact spooled bytes, so a retry is byte-identical. A report leaves the spool
only once the server answered it for good: 200, or a refusal that a retry cannot change (a 4xx,
or the same report answered 500 `quarantine_after` times in a row), which moves it into the
quarantine with the server's answer so that the reports behind it keep flowing. Unreachable
server, 404, 408, 429, 502-504: exponential backoff with jitter (honouring Retry-After), rotating
through the configured servers. 401 and 410 stop publishing.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Literal

import httpx
import msgspec
import structlog

from agent import clock
from agent.client import describe, problem_of, servers_for
from agent.config import AgentConfig
from agent.protocol import REPORTS_PATH, SENT_AT_HEADER, STREAMS
from agent.spool import MAX_ANSWER_BYTES, Quarantine, QuarantineAnswer, Spool, SpoolEntry
from agent.state import AgentStatus, Credential, LastError, Sequences, load_status, save_status

log = structlog.get_logger(__name__)

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
    detail = describe(response)
    problem = problem_of(response)
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


def backoff_delay(attempt: int, initial: float, cap: float, retry_after: float | None = None) -> float:
    """Exponential backoff with jitter: a random delay in [d/2, d], d = initial * 2^(attempt-1)
    capped at `cap`; at least the server's Retry-After (also capped)."""
    delay = min(cap, initial * (2 ** max(0, attempt - 1)))
    delay = random.uniform(delay / 2, delay)
    if retry_after is not None:
        delay = max(delay, min(cap, retry_after))
    return delay


DeliveryKind = Literal["sent", "quarantined", "stop", "retry"]


class Delivery(msgspec.Struct, frozen=True):
    """What became of one attempt at the head of the spool; `retry_in`: seconds to wait."""

    kind: DeliveryKind
    retry_in: float = 0.0


_STOP_REASONS = {
    401: "the server does not accept this node's credential (revoked or unknown)",
    410: "the node is decommissioned",
}
# What the operator can do about each. A decommissioned identity never comes back, so enrolling
# again under it is refused too (docs/NODE_DECOMMISSION.md, "No revival").
_STOP_HINTS = {
    401: "if this is wrong, enroll again: `modelforge-hw agent enroll --force`",
    410: "to put this host back in service, give it a new identity (MODELFORGE_NODE_ID) and enroll it",
}


class ReportSender:
    """Sends spooled reports one at a time and settles each by the server's answer."""

    def __init__(
        self,
        config: AgentConfig,
        credential: Credential,
        spool: Spool,
        sequences: Sequences,
        quarantine: Quarantine,
        client: httpx.AsyncClient,
    ) -> None:
        self.config = config
        self.credential = credential
        self.spool = spool
        self.sequences = sequences
        self.quarantine = quarantine
        self.client = client
        self.servers = servers_for(config.servers, credential)
        self.attempt = 0  # failed attempts since the last answer for good
        # Consecutive answers held against the report at the head of the spool (held_against_report).
        self._poisoned: tuple[str, int] = ("", 0)
        self._server_index = 0

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

    async def deliver(self, entry: SpoolEntry, body: bytes, *, spooled: int) -> Delivery:
        """Send `entry` (`body`: its spooled bytes; `spooled`: the spool's depth) and settle it."""
        self.spool.in_flight = entry.name
        try:
            result = await self.send(body)
        except Exception as exc:  # never let one odd answer end the agent
            result = SendResult("retry", None, f"{type(exc).__name__}: {exc}")
        finally:
            self.spool.in_flight = None
        if result.kind == "retry" and held_against_report(result):
            count = self._poisoned[1] + 1 if self._poisoned[0] == entry.name else 1
            self._poisoned = (entry.name, count)
            if count >= self.config.quarantine_after:
                result = msgspec.structs.replace(result, kind="quarantine")
        if result.kind == "done":
            self._sent(entry, result, spooled)
            return Delivery("sent")
        if result.kind == "quarantine":
            self._quarantined(entry, result)
            return Delivery("quarantined")
        if result.kind == "stop":
            self._record_error(entry, result)
            log.error(
                "agent.publishing_stopped",
                status=result.status,
                reason=_STOP_REASONS.get(result.status or 0, "refused"),
                detail=result.detail,
                hint=_STOP_HINTS.get(result.status or 0, _STOP_HINTS[401]),
            )
            return Delivery("stop")
        self.attempt += 1
        delay = backoff_delay(
            self.attempt, self.config.backoff_initial, self.config.backoff_max, result.retry_after
        )
        if len(self.servers) > 1:
            self._server_index += 1
        self._record_error(entry, result)
        log.warning(
            "agent.send_failed",
            status=result.status,
            detail=result.detail,
            attempt=self.attempt,
            retry_in=round(delay, 2),
            spooled=spooled,
        )
        return Delivery("retry", delay)

    def _sent(self, entry: SpoolEntry, result: SendResult, spooled: int) -> None:
        self.spool.remove(entry)
        if self.attempt:
            log.info("agent.server_reachable_again", failed_attempts=self.attempt, spooled=spooled - 1)
        self.attempt = 0
        gap = result.problem.get("gap")
        # Routine success is debug; what an operator may want to know is info.
        (log.info if gap or result.detail != "accepted" else log.debug)(
            "agent.report_sent",
            stream=entry.stream,
            sequence=entry.sequence,
            outcome=result.detail,
            gap=gap,
        )

    def _quarantined(self, entry: SpoolEntry, result: SendResult) -> None:
        attempts = self._poisoned[1] if self._poisoned[0] == entry.name else 1
        why = (
            f"answered HTTP {result.status} {attempts} times in a row"
            if attempts > 1
            else "refused for good: a retry of the same bytes cannot succeed"
        )
        self._quarantine(entry, result, attempts, why)
        self.attempt = 0
        self._poisoned = ("", 0)
        last = result.problem.get("last_sequence")
        if result.status == 409 and isinstance(last, int) and entry.stream in STREAMS:
            if self.sequences.raise_to({entry.stream: last}):
                log.warning(
                    "agent.sequence_resynchronized",
                    stream=entry.stream,
                    continue_after=last,
                    reason="the server had accepted higher sequences (restored state directory?)",
                )

    def _record_error(self, entry: SpoolEntry, result: SendResult, *, quarantined: bool = False) -> None:
        state_dir = self.config.state_dir
        status = load_status(state_dir)
        try:
            save_status(
                state_dir,
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
