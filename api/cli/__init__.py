"""The operator command line `modelforge-hw` (`python -m api.cli`), on Typer: options, output and
exit codes only; the work is done by the services that `api.wiring` builds."""

from api.cli.main import main

__all__ = ["main"]
