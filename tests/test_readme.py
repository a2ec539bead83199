"""The README opens with exactly two set-up commands, and CI runs the same test command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```sh", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_readme_has_exactly_two_setup_commands_run_then_test() -> None:
    run, test = setup_commands()
    assert "modelforge-hw serve" in run
    assert "tests/run_all.py" in test


def test_ci_runs_the_readme_test_command_word_for_word() -> None:
    _, test = setup_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci
