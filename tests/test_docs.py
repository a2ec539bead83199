"""What an operator reads is generated from the code or checked against it, so it cannot drift:

* docs/configuration.md and docs/event-catalog.md equal what api/cli/reference.py renders from
  `runtime.settings.SETTINGS (re-exported by api.config)` and `ledger.events` (regenerate with `python -m api.cli.reference --write`);
* every `MODELFORGE_*` variable the product code reads is declared in SETTINGS (and so in the
  reference), every declared one is read somewhere, and every flag SETTINGS names exists;
* every `modelforge-hw` subcommand is shown in README.md or docs/ (in code);
* shell completion (`modelforge-hw completion bash|zsh`) offers every subcommand and flag.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from api.cli.completion import command_tree
from api.cli.main import build_parser
from api.cli.reference import CATALOG_PAGE, CONFIG_PAGE, render_config_reference, render_event_catalog
from api.config import SETTINGS

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
            if without_declarations and path == ROOT / "ledger" / "settings.py":
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
        if path != ROOT / "ledger" / "settings.py"
    )
    unread = [s.env for s in SETTINGS if s.env not in used and not re.search(rf"[\"'.]{s.name}\b", code)]
    assert not unread, f"declared in SETTINGS (and documented) but read nowhere in the code: {unread}"


def all_options() -> set[str]:
    return {option for command in command_tree(build_parser()) for option in command.options}


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
    for command in command_tree(build_parser()):
        if command.path:
            phrase = " ".join(command.path)
            if not re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", code):
                missing.append(phrase)
    assert not missing, (
        "modelforge-hw commands not shown in README.md or docs/*.md (in a code span or block): "
        + ", ".join(missing)
    )


# --- shell completion ---------------------------------------------------------------------------


def completion(shell: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "api.cli", "completion", shell],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def bash_script() -> str:
    return completion("bash")


def test_bash_completion_lists_every_subcommand_and_flag(bash_script: str) -> None:
    assert "complete -F _modelforge_hw modelforge-hw" in bash_script
    commands = command_tree(build_parser())
    assert {"serve", "migrate", "refresh", "rebuild", "agent", "token", "completion"} <= set(
        commands[0].subcommands
    )
    for command in commands:
        for name in command.subcommands:
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", bash_script), name
        for option in command.options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", bash_script), (command.path, option)


def complete(script: str, words: list[str], tmp_path: Path) -> list[str]:
    """What bash offers for the command line `words` (the last one is being completed)."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    path = tmp_path / "completion.bash"
    path.write_text(script, encoding="utf-8")
    program = (
        f'source "{path}"; COMP_WORDS=("$@"); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); '
        'COMP_LINE="${COMP_WORDS[*]}"; COMP_POINT=${#COMP_LINE}; _modelforge_hw; '
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    done = subprocess.run(
        [bash, "--norc", "--noprofile", "-c", program, "bash", *words],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def test_bash_completion_completes(bash_script: str, tmp_path: Path) -> None:
    top = complete(bash_script, ["modelforge-hw", ""], tmp_path)
    assert set(top) == set(command_tree(build_parser())[0].subcommands)
    assert complete(bash_script, ["modelforge-hw", "reb"], tmp_path) == ["rebuild"]
    assert complete(bash_script, ["modelforge-hw", "retention", ""], tmp_path) == ["run"]
    assert set(complete(bash_script, ["modelforge-hw", "agent", ""], tmp_path)) == {"enroll", "run", "status"}
    assert complete(bash_script, ["modelforge-hw", "completion", "z"], tmp_path) == ["zsh"]
    assert set(complete(bash_script, ["modelforge-hw", "serve", "--st"], tmp_path)) == {
        "--state-cache-streams",
        "--state-dir",
        "--startup-refresh",
        "--stale-after",
    }
    # A flag's fixed choices, also after `--flag=`; a flag's value is not taken for a subcommand.
    assert set(complete(bash_script, ["modelforge-hw", "replay", "--class", ""], tmp_path)) == {
        "lifecycle",
        "observation",
    }
    assert complete(bash_script, ["modelforge-hw", "replay", "--class", "=", "obs"], tmp_path) == [
        "observation"
    ]
    assert complete(bash_script, ["modelforge-hw", "token", "create", "--ttl", "1h", "--u"], tmp_path) == [
        "--uses"
    ]
    # Directories for --state-dir.
    (tmp_path / "state-here").mkdir()
    offered = complete(
        bash_script, ["modelforge-hw", "agent", "run", "--state-dir", f"{tmp_path}/state-"], tmp_path
    )
    assert offered == [f"{tmp_path}/state-here"]


def test_bash_completion_is_valid_bash(bash_script: str, tmp_path: Path) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    path = tmp_path / "completion.bash"
    path.write_text(bash_script, encoding="utf-8")
    done = subprocess.run([bash, "-n", str(path)], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr


def test_zsh_completion_wraps_the_bash_one(bash_script: str, tmp_path: Path) -> None:
    script = completion("zsh")
    assert "bashcompinit" in script and "compdef" in script
    assert bash_script in script
    zsh = shutil.which("zsh")
    if zsh is not None:
        path = tmp_path / "completion.zsh"
        path.write_text(script, encoding="utf-8")
        done = subprocess.run(
            [zsh, "-f", "-c", f"source {path} && (( $+_comps[modelforge-hw] ))"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def fish() -> str:
    """fish itself, installed with apt-get on a fresh machine (the test fails when it cannot be)."""
    from tests.test_deploy import _apt_install

    path = shutil.which("fish")
    if path is None:
        why = _apt_install("fish")
        path = shutil.which("fish")
        assert path is not None, f"fish cannot be installed: {why or 'not on PATH after install'}"
    return path


def fish_complete(fish: str, line: str, tmp_path: Path) -> list[str]:
    """What fish offers for the command line `line` (completing its last word)."""
    script = tmp_path / "modelforge-hw.fish"
    script.write_text(completion("fish"), encoding="utf-8")
    done = subprocess.run(
        [fish, "--no-config", "-c", f"source {script}; complete -C {shlex.quote(line)}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return sorted({entry.split("\t")[0] for entry in done.stdout.splitlines() if entry})


def test_fish_completion_completes(fish: str, tmp_path: Path) -> None:
    top = fish_complete(fish, "modelforge-hw ", tmp_path)
    assert set(top) == set(command_tree(build_parser())[0].subcommands)
    assert {"node", "gpu", "events", "serve"} <= set(top)
    assert fish_complete(fish, "modelforge-hw node ", tmp_path) == ["list", "show"]
    assert fish_complete(fish, "modelforge-hw events -o ", tmp_path) == ["json", "table", "wide", "yaml"]
    assert "--follow" in fish_complete(fish, "modelforge-hw events --f", tmp_path)
    assert fish_complete(fish, "modelforge-hw replay --class ", tmp_path) == ["lifecycle", "observation"]
    assert fish_complete(fish, "modelforge-hw retention run --ret", tmp_path) == ["--retention-hours"]
    assert fish_complete(fish, "modelforge-hw completion ", tmp_path) == ["bash", "fish", "zsh"]


def test_bash_completion_knows_the_operator_commands(bash_script: str, tmp_path: Path) -> None:
    assert complete(bash_script, ["modelforge-hw", "gpu", ""], tmp_path) == ["list", "show"]
    assert set(complete(bash_script, ["modelforge-hw", "gpu", "list", "--state", ""], tmp_path)) == {
        "active",
        "missing",
        "decommissioned",
    }
