"""The agent plane's pure decisions (docs/NODE_AGENT_PROTOCOL.md): whether an enrollment token may
be used now, whether a report's sequence may be taken on its stream, and what a report appends.

No I/O and no clock: the services (api/services/enrollment.py, api/services/reports.py) read the
state under the stream locks, pass it in, and turn a refusal into their typed error. A refusal is
a value here, with its stable problem slug and its detail, so the decision is tested as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Literal, Protocol

import msgspec

from collectors.identity import NodeIdentity
from collectors.observations import HardwareObservation
from domain.health_policy import DEFAULT_POLICY, HealthPolicy
from domain.node import NodeState
from domain.reconcile import reconcile
from ledger.events import EventMetadata, NewEvent

# How many digests of accepted reports per stream are kept to recognize an unchanged retry.
RECENT_REPORT_DIGESTS = 32


class TokenUses(Protocol):
    """What the decision reads of an enrollment token's folded state."""

    @property
    def revoked_at(self) -> datetime | None: ...
    @property
    def expires_at(self) -> datetime | None: ...
    @property
    def uses(self) -> int: ...
    @property
    def used(self) -> int: ...


class TokenRefusal(msgspec.Struct, frozen=True):
    """Why an enrollment token whose secret matched cannot be used now."""

    problem: Literal["enrollment-token-revoked", "enrollment-token-expired", "enrollment-token-used-up"]
    detail: str


class CredentialRefusal(msgspec.Struct, frozen=True):
    """The report's credential is no longer valid on its node's state."""

    problem: Literal["credential-revoked"] = "credential-revoked"
    detail: str = "the node credential was revoked"


class SequenceConflict(msgspec.Struct, frozen=True):
    """A report's sequence that was already used on its stream with other content."""

    stream: str
    sequence: int
    last_sequence: int
    detail: str


class ReportItem(msgspec.Struct, frozen=True):
    """A validated report of an authenticated credential, waiting for its node's state: what the
    decision reads of it and what its stream position records."""

    credential_id: str
    node_id: str
    identity: NodeIdentity
    stream: str
    sequence: int
    observed_at: datetime
    observation: HardwareObservation
    digest: str  # SHA-256 of the report's bytes as received
    received_at: datetime
    sent_at: datetime | None


class DuplicateReport(msgspec.Struct, frozen=True):
    """An unchanged retry of an accepted report: nothing is appended."""

    last: int


class AcceptedReport(msgspec.Struct, frozen=True):
    """What a report that passed its checks appends, and how its stream position moves."""

    events: list[NewEvent]
    last: int | None
    gap: int
    recent: dict[int, str]


ReportDecision = CredentialRefusal | SequenceConflict | DuplicateReport | AcceptedReport


def token_refusal(state: TokenUses, now: datetime) -> TokenRefusal | None:
    """Why a token (its secret already checked) cannot be used now, or None."""
    if state.revoked_at is not None:
        return TokenRefusal("enrollment-token-revoked", "the enrollment token was revoked")
    if state.expires_at is None or now >= state.expires_at:
        when = state.expires_at.isoformat() if state.expires_at else "?"
        return TokenRefusal("enrollment-token-expired", f"the enrollment token expired at {when}")
    if state.uses - state.used <= 0:
        return TokenRefusal(
            "enrollment-token-used-up", f"the enrollment token's {state.uses} use(s) are spent"
        )
    return None


def sequence_refusal(
    stream: str, seq: int, last: int | None, recent: Mapping[int, str], digest: str
) -> SequenceConflict | None:
    """A report's sequence against the stream's last accepted one (`recent`: the digests of the
    stream's recently accepted reports by sequence): None to accept (or to answer `duplicate`,
    decided by the caller), else the conflict."""
    if last is None or seq > last or recent.get(seq) == digest:
        return None
    if seq == last:
        detail = f"sequence {seq} of stream {stream} was already accepted with other content"
    else:
        detail = f"sequence {seq} of stream {stream} is older than the last accepted ({last})"
        if seq in recent:
            detail += " and was accepted with other content"
    return SequenceConflict(stream=stream, sequence=seq, last_sequence=last, detail=detail)


def _window_above(recent: Mapping[int, str], floor: int) -> dict[int, str]:
    """The digests of the sequences above `floor`, as a new dict. A steady stream's window drops
    one sequence per report, its oldest: copied whole (C) and the few at or below the floor taken
    out by their numbers, rather than every entry tested."""
    if not recent:
        return {}
    oldest = min(recent)
    if floor - oldest >= len(recent):
        return {k: v for k, v in recent.items() if k > floor}
    kept = dict(recent)
    for k in range(oldest, floor + 1):
        kept.pop(k, None)
    return kept


def decide_report(
    state: NodeState,
    item: ReportItem,
    last: int | None,
    recent: Mapping[int, str],
    policy: HealthPolicy = DEFAULT_POLICY,
) -> ReportDecision:
    """A report against its node's folded state and its stream's position: refused, an unchanged
    retry, or accepted (the events to append, the gap, the digests kept for retries)."""
    credential = state.credentials.get(item.credential_id)
    if credential is None or credential.revoked_at is not None:
        return CredentialRefusal()
    seq = item.sequence
    refusal = sequence_refusal(item.stream, seq, last, recent, item.digest)
    if refusal is not None:
        return refusal
    if last is not None and seq <= last:  # the same content again: an unchanged retry
        return DuplicateReport(last)
    gap = seq - (last or 0) - 1
    metadata = EventMetadata(
        received_at=item.received_at,
        source="agent",
        observed_at=item.observed_at,
        agent_stream=item.stream,
        agent_sequence=seq,
        agent_sent_at=item.sent_at,
        agent_report_sha256=item.digest,
        agent_sequence_gap=gap if gap > 0 else None,
        actor=f"credential:{item.credential_id}",
    )
    kept = _window_above(recent, seq - RECENT_REPORT_DIGESTS)
    kept[seq] = item.digest
    events = [
        NewEvent(payload=p, metadata=metadata)
        for p in reconcile(item.observation, state, item.identity, policy)
    ]
    return AcceptedReport(events=events, last=last, gap=max(0, gap), recent=kept)
