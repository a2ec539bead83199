"""`modelforge-hw completion bash|zsh|fish`: shell completion generated from the command tree.

The script is derived from `api.cli.build_parser()` every time it is printed, so a new subcommand
or flag completes as soon as it exists. It completes subcommands at every level (`retention run`,
`token create`, `agent enroll`, ...), each command's flags, the values of flags with fixed
choices (`replay --class lifecycle|observation`), directories for `--*-dir` and files for
`--*-file` flags. zsh runs the same script through `bashcompinit`.

    source <(modelforge-hw completion bash)                      # this shell
    modelforge-hw completion bash | sudo tee /etc/bash_completion.d/modelforge-hw
    source <(modelforge-hw completion zsh)                       # zsh, e.g. in ~/.zshrc
    modelforge-hw completion fish | source                       # fish

The operator commands over HTTP (`node`, `gpu`, `events`) are Typer commands; their part of the
tree is read from Typer's own command objects (`api.cli.operator.command_specs`), so one script
completes both.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

PROGRAM = "modelforge-hw"
FUNCTION = "_modelforge_hw"
SHELLS = ("bash", "zsh", "fish")


@dataclass
class Command:
    """One (sub)command of the parser: what may follow it on the command line."""

    path: tuple[str, ...]
    subcommands: list[str] = field(default_factory=list)
    choices: list[str] = field(default_factory=list)  # fixed words of positional arguments
    options: list[str] = field(default_factory=list)
    # option -> its fixed choices, or "dir" / "file" / "" (a value without completion)
    values: dict[str, list[str] | str] = field(default_factory=dict)


def _value_kind(action: argparse.Action) -> list[str] | str:
    if action.choices is not None:
        return [str(c) for c in action.choices]
    name = f"{action.dest} {action.metavar or ''} {' '.join(action.option_strings)}".lower()
    if "dir" in name:
        return "dir"
    if "file" in name:
        return "file"
    return ""


def command_tree(parser: argparse.ArgumentParser) -> list[Command]:
    """Every command of `parser`, depth first, the root (path ()) first."""
    commands: list[Command] = []

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        command = Command(path)
        commands.append(command)
        children: list[tuple[str, argparse.ArgumentParser]] = []
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    command.subcommands.append(name)
                    children.append((name, child))
            elif action.option_strings:
                command.options.extend(action.option_strings)
                if action.nargs != 0:
                    for option in action.option_strings:
                        command.values[option] = _value_kind(action)
            elif action.choices is not None:
                command.choices.extend(str(c) for c in action.choices)
        for name, child in children:
            walk(child, (*path, name))

    walk(parser, ())
    # The operator commands over HTTP are Typer commands: argparse only lists their names, so
    # their subcommands and options come from Typer's own command tree.
    from api.cli.operator import COMMANDS, command_specs

    commands = [c for c in commands if not (c.path and c.path[0] in COMMANDS)]
    for path, subcommands, options, values in command_specs():
        commands.append(Command(path, subcommands=subcommands, options=options, values=values))
    return commands


def _q(text: str) -> str:
    return shlex.quote(text)


def _case(function: str, arms: list[tuple[str, str]], args: str) -> list[str]:
    """A shell function `function ARGS` that echoes the word list of the matching arm."""
    lines = [f"{function}() {{", f'    case "{args}" in']
    for key, words in arms:
        if words:
            lines.append(f"        {_q(key)}) echo {_q(words)} ;;")
    lines += ["    esac", "}"]
    return lines


def render_bash(parser: argparse.ArgumentParser) -> str:
    commands = command_tree(parser)
    words = [(" ".join(c.path), " ".join(c.subcommands + c.choices)) for c in commands]
    subcommands = [(" ".join(c.path), " ".join(c.subcommands)) for c in commands]
    options = [(" ".join(c.path), " ".join(c.options)) for c in commands]
    takes_value: list[str] = []
    choices: list[tuple[str, str]] = []
    kinds: list[tuple[str, str]] = []
    for c in commands:
        for option, kind in c.values.items():
            key = f"{' '.join(c.path)}:{option}"
            takes_value.append(key)
            if isinstance(kind, list):
                choices.append((key, " ".join(kind)))
            elif kind:
                kinds.append((key, kind))

    lines = [
        f"# {PROGRAM} completion for bash (and zsh through bashcompinit).",
        f"# Generated from the argparse parser by `{PROGRAM} completion bash`; regenerate after an upgrade.",
        "",
    ]
    lines += _case(f"{FUNCTION}_words", words, "$1")
    lines += _case(f"{FUNCTION}_subcommands", subcommands, "$1")
    lines += _case(f"{FUNCTION}_options", options, "$1")
    lines += _case(f"{FUNCTION}_choices", choices, "$1:$2")
    lines += _case(f"{FUNCTION}_kind", kinds, "$1:$2")
    lines += [f"{FUNCTION}_takes_value() {{", '    case "$1:$2" in']
    if takes_value:
        lines.append("        " + "|".join(_q(k) for k in takes_value) + ") return 0 ;;")
    lines += ["    esac", "    return 1", "}", ""]
    lines += f"""\
{FUNCTION}() {{
    local cur prev word path="" i skip=0
    COMPREPLY=()
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    # `--flag=value`: bash splits at "=" (COMP_WORDBREAKS); complete the value after it.
    if [[ "$cur" == "=" ]]; then
        cur=""
    elif [[ "$prev" == "=" && $COMP_CWORD -ge 2 ]]; then
        prev="${{COMP_WORDS[COMP_CWORD-2]}}"
    fi
    # Walk the words before the cursor: a subcommand extends the path, a flag that takes a value
    # skips that value.
    for ((i = 1; i < COMP_CWORD; i++)); do
        word="${{COMP_WORDS[i]}}"
        [[ "$word" == "=" ]] && continue
        if ((skip)); then
            skip=0
            continue
        fi
        case "$word" in
            -*) {FUNCTION}_takes_value "$path" "$word" && skip=1 ;;
            *)
                if [[ " $({FUNCTION}_subcommands "$path") " == *" $word "* ]]; then
                    path="${{path:+$path }}$word"
                fi
                ;;
        esac
    done
    if ((skip)); then
        local values
        values="$({FUNCTION}_choices "$path" "$prev")"
        if [[ -n "$values" ]]; then
            COMPREPLY=($(compgen -W "$values" -- "$cur"))
            return 0
        fi
        case "$({FUNCTION}_kind "$path" "$prev")" in
            dir)
                compopt -o filenames 2>/dev/null
                COMPREPLY=($(compgen -d -- "$cur"))
                ;;
            file)
                compopt -o filenames 2>/dev/null
                COMPREPLY=($(compgen -f -- "$cur"))
                ;;
        esac
        return 0
    fi
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$({FUNCTION}_options "$path")" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "$({FUNCTION}_words "$path")" -- "$cur"))
    fi
    return 0
}}

