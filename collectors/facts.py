"""Availability-typed facts (docs/architecture.md, "Availability of a fact").

Every optional fact is one of five states; only ``known`` carries a value, and 0 is a value.
The wire and storage form is ``{"state": "known", "value": v}`` etc., which msgspec produces
directly from this tagged union.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

FactValue: TypeAlias = bool | int | float | str


class Known(msgspec.Struct, frozen=True, tag_field="state", tag="known"):
    value: FactValue


class Unknown(msgspec.Struct, frozen=True, tag_field="state", tag="unknown"):
    pass


class Unsupported(msgspec.Struct, frozen=True, tag_field="state", tag="unsupported"):
    pass


class Unavailable(msgspec.Struct, frozen=True, tag_field="state", tag="unavailable"):
    reason: str


class TemporarilyFailed(msgspec.Struct, frozen=True, tag_field="state", tag="temporarily_failed"):
    reason: str


Fact: TypeAlias = Known | Unknown | Unsupported | Unavailable | TemporarilyFailed

UNKNOWN = Unknown()
UNSUPPORTED = Unsupported()
