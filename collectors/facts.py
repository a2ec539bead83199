"""Availability-typed facts (docs/architecture.md, "Availability of a fact").

Every optional fact is one of five states; only ``known`` carries a value, and 0 is a value.
The wire and storage form is ``{"state": "known", "value": v}`` etc., which msgspec produces
directly from this tagged union.
"""

from __future__ import annotations

from typing import Generic, TypeAlias

import msgspec
from typing_extensions import TypeVar

FactValue: TypeAlias = bool | int | float | str

# A known value's type and a reason's. The observation's fields narrow them to the contract's
# bounds for the server's decode (collectors/contract.py); everything else (the ledger's events
# and checkpoints) reads a fact with these, the widest, whatever a release stored.
V = TypeVar("V", bound=FactValue, default=FactValue, covariant=True)
R = TypeVar("R", bound=str, default=str, covariant=True)

# A fact holds a scalar or nothing, so it can never be part of a reference cycle: the garbage
# collector need not track one (gc=False). An agent's report decodes into about a hundred and
# fifty of them (agent/protocol.py `decode_report`), and kept states hold thousands.


class Known(msgspec.Struct, Generic[V], frozen=True, tag_field="state", tag="known", gc=False):
    value: V


class Unknown(msgspec.Struct, frozen=True, tag_field="state", tag="unknown", gc=False):
    pass


class Unsupported(msgspec.Struct, frozen=True, tag_field="state", tag="unsupported", gc=False):
    pass


class Unavailable(msgspec.Struct, Generic[R], frozen=True, tag_field="state", tag="unavailable", gc=False):
    reason: R


class TemporarilyFailed(
    msgspec.Struct, Generic[R], frozen=True, tag_field="state", tag="temporarily_failed", gc=False
):
    reason: R


Fact: TypeAlias = Known | Unknown | Unsupported | Unavailable | TemporarilyFailed

UNKNOWN = Unknown()
UNSUPPORTED = Unsupported()
