"""What an operator reads is generated from the code or checked against it, so it cannot drift:

* docs/configuration.md and docs/event-catalog.md equal what api/cli/reference.py renders from
  `runtime.settings.SETTINGS (re-exported by api.config)` and `ledger.events` (regenerate with `python -m api.cli.reference --write`);
* every `MODELFORGE_*` variable the product code reads is declared in SETTINGS (and so in the
  reference), every declared one is read somewhere, and every flag SETTINGS names exists;
* every `modelforge-hw` subcommand is shown in README.md or docs/ (in code).

Shell completion is tests/test_completion.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

from api.cli.reference import CATALOG_PAGE, CONFIG_PAGE, render_config_reference, render_event_catalog
from api.config import SETTINGS
from tests.cli_support import command_tree

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_PACKAGES = ("runtime", "ledger", "domain", "projections", "collectors", "agent", "api")
VARIABLE = re.compile(r"\bMODELFORGE_[A-Z0-9_]*[A-Z0-9]\b")
REGENERATE = "run `python -m api.cli.reference --write` and commit the result"


# --- generated reference pages ------------------------------------------------------------------


def test_configuration_reference_is_up_to_date() -> None:
    assert CONFIG_PAGE == ROOT / "docs" / "configuration.md"
    assert CONFIG_PAGE.exists(), f"{CONFIG_PAGE} is missing: {REGENERATE}"
    assert CONFIG_PAGE.read_text(encoding="utf-8") == render_config_reference(), (
        f"docs/configuration.md is out of date with api/config.py SETTINGS: {REGENERATE}"
    )


def test_event_catalog_is_up_to_date() -> None:
    assert CATALOG_PAGE == ROOT / "docs" / "event-catalog.md"
    assert CATALOG_PAGE.exists(), f"{CATALOG_PAGE} is missing: {REGENERATE}"
    assert CATALOG_PAGE.read_text(encoding="utf-8") == render_event_catalog(), (
        f"docs/event-catalog.md is out of date with ledger/events.py: {REGENERATE}"
    )


def test_reference_lists_every_setting() -> None:
    page = render_config_reference()
    for s in SETTINGS:
        assert f"`{s.env}`" in page


# --- MODELFORGE_* variables ---------------------------------------------------------------------


def variables_in_product_code(*, without_declarations: bool = False) -> dict[str, list[str]]:
    """Every MODELFORGE_* name in the product's Python files -> where it appears; optionally
    leaving out the SETTINGS table itself (where names are declared, not read)."""
    found: dict[str, list[str]] = {}
    for package in PRODUCT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if without_declarations and path == ROOT / "runtime" / "settings.py":
                table = re.search(r"^SETTINGS\b.*?^\)$", text, flags=re.M | re.S)
                assert table is not None, "runtime/settings.py has no SETTINGS table"
                text = text[: table.start()] + "\n" * table.group().count("\n") + text[table.end() :]
            for number, line in enumerate(text.splitlines(), 1):
                for name in VARIABLE.findall(line):
                    found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{number}")
    return found


def test_every_variable_the_code_reads_is_in_settings() -> None:
    declared = {s.env for s in SETTINGS}
    missing = {name: where for name, where in variables_in_product_code().items() if name not in declared}
    assert not missing, (
        "MODELFORGE_* variables used in the code but missing from api/config.py SETTINGS (and so "
        "from docs/configuration.md); declare them there, then "
        + REGENERATE
        + ":\n"
        + "\n".join(f"  {name}  ({', '.join(where[:3])})" for name, where in sorted(missing.items()))
    )


def test_every_setting_is_read_by_the_code() -> None:
    """Read by its variable's name, or (the usual way now) through the model by its own name."""
    used = variables_in_product_code(without_declarations=True)
    code = "\n".join(
        path.read_text(encoding="utf-8")
        for package in PRODUCT_PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != ROOT / "runtime" / "settings.py"
    )
    unread = [s.env for s in SETTINGS if s.env not in used and not re.search(rf"[\"'.]{s.name}\b", code)]
    assert not unread, f"declared in SETTINGS (and documented) but read nowhere in the code: {unread}"


def all_options() -> set[str]:
    return {option for command in command_tree() for option in command.options}


def test_every_flag_in_settings_exists_in_the_cli() -> None:
    options = all_options()
    for s in SETTINGS:
        if s.flag:
            for flag in s.flag.split("/"):
                assert flag in options, f"{s.env}: SETTINGS names the flag {flag}, which no command has"


# --- the CLI in the docs ------------------------------------------------------------------------


def documentation_code() -> str:
    """The code in README.md and docs/**/*.md: fenced blocks and inline spans."""
    chunks: list[str] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
        chunks += fenced
        rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
        chunks += re.findall(r"`([^`\n]+)`", rest)
    return "\n".join(chunks)


def test_every_cli_command_is_documented() -> None:
    code = documentation_code()
    missing = []
    for command in command_tree():
        if command.path:
            phrase = " ".join(command.path)
            if not re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", code):
                missing.append(phrase)
    assert not missing, (
        "modelforge-hw commands not shown in README.md or docs/*.md (in a code span or block): "
        + ", ".join(missing)
    )
