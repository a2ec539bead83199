"""How a failure reaches the operator: one line on stderr, `modelforge-hw: ...`, and the exit code
of its kind.

Exit codes: 0 done; 1 failed (the server or the database unreachable, anything unforeseen);
2 refused or bad input, usage errors included; 3 refused because the state moved on or something
blocks it; 4 gone for good (a decommissioned node); 5 unknown; 130 interrupted.
"""

from __future__ import annotations

import sys

import typer

from api.services.errors import Conflict, DomainError, Gone, NotFound
from runtime.settings import SettingError

PROGRAM = "modelforge-hw"


class CliError(Exception):
    """One line for the operator: what went wrong and what to do next."""


class RemoteError(Exception):
    """A problem+json answer of the HTTP API, kept with its HTTP status for the exit code (status
    0: the server did not answer)."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status = status


# The one table from the services' error kinds to exit codes.
EXIT_CODES: dict[type[DomainError], int] = {Conflict: 3, Gone: 4, NotFound: 5}
# The same kinds, as the HTTP API answers them.
EXIT_OF_STATUS = {404: 5, 409: 3, 410: 4}


def exit_code_of(exc: DomainError) -> int:
    for kind in type(exc).__mro__:
        if kind in EXIT_CODES:
            return EXIT_CODES[kind]
    return 2


def say(line: str) -> None:
    print(f"{PROGRAM}: {line}", file=sys.stderr)


def exit_code_for(exc: BaseException) -> int:
    """Tell the operator about `exc` and return its exit code."""
    if isinstance(exc, KeyboardInterrupt | typer.Abort):
        return 130
    if isinstance(exc, typer.TyperException):
        # A usage error: the framework shows it (usage line, hint, the flag it is about).
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        else:
            say(exc.format_message())
        return exc.exit_code
    if isinstance(exc, CliError | SettingError):
        say(str(exc))
        return 2
    if isinstance(exc, DomainError):
        say(exc.detail)
        return exit_code_of(exc)
    if isinstance(exc, RemoteError):
        say(str(exc))
        return 1 if exc.status == 0 else EXIT_OF_STATUS.get(exc.status, 2)
    hint = ""
    if isinstance(exc, OSError | ConnectionError):
        hint = " (is the database reachable? check MODELFORGE_DATABASE_URL)"
    say(f"{type(exc).__name__}: {exc}{hint}")
    return 1
