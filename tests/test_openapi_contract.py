"""The OpenAPI document describes what the API sends: no `oneOf` whose branches overlap."""

from __future__ import annotations

from typing import Any

from api.http.app import create_app
from api.http.openapi_contract import document

# JSON Schema's primitive types; "integer" is a subset of "number".
_OVERLAPS = {("integer", "number"), ("number", "integer")}


def _one_ofs(node: Any) -> list[list[Any]]:
    found: list[list[Any]] = []
    if isinstance(node, dict):
        if isinstance(node.get("oneOf"), list):
            found.append(node["oneOf"])
        for value in node.values():
            found.extend(_one_ofs(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_one_ofs(item))
    return found


def test_no_one_of_lets_a_value_match_two_branches() -> None:
    doc = document(create_app())  # as /schema/openapi.json serves it
    known = doc["components"]["schemas"]["Known"]
    # A known fact's value is a boolean, a number (integers included) or a string: one branch each.
    assert [b["type"] for b in known["properties"]["value"]["oneOf"]] == ["boolean", "number", "string"]
    for branches in _one_ofs(doc):
        types = [b.get("type") for b in branches if isinstance(b, dict) and "type" in b]
        for i, a in enumerate(types):
            for b in types[i + 1 :]:
                assert a != b and (a, b) not in _OVERLAPS, branches
