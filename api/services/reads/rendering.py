"""A body rendered once: its JSON and a strong ETag over those bytes, and If-None-Match."""

from __future__ import annotations

import hashlib
from datetime import datetime

import msgspec


class Rendered(msgspec.Struct, frozen=True):
    """A body's JSON and its strong ETag (over those bytes: the bytes hashed are the bytes sent)."""

    body: bytes
    etag: str


def render(body: object) -> Rendered:
    encoded = msgspec.json.encode(body)
    return Rendered(encoded, '"' + hashlib.sha256(encoded).hexdigest()[:32] + '"')


# What a loader returns: the rendering and until when the clock keeps it true (None: no limit).
Loaded = tuple[Rendered, datetime | None]


def not_modified(rendered: Rendered, if_none_match: str | None) -> bool:
    """Whether an If-None-Match header names this rendering's ETag (RFC 9110: weak comparison)."""
    if if_none_match is None:
        return False
    given = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    return rendered.etag in given or "*" in given
