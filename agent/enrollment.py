"""Enrollment: exchange an enrollment token for this node's credential, and keep the credential
and the report sequences in the state directory so that the agent continues where the server is."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import msgspec
import structlog

from agent import clock
from agent.client import base_url, describe, tls_verify, warn_plain_http
from agent.errors import AgentError
from agent.protocol import ENROLL_PATH, EnrollRequest, EnrollResponse
from agent.spool import Spool
from agent.state import (
    SEQUENCES_FILE,
    SPOOL_DIR,
    Credential,
    Sequences,
    StateError,
    StateLock,
    load_credential,
    save_credential,
)
from collectors.identity import IdentityError, NodeIdentity, resolve_identity
from runtime.version import VERSION

log = structlog.get_logger(__name__)

AGENT_VERSION = VERSION


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
    warn_plain_http(server)
    request = EnrollRequest(
        identity_key=identity.key,
        identity_source=identity.source,
        hostname=socket.gethostname(),
        agent_version=AGENT_VERSION,
    )
    async with httpx.AsyncClient(
        verify=tls_verify(ca_file), timeout=request_timeout, transport=transport, follow_redirects=False
    ) as client:
        try:
            response = await client.post(
                base_url(server) + ENROLL_PATH,
                content=msgspec.json.encode(request),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
        except httpx.HTTPError as exc:
            raise AgentError(f"cannot reach {server}: {type(exc).__name__}: {exc}", 1) from exc
    if response.status_code != 201:
        raise AgentError(f"enrollment refused by {server}: {describe(response)}")
    try:
        answer = msgspec.json.decode(response.content, type=EnrollResponse)
    except msgspec.MsgspecError as exc:
        raise AgentError(f"{server} answered enrollment with an unexpected body: {exc}", 1) from exc
    credential = Credential(
        server=base_url(server),
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
