"""Shell completion comes from the framework: `modelforge-hw completion bash|zsh|fish` prints
Typer's script, each shell loads it without error, and at a TAB the script asks `modelforge-hw`
itself, which answers from its command tree (subcommands at every level, flags, fixed choices).

The scripts call `modelforge-hw` by name, so these tests put this interpreter's console scripts
first on PATH. bash is assumed; zsh and fish are installed with apt-get on a fresh machine (the
tests fail when they cannot be).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import debian
from tests.cli_support import command_tree

BIN = Path(sys.executable).parent
PROGRAM = "modelforge-hw"


def env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MODELFORGE_", "_MODELFORGE"))}
    return {**clean, "PATH": f"{BIN}{os.pathsep}{clean.get('PATH', '')}"}


def script(shell: str) -> str:
    done = subprocess.run(
        [str(BIN / PROGRAM), "completion", shell],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def installed(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        why = debian.install(name)
        path = shutil.which(name)
        assert path is not None, f"{name} cannot be installed: {why or 'not on PATH after install'}"
    return path


def top_level() -> set[str]:
    return set(command_tree()[0].subcommands)


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_each_shell_gets_the_framework_script(shell: str) -> None:
    text = script(shell)
    assert "_MODELFORGE_HW_COMPLETE=complete_" + shell in text and PROGRAM in text
    # The console script is the program the completion asks.
    assert (BIN / PROGRAM).exists()


def test_an_unknown_shell_is_a_usage_error() -> None:
    done = subprocess.run(
        [str(BIN / PROGRAM), "completion", "tcsh"], capture_output=True, text=True, env=env(), timeout=60
    )
    assert done.returncode == 2 and "tcsh" in done.stderr


# --- bash ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bash") / "modelforge-hw.bash"
    path.write_text(script("bash"), encoding="utf-8")
    return path


def bash_complete(path: Path, *words: str) -> list[str]:
    """What bash offers for the command line `words` (the last one is being completed)."""
    program = (
        f'source "{path}"; COMP_WORDS=("$@"); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 )); '
        f'_modelforge_hw_completion {PROGRAM}; printf "%s\\n" "${{COMPREPLY[@]}}"'
    )
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", program, "bash", PROGRAM, *words],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def test_bash_loads_the_script(bash_script: Path) -> None:
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", f'source "{bash_script}" && complete -p {PROGRAM}'],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # Where the program has nothing to offer (a path), bash falls back to its own file names.
    assert "-o default" in done.stdout and "_modelforge_hw_completion" in done.stdout


def test_bash_completes_commands_flags_and_choices(bash_script: Path) -> None:
    assert set(bash_complete(bash_script, "")) == top_level()
    assert {"serve", "agent", "token", "node", "gpu", "events", "completion"} <= top_level()
    assert bash_complete(bash_script, "reb") == ["rebuild"]
    assert set(bash_complete(bash_script, "agent", "")) == {"enroll", "run", "status"}
    assert set(bash_complete(bash_script, "serve", "--st")) == {
        "--state-cache-streams",
        "--state-dir",
        "--startup-refresh",
        "--stale-after",
    }
    # A flag's fixed choices; a flag's value is not taken for a subcommand.
    assert set(bash_complete(bash_script, "replay", "--class", "")) == {"lifecycle", "observation"}
    assert bash_complete(bash_script, "token", "create", "--ttl", "1h", "--u") == ["--uses"]
    assert set(bash_complete(bash_script, "gpu", "list", "--state", "")) == {
        "active",
        "missing",
        "decommissioned",
    }


# --- zsh ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zsh() -> str:
    return installed("zsh")


def test_zsh_loads_the_script(zsh: str, tmp_path: Path) -> None:
    path = tmp_path / "modelforge-hw.zsh"
    path.write_text(script("zsh"), encoding="utf-8")
    done = subprocess.run(
        [
            zsh,
            "-f",
            "-c",
            f"autoload -Uz compinit && compinit -u && source {path} && (( $+_comps[{PROGRAM}] ))",
        ],
        capture_output=True,
        text=True,
        env={**env(), "HOME": str(tmp_path)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and done.stderr == "", done.stdout + done.stderr


def test_zsh_gets_its_answers(zsh: str) -> None:
    """What the zsh script asks at a TAB (the words so far), and the `_arguments` call it evals."""

    def answer(line: str) -> str:
        done = subprocess.run(
            [PROGRAM],
            capture_output=True,
            text=True,
            env={**env(), "_MODELFORGE_HW_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": line},
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    offered = answer(f"{PROGRAM} node ")
    assert offered.startswith("_arguments") and '"list"' in offered and '"show"' in offered
    assert '"--follow"' in answer(f"{PROGRAM} events --f")


# --- fish ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fish() -> str:
    return installed("fish")


def fish_complete(fish: str, line: str, tmp_path: Path) -> list[str]:
    """What fish offers for the command line `line` (completing its last word)."""
    path = tmp_path / "modelforge-hw.fish"
    if not path.exists():
        path.write_text(script("fish"), encoding="utf-8")
    done = subprocess.run(
        [fish, "--no-config", "-c", f"source {path}; complete -C {shlex.quote(line)}"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return sorted({entry.split("\t")[0] for entry in done.stdout.splitlines() if entry})


def test_fish_completes_commands_flags_and_choices(fish: str, tmp_path: Path) -> None:
    assert set(fish_complete(fish, f"{PROGRAM} ", tmp_path)) == top_level()
    assert fish_complete(fish, f"{PROGRAM} node ", tmp_path) == ["list", "show", "telemetry"]
    assert fish_complete(fish, f"{PROGRAM} events -o ", tmp_path) == ["json", "table", "wide", "yaml"]
    assert fish_complete(fish, f"{PROGRAM} replay --class ", tmp_path) == ["lifecycle", "observation"]
    assert fish_complete(fish, f"{PROGRAM} completion ", tmp_path) == ["bash", "fish", "zsh"]
