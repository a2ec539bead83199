"""structlog configuration, in one place: key-value events, JSON when not on a TTY.

One stream: the standard library's loggers (uvicorn, pgserver, httpx, asyncpg, Python warnings)
are rendered by the same processors and renderer as our own events, so a JSON log is JSON on
every line. Libraries that narrate at INFO (pgserver prints whole `pg_ctl` command lines, httpx
every request) are held at WARNING; their failures still come through.

Secrets never reach a log line: the `redact` processor masks any key that names one, so a
careless `log.info(..., token=t)` is still safe.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

from runtime.settings import from_env

# Standard-library loggers too chatty at INFO for an operator's log.
QUIET_LOGGERS = ("pgserver", "httpx", "httpcore", "asyncio")
_SECRET_KEYS = ("token", "secret", "password", "credential", "authorization")


def redact(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        if key != "event" and any(s in key.lower() for s in _SECRET_KEYS):
            event[key] = "[redacted]"
    return event


def _stdlib_fields(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A foreign record's logger name, under a key of ours; uvicorn's `color_message` dropped."""
    record = event.get("_record")
    if record is not None:
        event["logger"] = record.name
    event.pop("color_message", None)
    return event


def configure_logging(*, level: str = "INFO", json: bool | None = None, stream: TextIO | None = None) -> None:
    out = stream or sys.stderr
    as_json = (not out.isatty()) if json is None else json
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact,
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, _stdlib_fields],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    # uvicorn's own loggers propagate to the root handler above instead of printing plain text.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    logging.captureWarnings(True)


def configure_logging_from_settings(level: str | None = None) -> None:
    """At `level` (a --log-level flag), else MODELFORGE_LOG_LEVEL; JSON or console lines as
    MODELFORGE_LOG_JSON says (a bad value raises SettingError, before any command runs)."""
    as_json = from_env("log_json")
    configure_logging(
        level=level or str(from_env("log_level")), json=None if as_json is None else bool(as_json)
    )
