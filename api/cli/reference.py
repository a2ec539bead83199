"""Reference pages generated from the code, so they cannot drift: the configuration reference
(every flag and MODELFORGE_* variable with its default) and the event catalog (every event type
and its fields). `python -m api.cli.reference --write` regenerates them; a test fails when docs/ is
out of date."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

import msgspec

from api.config import SETTINGS
from ledger.events import EVENT_TYPES, OBSERVATION_EVENT_TYPES, EventMetadata

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONFIG_PAGE = DOCS / "configuration.md"
CATALOG_PAGE = DOCS / "event-catalog.md"


def _type_name(tp: object) -> str:
    text = (
        str(tp)
        .replace("typing.", "")
        .replace("collectors.facts.", "")
        .replace("collectors.observations.", "")
    )
    text = text.replace("ledger.events.", "").replace("<class '", "").replace("'>", "")
    return text.replace("Known | Unknown | Unsupported | Unavailable | TemporarilyFailed", "Fact")


def render_config_reference() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the one configuration model, `runtime/settings.py`, shared by the server, the",
        "operator CLI and the agent (`python -m api.cli.reference --write`); a test fails when this page",
        "differs from the code. Flags win over environment variables, which win over defaults. A bad",
        "value is refused with one line naming the variable (or flag) and what it accepts; exit 2.",
        "",
        "| environment variable | flag | default | accepts | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        flag = f"`{s.flag}`" if s.flag else "—"
        lines.append(f"| `{s.env}` | {flag} | {s.default} | {s.accepts} | {s.help} |")
    return "\n".join(lines) + "\n"


def render_event_catalog() -> str:
    lines = [
        "# Event catalog",
        "",
        "Generated from `ledger/events.py` (`python -m api.cli.reference --write`); a test fails when this",
        "page differs from the code. Every event is stored with `event_id`, `event_type`,",
        "`schema_version`, `data` (the fields below, jsonb), `metadata`, `recorded_at`, a global",
        "position and a stream version. `metadata` holds "
        + ", ".join(f"`{f.encode_name}`" for f in msgspec.structs.fields(EventMetadata))
        + ".",
        "Lifecycle events are permanent and hash-chained per stream; observation events",
        'are retention-bounded. A `Fact` is `{"state": "known", "value": v}` | `{"state": "unknown"}` |',
        '`{"state": "unsupported"}` | `{"state": "unavailable", "reason": r}` |',
        '`{"state": "temporarily_failed", "reason": r}`.',
        "",
    ]
    for name in sorted(EVENT_TYPES, key=lambda n: (n in OBSERVATION_EVENT_TYPES, n)):
        cls = EVENT_TYPES[name]
        cls_class = "observation" if name in OBSERVATION_EVENT_TYPES else "lifecycle"
        doc = (cls.__doc__ or "").strip().splitlines()
        lines.append(f"## `{name}` ({cls_class})")
        lines.append("")
        if doc and not doc[0].startswith("Base of"):
            lines.append(" ".join(d.strip() for d in doc))
            lines.append("")
        hints = typing.get_type_hints(cls)
        lines.append("| field | type |")
        lines.append("| --- | --- |")
        for field in msgspec.structs.fields(cls):
            lines.append(f"| `{field.encode_name}` | `{_type_name(hints[field.name])}` |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    pages = {CONFIG_PAGE: render_config_reference(), CATALOG_PAGE: render_event_catalog()}
    if "--write" in argv:
        for path, text in pages.items():
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
        return 0
    stale = [str(p) for p, text in pages.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    for p in stale:
        print(f"out of date: {p} (run python -m api.cli.reference --write)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
