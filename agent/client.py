"""What enrollment and sending share of talking to the server: TLS verification, base URLs, the
server's problem answers, and the warning about a credential sent in clear text."""

from __future__ import annotations

import ssl
from typing import Any

import httpx
import structlog

from agent.state import Credential

log = structlog.get_logger(__name__)


def tls_verify(ca_file: str | None) -> ssl.SSLContext | bool:
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def base_url(url: str) -> str:
    return url.rstrip("/")


def servers_for(configured: list[str], credential: Credential) -> list[str]:
    """The servers to send to, in failover order: the configured ones, else the enrolled one."""
    return [base_url(s) for s in configured] or [credential.server]


def problem_of(response: httpx.Response) -> dict[str, Any]:
    """The server's RFC 9457 problem body, or {} when the answer is not a JSON object."""
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def describe(response: httpx.Response) -> str:
    p = problem_of(response)
    detail = p.get("detail") or p.get("title") or response.reason_phrase
    return f"HTTP {response.status_code}: {detail}"


def warn_plain_http(url: str) -> None:
    parsed = httpx.URL(url)
    if parsed.scheme == "http" and parsed.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "agent.plain_http",
            server=url,
            hint="the credential crosses the network in clear text; put TLS in front of the server",
        )