complete -F {FUNCTION} {PROGRAM}
""".splitlines()
    return "\n".join(lines) + "\n"


def render_zsh(parser: argparse.ArgumentParser) -> str:
    return (
        f"# {PROGRAM} completion for zsh: the bash completion, run through bashcompinit.\n"
        f"# Source it (`source <({PROGRAM} completion zsh)`), e.g. from ~/.zshrc.\n"
        "(( $+functions[compdef] )) || { autoload -U +X compinit && compinit; }\n"
        "autoload -U +X bashcompinit && bashcompinit\n" + render_bash(parser)
    )


def _fish_switch(function: str, arms: list[tuple[str, str]]) -> list[str]:
    """A fish function `function KEY` that prints the words of the matching arm, one a line."""
    lines = [f"function {function}", "    switch $argv[1]"]
    for key, words in arms:
        if words:
            lines.append(f"        case {_q(key)}")
            lines.append(f"            printf '%s\\n' {' '.join(_q(w) for w in words.split())}")
    lines += ["    end", "end"]
    return lines


def render_fish(parser: argparse.ArgumentParser) -> str:
    """The same tables as the bash script, walked by fish's `commandline`."""
    commands = command_tree(parser)
    f = FUNCTION
    words = [(" ".join(c.path), " ".join(c.subcommands + c.choices)) for c in commands]
    subcommands = [(" ".join(c.path), " ".join(c.subcommands)) for c in commands]
    options = [(" ".join(c.path), " ".join(c.options)) for c in commands]
    choices: list[tuple[str, str]] = []
    kinds: list[tuple[str, str]] = []
    takes_value: list[str] = []
    for c in commands:
        for option, kind in c.values.items():
            key = f"{' '.join(c.path)}:{option}"
            takes_value.append(key)
            if isinstance(kind, list):
                choices.append((key, " ".join(kind)))
            elif kind:
                kinds.append((key, kind))
    lines = [
        f"# {PROGRAM} completion for fish: `{PROGRAM} completion fish | source`, or save it as",
        f"# ~/.config/fish/completions/{PROGRAM}.fish. Generated from the command tree;",
        "# regenerate after an upgrade.",
        "",
    ]
    lines += _fish_switch(f"{f}_words", words)
    lines += _fish_switch(f"{f}_subcommands", subcommands)
    lines += _fish_switch(f"{f}_options", options)
    lines += _fish_switch(f"{f}_choices", choices)
    lines += _fish_switch(f"{f}_kind", kinds)
    lines.append(f"set -g {f}_takes_value " + " ".join(_q(k) for k in takes_value))
    lines += f"""
function {f}_complete
    set -l tokens (commandline -opc)
    set -e tokens[1]
    set -l current (commandline -ct)
    set -l path ""
    set -l skip 0
    set -l prev ""
    # Walk the words before the cursor: a subcommand extends the path, a flag that takes a
    # value skips that value.
    for word in $tokens
        set prev $word
        if test $skip -eq 1
            set skip 0
            continue
        end
        if string match -q -- '-*' $word
            if contains -- "$path:$word" ${f}_takes_value
                set skip 1
            end
        else if contains -- $word ({f}_subcommands "$path")
            set path (string trim -- "$path $word")
        end
    end
    if test $skip -eq 1
        set -l values ({f}_choices "$path:$prev")
        if test (count $values) -gt 0
            printf '%s\n' $values
            return
        end
        switch ({f}_kind "$path:$prev")
            case dir
                __fish_complete_directories $current
            case file
                __fish_complete_path $current
        end
        return
    end
    if string match -q -- '-*' $current
        {f}_options "$path"
    else
        {f}_words "$path"
    end
end

complete -c {PROGRAM} -f -a '({f}_complete)'
""".splitlines()
    return "\n".join(lines) + "\n"


def render(shell: str, parser: argparse.ArgumentParser) -> str:
    if shell == "bash":
        return render_bash(parser)
    if shell == "zsh":
        return render_zsh(parser)
    if shell == "fish":
        return render_fish(parser)
    raise ValueError(f"no completion for {shell!r}; choose one of {', '.join(SHELLS)}")


def cmd_completion(args: argparse.Namespace) -> int:
    # The whole parser, as `api.cli.main` built it (handed over in the namespace, so this module
    # does not import the module that imports it).
    parser: argparse.ArgumentParser = args.parser
    sys.stdout.write(render(args.shell, parser))
    return 0


def register(sub: Any) -> None:
    """Add `completion bash|zsh` to the `modelforge-hw` parser."""
    p = sub.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script: `source <(modelforge-hw completion bash)`.",
    )
    p.add_argument("shell", choices=SHELLS, help="bash, zsh or fish")
    p.set_defaults(func=cmd_completion)
