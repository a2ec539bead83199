"""Webhook decisions without I/O (docs/integrations.md): what a subscription's URL and secret may
be, which destination addresses are refused, what a receiver's answer means, how long to wait
before the next attempt, and the Standard Webhooks signature of a delivery."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
from typing import Literal, TypeAlias
from urllib.parse import urlsplit

import msgspec

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 1024
MAX_URL_LENGTH = 2048
SECRET_PREFIX = "whsec_"

# What one answer of a receiver means for the event it was sent.
Verdict: TypeAlias = Literal["delivered", "retry", "rejected"]


class Destination(msgspec.Struct, frozen=True):
    """A subscription URL taken apart: what is resolved and connected to."""

    scheme: Literal["http", "https"]
    host: str
    port: int


class UrlRefusal(ValueError):
    """Why a URL cannot be a webhook destination (one line, for the `url` field's problem)."""


def parse_url(url: str) -> Destination:
    """An http(s) URL with a host and no credentials, or UrlRefusal saying what is wrong."""
    if len(url) > MAX_URL_LENGTH:
        raise UrlRefusal(f"longer than {MAX_URL_LENGTH} characters")
    if any(c.isspace() or ord(c) < 0x20 for c in url):
        raise UrlRefusal("contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefusal(f"not a URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UrlRefusal("must be an http:// or https:// URL")
    if parts.username is not None or parts.password is not None:
        raise UrlRefusal("must not carry credentials (user:password@): sign with the secret instead")
    host = parts.hostname
    if not host:
        raise UrlRefusal("has no host")
    if parts.fragment:
        raise UrlRefusal("must not have a #fragment")
    return Destination(
        scheme="https" if scheme == "https" else "http",
        host=host,
        port=port if port is not None else (443 if scheme == "https" else 80),
    )


def refused_address(address: str) -> str | None:
    """Why delivering to this IP address is refused unless private destinations are allowed:
    loopback, link-local, private, unspecified, multicast and reserved ranges (the server's own
    network, cloud metadata services), else None."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return "not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if ip.is_private:
        return "private"
    if ip.is_reserved:
        return "reserved"
    return None


def signing_key(secret: str) -> bytes:
    """The HMAC key of a secret: a `whsec_<base64>` secret's decoded bytes (the Standard Webhooks
    form), any other secret's UTF-8 bytes. Raises ValueError for a key that is too short or too long."""
    key: bytes
    if secret.startswith(SECRET_PREFIX):
        try:
            key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("a whsec_ secret must be base64 after its prefix") from None
    else:
        key = secret.encode("utf-8")
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"must be at least {MIN_SECRET_BYTES} bytes")
    if len(key) > MAX_SECRET_BYTES:
        raise ValueError(f"must be at most {MAX_SECRET_BYTES} bytes")
    return key


def signature(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header: `v1,` and the base64 HMAC-SHA256 of `{id}.{timestamp}.{body}`."""
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")


def verdict(status: int) -> Verdict:
    """2xx: delivered. 408, 429 and 5xx: the receiver may take it later, retry. Any other answer
    (a 4xx, or a 1xx/3xx: redirects are not followed) refuses this event: it is recorded and
    skipped, never retried forever."""
    if 200 <= status < 300:
        return "delivered"
    if status in (408, 429) or status >= 500:
        return "retry"
    return "rejected"


def backoff(attempt: int, *, initial: float, ceiling: float, jitter: float) -> float:
    """Seconds before attempt `attempt + 1` after `attempt` failures in a row: exponential from
    `initial`, at most `ceiling`, scaled by `jitter` in [0, 1) into its upper half ("equal
    jitter"), so receivers that come back are not hit by every sender at once."""
    if attempt < 1:
        return 0.0
    exponent = min(attempt - 1, 62)
    full = min(ceiling, initial * 2.0**exponent)
    return full / 2 + full / 2 * min(max(jitter, 0.0), 1.0)
