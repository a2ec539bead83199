"""runtime/secrets.py: the one way bearer secrets are minted, parsed, hashed and compared. The
formats and digests are what databases hold already (enrollment tokens, node credentials, viewer
tokens, the admin token): these tests pin them."""

from __future__ import annotations

import hashlib
import re
import string

from hypothesis import given
from hypothesis import strategies as st

from runtime.secrets import MAX_SECRET, PresentedSecret, digest, matches, mint, mint_unnamed, parse

IDENT = "0123456789abcdef0123456789abcdef"
URLSAFE = string.ascii_letters + string.digits + "-_"


def test_the_digest_is_the_hex_sha256_of_the_utf8_text() -> None:
    assert digest("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert digest("clé") == hashlib.sha256("clé".encode()).hexdigest()


@given(st.text(max_size=80), st.text(max_size=80))
def test_a_secret_matches_its_own_digest_only(secret: str, other: str) -> None:
    assert matches(secret, digest(secret))
    assert matches(other, digest(secret)) == (other == secret)


def test_a_minted_secret_is_prefix_id_secret_and_stores_the_digest_of_its_secret_part() -> None:
    minted = mint("mfc")
    assert re.fullmatch(r"mfc_[0-9a-f]{32}_[A-Za-z0-9_-]{43}", minted.token)
    assert minted.token.startswith(f"mfc_{minted.ident}_")
    secret = minted.token[len("mfc_") + 33 :]
    assert minted.sha256 == digest(secret)
    assert parse(minted.token, "mfc") == PresentedSecret(minted.ident, secret)
    assert minted.token not in repr(minted) and secret not in repr(parse(minted.token, "mfc"))
    assert mint("mfc").ident != minted.ident


def test_an_unnamed_secret_is_prefix_secret_and_its_digest_is_of_the_whole_text() -> None:
    token = mint_unnamed("mfop")
    assert re.fullmatch(r"mfop_[A-Za-z0-9_-]{43}", token)


@given(st.text(URLSAFE, min_size=1, max_size=MAX_SECRET))
def test_a_named_secret_parses_back_to_its_id_and_secret(secret: str) -> None:
    # The secret may hold underscores itself: only the first two separate.
    assert parse(f"mfe_{IDENT}_{secret}", "mfe") == PresentedSecret(IDENT, secret)


def test_a_secret_parses_only_in_its_own_shape() -> None:
    assert parse(f"mfc_{IDENT}_s3cr_et-x", "mfc") == PresentedSecret(IDENT, "s3cr_et-x")
    for bad in (
        None,
        "",
        "mfc",
        f"mfe_{IDENT}_x",  # another kind
        f"mfc_{IDENT}_",  # no secret
        "mfc_nothex_x",
        f"mfc_{IDENT[:-1]}g_x",  # not hex
        f"mfc_{IDENT}0_x",  # 33 digits
        f"mfc_{IDENT}_{'x' * (MAX_SECRET + 1)}",  # too long to be one
    ):
        assert parse(bad, "mfc") is None, bad


@given(st.text(max_size=200))
def test_anything_parses_to_nothing_or_to_a_well_formed_secret(text: str) -> None:
    parsed = parse(text, "mfv")
    if parsed is not None:
        assert text == f"mfv_{parsed.ident}_{parsed.secret}"
        assert len(parsed.ident) == 32 and 0 < len(parsed.secret) <= MAX_SECRET
