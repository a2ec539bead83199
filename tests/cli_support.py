"""The `modelforge-hw` command tree as Typer builds it, for the tests that hold docs, deploy files
and shell completion to it: every command path with its subcommands and flags, and a command line
parsed the way the CLI parses it, without running it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import typer

from api.cli.errors import PROGRAM
from api.cli.main import app


@dataclass
class Command:
    path: tuple[str, ...]
    subcommands: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)


def command_tree() -> list[Command]:
    """Every command, depth first, the root (path ()) first."""
    commands: list[Command] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        children: dict[str, Any] = dict(getattr(command, "commands", {}) or {})
        options = [
            name
            for param in command.params
            if param.param_type_name == "option"
            for name in (*param.opts, *param.secondary_opts)
        ]
        commands.append(Command(path, subcommands=list(children), options=[*options, "-h", "--help"]))
        for name, child in children.items():
            walk(child, (*path, name))

    walk(typer.main.get_command(app), ())
    return commands


def parse(argv: list[str]) -> tuple[str, ...]:
    """The command path `argv` names, its every option and value checked as the CLI checks them
    (a usage error raises); nothing runs."""
    command: Any = typer.main.get_command(app)
    context = command.make_context(PROGRAM, list(argv))
    path: list[str] = []
    while getattr(command, "commands", None):
        name, command, rest = command.resolve_command(context, [*context._protected_args, *context.args])
        path.append(name)
        context = command.make_context(name, rest, parent=context)
    return tuple(path)
