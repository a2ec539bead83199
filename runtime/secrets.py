"""Bearer secrets: minted, parsed, hashed and compared the same way everywhere.

A named secret is `<prefix>_<id>_<secret>`: the id (32 hex digits) finds the stored record, the
secret is 256 random bits (URL-safe base64). The admin token is `mfop_<secret>`, with no id: only
one exists. Only the SHA-256 (hex) of a secret is ever stored, and a presented secret is compared
with it in constant time. The formats and digests are what databases already hold: changing them
locks out every enrolled node and issued token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid

import msgspec

# The longest secret part accepted: a minted one is 43 characters; the bound keeps a hostile
# header from costing a long hash.
MAX_SECRET = 128


class MintedSecret(msgspec.Struct, frozen=True):
    """A new named secret: `token` is shown once, only `sha256` is stored."""

    ident: str
    token: str
    sha256: str

    def __repr__(self) -> str:  # a log line or a traceback never shows the token
        return f"MintedSecret(ident={self.ident!r}, token=<hidden>, sha256={self.sha256!r})"


class PresentedSecret(msgspec.Struct, frozen=True):
    """A presented named secret, split: the id to look up, the secret to compare."""

    ident: str
    secret: str

    def __repr__(self) -> str:
        return f"PresentedSecret(ident={self.ident!r}, secret=<hidden>)"


def digest(secret: str) -> str:
    """The stored form of a secret: SHA-256 of its UTF-8 bytes, 64 hex digits."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def matches(presented: str, stored_sha256: str) -> bool:
    """Whether `presented` is the secret whose digest is stored, in constant time."""
    return hmac.compare_digest(digest(presented), stored_sha256)


def new_secret() -> str:
    """256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def mint(prefix: str) -> MintedSecret:
    """A new `<prefix>_<id>_<secret>`; its digest is of the secret part alone."""
    ident = uuid.uuid4().hex
    secret = new_secret()
    return MintedSecret(ident=ident, token=f"{prefix}_{ident}_{secret}", sha256=digest(secret))


def mint_unnamed(prefix: str) -> str:
    """A new `<prefix>_<secret>` (the admin token: one of its kind, so no id); its digest is of
    the whole text."""
    return f"{prefix}_{new_secret()}"


def parse(presented: str | None, prefix: str) -> PresentedSecret | None:
    """The id and secret of a named secret of the given kind, or None when the text cannot be one."""
    if not presented:
        return None
    kind, _, rest = presented.partition("_")
    ident, _, secret = rest.partition("_")
    if kind != prefix or len(ident) != 32 or not secret or len(secret) > MAX_SECRET:
        return None
    try:
        int(ident, 16)
    except ValueError:
        return None
    return PresentedSecret(ident=ident, secret=secret)
