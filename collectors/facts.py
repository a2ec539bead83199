"""Availability-typed facts (docs/architecture.md, "Availability of a fact").

Every optional fact is one of five states; only ``known`` carries a value, and 0 is a value.
The wire and storage form is ``{"state": "known", "value": v}`` etc., which msgspec produces
directly from this tagged union.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

FactValue: TypeAlias = bool | int | float | str

# A fact holds a scalar or nothing, so it can never be part of a reference cycle: the garbage
# collector need not track one (gc=False). An agent's report decodes into about a hundred and
# fifty of them, twice (api/services/reports.py), and kept states hold thousands.


class Known(msgspec.Struct, frozen=True, tag_field="state", tag="known", gc=False):
    value: FactValue


class Unknown(msgspec.Struct, frozen=True, tag_field="state", tag="unknown", gc=False):
    pass


class Unsupported(msgspec.Struct, frozen=True, tag_field="state", tag="unsupported", gc=False):
    pass


class Unavailable(msgspec.Struct, frozen=True, tag_field="state", tag="unavailable", gc=False):
    reason: str


class TemporarilyFailed(msgspec.Struct, frozen=True, tag_field="state", tag="temporarily_failed", gc=False):
    reason: str


Fact: TypeAlias = Known | Unknown | Unsupported | Unavailable | TemporarilyFailed

UNKNOWN = Unknown()
UNSUPPORTED = Unsupported()
