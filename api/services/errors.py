"""The services' typed errors. A service says *what* went wrong (the kind, by class) and gives a
stable problem `type` slug, a title, a detail and extension members; it never says how an edge
shows it. The HTTP edge maps the kind to a status in one table (`api.http.problems`), the CLI to
an exit code in one table (`api.cli.main`)."""

from __future__ import annotations

from datetime import datetime


class DomainError(Exception):
    """Base of every refusal a service reports (never a bug: those stay ordinary exceptions)."""

    def __init__(self, type_: str, title: str, detail: str, **extensions: object) -> None:
        super().__init__(detail)
        self.type = type_
        self.title = title
        self.detail = detail
        self.extensions = extensions


class InvalidRequest(DomainError):
    """The input is not acceptable; nothing was done."""


class Unauthenticated(DomainError):
    """The presented secret is missing, unknown, expired, spent or revoked."""


class Forbidden(DomainError):
    """Authenticated, but not allowed to do this (e.g. a credential of another node)."""


class NotFound(DomainError):
    """The thing named does not exist."""


class Conflict(DomainError):
    """The request contradicts the current state (a stale preview, a reused sequence...)."""


class Gone(DomainError):
    """The thing named existed and is gone for good."""


class Unavailable(DomainError):
    """A dependency of the work (e.g. the host's collectors) failed; retry later."""


class NodeIsDecommissioned(Gone):
    """The node was permanently decommissioned (its stream ends with a tombstone); nothing may
    revive it: no refresh, no report, no enrollment, no lease."""

    def __init__(self, node_id: str, decommissioned_at: datetime | None = None, detail: str = "") -> None:
        text = detail or f"node {node_id} is decommissioned"
        super().__init__(
            "node-decommissioned",
            "Node is decommissioned",
            text,
            node_id=node_id,
            decommissioned_at=decommissioned_at,
        )
        self.node_id = node_id
        self.decommissioned_at = decommissioned_at


def unauthenticated(type_: str, detail: str) -> Unauthenticated:
    """A presented secret refused: every such refusal has the same title."""
    return Unauthenticated(type_, "Authentication failed", detail)


def invalid_parameter(detail: str) -> InvalidRequest:
    return InvalidRequest("invalid-parameter", "Invalid parameter", detail)
