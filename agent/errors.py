"""The agent's exit codes, and the one error it reports to the operator."""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNSENT = 1  # --once: reports are left in the spool (server unreachable)
EXIT_USAGE = 2  # not enrolled, bad state directory, enrollment refused
EXIT_STOPPED = 78  # EX_CONFIG: the server refused this agent for good (401/410); do not restart


class AgentError(Exception):
    """One line for the operator, and the exit code that goes with it."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
