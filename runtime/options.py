"""Command-line options from the one configuration model (runtime/settings.py), for Typer: the
operator CLI (api/cli) and the agent's (agent/cli.py) take every option that is a setting from
here, so a flag, its variable and its default are written down once.

Two ways to bind one:

* `setting_option`: the flag alone, its value checked by the model (a bad one is a usage error
  naming the flag, exit 2). Left None when not given: the command then reads the variable
  through the model, whose refusal names the variable in one line, or takes the default.
* `variable_option`: Typer reads the variable itself, so that a required option that is missing
  is refused naming both the flag and the variable (the commands over HTTP).
"""

from __future__ import annotations

from typing import Any

import typer

from runtime.settings import SettingError, Value, parse, setting


def _flag(name: str) -> str:
    flag = setting(name).flag
    assert flag is not None, f"{name} has no flag"
    return flag


def setting_option(name: str, *, help: str | None = None) -> Any:
    """The option `name` as a Typer option, its variable and default named in its help."""
    s = setting(name)
    flag = _flag(name)
    text = f"{help or s.help} (env {s.env}, default {s.default})"
    if s.kind == "bool":
        return typer.Option(flag, help=text, show_default=False)

    def convert(value: str) -> Value:
        try:
            return parse(s, value, source=flag)
        except SettingError:
            raise typer.BadParameter(f"is not {s.accepts}") from None

    return typer.Option(flag, parser=convert, help=text, show_default=False)


def variable_option(name: str) -> Any:
    """The option `name` bound by Typer to its flag and its variable."""
    s = setting(name)
    return typer.Option(
        _flag(name), envvar=s.env, help=s.help.removeprefix("Operator CLI: "), show_default=False
    )
