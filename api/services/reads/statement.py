"""Statements of fixed SQL fragments and named, numbered parameters.

A read that filters puts together its WHERE clause from the filters given. Here every fragment is
a constant of the code (`LiteralString`) and every value a named slot, `{name}`, that becomes a
numbered parameter (`$1`, `$2`, ... in the order the slots first appear): no value, and no text a
caller sent, ever becomes SQL. A statement depends only on which filters are given, so each
shape is built once (the readers keep them with `functools.cache`) and a request only orders its
values (`Statement.args`).
"""

from __future__ import annotations

from collections.abc import Mapping
from string import Formatter
from typing import LiteralString

import msgspec


class Statement(msgspec.Struct, frozen=True):
    """The SQL text and the name of each of its parameters, `$1` first."""

    sql: str
    slots: tuple[str, ...]

    def args(self, values: Mapping[str, object]) -> list[object]:
        """The statement's parameters from `values` (names of slots it lacks are not sent)."""
        missing = [name for name in self.slots if name not in values]
        if missing:
            raise KeyError(f"no value for the statement's slots {missing}")
        return [values[name] for name in self.slots]


def slots_of(fragment: str) -> list[str]:
    """The slots of a fragment in the order they appear; ValueError for a field that is not a
    plain name (`{}`, `{0}`, `{x!r}`, `{x:>3}`): a fragment holds slots, never formatting."""
    found: list[str] = []
    for _, name, spec, conversion in Formatter().parse(fragment):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"not a plain slot: {{{name}{'!' + conversion if conversion else ''}}}")
        found.append(name)
    return found


class Query:
    """Builds a `Statement`: fragments in order, with the one WHERE clause's conditions joined by
    AND where the first `where` stands."""

    def __init__(self, fragment: LiteralString = "") -> None:
        self._parts: list[str] = [fragment]
        self._where = "none"  # none -> open (conditions being added) -> closed

    def add(self, fragment: LiteralString) -> Query:
        if self._where == "open":
            self._where = "closed"
        self._parts.append(fragment)
        return self

    def where(self, condition: LiteralString) -> Query:
        if self._where == "closed":
            raise ValueError("a statement's conditions stand together in its one WHERE clause")
        self._parts.append((" WHERE " if self._where == "none" else " AND ") + condition)
        self._where = "open"
        return self

    def build(self) -> Statement:
        text = "".join(self._parts)
        slots: list[str] = []
        for name in slots_of(text):
            if name not in slots:
                slots.append(name)
        numbers = {name: f"${k}" for k, name in enumerate(slots, 1)}
        return Statement(text.format_map(numbers), tuple(slots))
