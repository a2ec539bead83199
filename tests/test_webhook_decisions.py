"""The webhook decisions of domain/webhooks.py, without I/O: backoff bounds, what an answer
means, which URLs and addresses are refused, the signing key and the signature."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.webhooks import (
    MIN_SECRET_BYTES,
    UrlRefusal,
    backoff,
    parse_url,
    refused_address,
    signature,
    signing_key,
    verdict,
)

initial = st.floats(0.01, 10.0)
ceiling = st.floats(0.01, 3600.0)
jitter = st.floats(0.0, 1.0, exclude_max=True)


@given(st.integers(1, 200), initial, ceiling, jitter)
def test_a_wait_is_between_half_and_all_of_the_capped_exponential(
    attempt: int, first: float, cap: float, j: float
) -> None:
    full = min(cap, first * 2.0 ** min(attempt - 1, 62))
    wait = backoff(attempt, initial=first, ceiling=cap, jitter=j)
    assert full / 2 <= wait <= full + 1e-9
    assert wait <= cap + 1e-9


@given(st.integers(1, 100), initial, ceiling, jitter)
def test_waits_never_shrink_as_attempts_fail_at_the_same_jitter(
    attempt: int, first: float, cap: float, j: float
) -> None:
    assert backoff(attempt + 1, initial=first, ceiling=cap, jitter=j) >= backoff(
        attempt, initial=first, ceiling=cap, jitter=j
    )
    assert backoff(0, initial=first, ceiling=cap, jitter=j) == 0.0


@given(st.integers(100, 599))
def test_an_answer_is_delivered_retried_or_rejected(status: int) -> None:
    v = verdict(status)
    if 200 <= status < 300:
        assert v == "delivered"
    elif status in (408, 429) or status >= 500:
        assert v == "retry"
    else:
        assert v == "rejected"


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.org/",
        "file:///etc/passwd",
        "gopher://example.org",
        "http://user:pw@example.org/",
        "https://token@example.org/",
        "http:///path",
        "http://example.org/#frag",
        "http://example.org:99999/",
        "http://exa mple.org/",
        "http://example.org/\n",
        "http://" + "a" * 2100,
    ],
)
def test_urls_that_cannot_be_destinations_are_refused(url: str) -> None:
    with pytest.raises(UrlRefusal):
        parse_url(url)


def test_http_and_https_urls_are_taken_apart() -> None:
    d = parse_url("HTTPS://Pager.Example.org/hook?x=1")
    assert (d.scheme, d.host, d.port) == ("https", "pager.example.org", 443)
    assert parse_url("http://[2001:db8::1]:8080/").port == 8080


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("fe80::1%eth0", "link-local"),
        ("10.1.2.3", "private"),
        ("192.168.0.7", "private"),
        ("172.16.9.9", "private"),
        ("fd00::1", "private"),
        ("::ffff:127.0.0.1", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_private_addresses_are_named(address: str, why: str | None) -> None:
    assert refused_address(address) == why


@given(
    st.binary(min_size=MIN_SECRET_BYTES, max_size=64),
    st.text(max_size=20),
    st.integers(0, 2**40),
    st.binary(),
)
def test_the_signature_is_the_standard_webhooks_hmac(key: bytes, ident: str, stamp: int, body: bytes) -> None:
    secret = "whsec_" + base64.b64encode(key).decode()
    assert signing_key(secret) == key
    mac = hmac.new(key, f"{ident}.{stamp}.".encode() + body, hashlib.sha256).digest()
    assert signature(key, ident, stamp, body) == "v1," + base64.b64encode(mac).decode()


def test_secrets_shorter_than_16_bytes_are_refused() -> None:
    for short in ("x" * 15, "whsec_" + base64.b64encode(b"y" * 15).decode(), "whsec_!!"):
        with pytest.raises(ValueError):
            signing_key(short)
    assert signing_key("z" * 16) == b"z" * 16
