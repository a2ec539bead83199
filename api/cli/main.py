"""`modelforge-hw`: the operator's command line, one Typer app of the commands in the modules beside
this one, and its entry point.

Exit 0 on success; non-zero with one line saying what went wrong and what to do next
(api/cli/errors.py). Human tables on a TTY, JSON with `--json` (or when stdout is not a TTY, where
it says so).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from agent.cli import agent_app
from api.cli import database, events, replay, serving, shells
from api.cli.decommission import decommission_app, lease_app
from api.cli.enrollment import credential_app, token_app
from api.cli.errors import PROGRAM, exit_code_for
from api.cli.gpus import gpu_app
from api.cli.health import health_app
from api.cli.nodes import node_app
from api.cli.scopes import viewer_app
from api.cli.webhooks import webhook_app
from runtime.logs import configure_logging_from_settings
from runtime.version import VERSION

app = typer.Typer(
    name=PROGRAM,
    help="ModelForge hardware plane",
    no_args_is_help=True,
    # Plain help, usage errors as the framework words them, tracebacks never shown to an operator.
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(given: bool) -> None:
    if given:
        print(f"{PROGRAM} {VERSION}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="show the version and exit"),
    ] = False,
) -> None:
    """ModelForge hardware plane"""


# On the server host, straight against the database.
app.command("serve")(serving.serve)
app.command("migrate")(database.migrate)
app.command("refresh")(database.refresh)
app.command("rebuild")(database.rebuild)
app.command("replay")(replay.replay)
app.command("verify")(database.verify)
app.add_typer(database.retention_app, name="retention")
app.add_typer(token_app, name="token")
app.add_typer(credential_app, name="credential")
app.add_typer(lease_app, name="lease")
app.add_typer(decommission_app, name="decommission")
app.add_typer(viewer_app, name="viewer-token")
# On a GPU host.
app.add_typer(agent_app, name="agent")
# From any workstation, over the HTTP API.
app.add_typer(node_app, name="node")
app.add_typer(gpu_app, name="gpu")
app.add_typer(health_app, name="health")
app.command("events")(events.events)
app.add_typer(webhook_app, name="webhook")
app.command("completion")(shells.completion)


def main(argv: list[str] | None = None) -> int:
    """Run one command line; returns its exit code."""
    words = sys.argv[1:] if argv is None else argv
    try:
        # Before the command line is parsed, so that its errors log alike.
        configure_logging_from_settings()
        command = typer.main.get_command(app)
        result = command.main(args=words, prog_name=PROGRAM, standalone_mode=False)
    except (Exception, KeyboardInterrupt) as exc:
        return exit_code_for(exc)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
