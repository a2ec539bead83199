"""The body guard's scan (api/http/guards.py `check_body`) without I/O: it refuses a NUL, brackets
that do not balance and nesting deeper than MAX_DEPTH, and nothing else, whatever the strings
hold. The HTTP side (401 before any parsing, 400 problem+json) is tests/test_hostile_input.py."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from api.http.guards import MAX_DEPTH, check_body
from api.services.errors import InvalidRequest


def verdict(body: bytes) -> str | None:
    try:
        check_body(body)
    except InvalidRequest as exc:
        return exc.type
    return None


# The guard as it was first written (a regular expression drops the strings, one drops the
# innermost pairs per round): the rewrite in C-speed byte operations must decide every body alike.
_ESCAPED_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STRING = re.compile(rb'"[^"]*"')
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


def reference(body: bytes) -> str | None:
    if not body:
        return None
    if b"\x00" in body or _ESCAPED_NUL.search(body):
        return "nul-character"
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped.translate(None, _NOT_STRUCTURE))
    for _ in range(MAX_DEPTH):
        if not brackets:
            return None
        peeled = _EMPTY_PAIR.sub(b"", brackets)
        if peeled == brackets:
            return "malformed-json"
        brackets = peeled
    return "nesting-too-deep" if brackets else None


@settings(max_examples=400)
@given(st.binary(max_size=200) | st.text('[]{}"\\:,a u0', max_size=200).map(str.encode))
def test_any_body_is_judged_as_the_first_version_judged_it(body: bytes) -> None:
    assert verdict(body) == reference(body)


def nest(depth: int, kinds: list[bool], inner: Any) -> Any:
    value = inner
    for level in range(depth):
        value = {"k": value, "s": "[{"} if kinds[level % len(kinds)] else ["}]", value]
    return value


@settings(max_examples=150)
@given(
    depth=st.integers(min_value=0, max_value=MAX_DEPTH + 3),
    kinds=st.lists(st.booleans(), min_size=1, max_size=5),
    inner=st.text('ab"\\[]{}', max_size=6),
    indent=st.sampled_from([None, 1]),
)
def test_valid_json_is_refused_exactly_when_deeper_than_the_limit(
    depth: int, kinds: list[bool], inner: str, indent: int | None
) -> None:
    """Brackets, quotes and backslashes inside strings are text; the depth is the containers'."""
    body = json.dumps(nest(depth, kinds, inner), indent=indent).encode()
    assert verdict(body) == ("nesting-too-deep" if depth > MAX_DEPTH else None)


def test_a_round_peels_one_level_of_either_kind() -> None:
    """`{[]}` nested: a round that took `[]` and then the `{}` it uncovers would let twice the
    depth through."""
    assert verdict(b"{[]}" * 3) is None
    assert verdict(b"[{" * 32 + b"}]" * 32) is None  # 64 levels
    assert verdict(b"[{" * 32 + b"[]" + b"}]" * 32) == "nesting-too-deep"  # 65
