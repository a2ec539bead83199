"""`modelforge-hw completion bash|zsh|fish`: the framework's (Typer's) shell completion script.

The script holds no command tree: at each TAB it asks `modelforge-hw` itself, with
`_MODELFORGE_HW_COMPLETE` set, and Typer answers from the commands as they are, so every
subcommand, flag and choice completes as soon as it exists.

    source <(modelforge-hw completion bash)                      # this shell
    modelforge-hw completion bash | sudo tee /etc/bash_completion.d/modelforge-hw
    source <(modelforge-hw completion zsh)                       # zsh, after compinit
    modelforge-hw completion fish | source                       # fish

`modelforge-hw --install-completion` installs the current shell's script where that shell looks.
"""

from __future__ import annotations

import enum
from typing import Annotated

import typer
from typer._completion_shared import get_completion_script

from api.cli.errors import PROGRAM

COMPLETE_VAR = "_" + PROGRAM.replace("-", "_").upper() + "_COMPLETE"


class Shell(enum.StrEnum):
    bash = "bash"
    zsh = "zsh"
    fish = "fish"


def completion(shell: Annotated[Shell, typer.Argument(help="bash, zsh or fish", show_default=False)]) -> int:
    """print a shell completion script"""
    print(get_completion_script(prog_name=PROGRAM, complete_var=COMPLETE_VAR, shell=shell.value))
    return 0
