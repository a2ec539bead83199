"""Facts as the read models store them (jsonb in the availability form), decoded for a body."""

from __future__ import annotations

from typing import Any

import msgspec

from collectors.facts import Fact, Known, TemporarilyFailed, Unavailable, Unknown, Unsupported

_FACT_CLASSES: dict[str, type[Any]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (Known, Unknown, Unsupported, Unavailable, TemporarilyFailed)
}


def stored_fact(value: Any) -> Fact:
    """A stored fact (jsonb builtins) as its class."""
    # Converting into the concrete class: converting into the `Fact` union costs ~20x more, since
    # msgspec rebuilds the union's type information on every call.
    try:
        cls = _FACT_CLASSES[value["state"]]
    except (KeyError, TypeError) as exc:
        raise msgspec.ValidationError(f"not an availability-typed fact: {value!r}") from exc
    fact: Fact = msgspec.convert(value, cls)
    return fact


def stored_facts(value: Any) -> dict[str, Fact]:
    """A stored map of facts (or NULL) as classes."""
    return {k: stored_fact(v) for k, v in (value or {}).items()}


def plain(fact: Fact) -> Any:
    """The value of a known fact, None otherwise (the bodies' plain fields)."""
    return fact.value if isinstance(fact, Known) else None
