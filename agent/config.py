"""The agent's settings: `AgentConfig`, with its defaults from the one configuration model
(runtime/settings.py) that the server shares."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from runtime import settings

DEFAULT_INTERVAL: float = settings.default("agent_interval")
DEFAULT_INVENTORY_EVERY: int = settings.default("agent_inventory_every")
DEFAULT_SPOOL_MAX: int = settings.default("agent_spool_max")
DEFAULT_BACKOFF_INITIAL: float = settings.default("agent_backoff_initial")
DEFAULT_BACKOFF_MAX: float = settings.default("agent_backoff_max")
DEFAULT_REQUEST_TIMEOUT: float = settings.default("agent_request_timeout")
DEFAULT_COLLECTOR_TIMEOUT: float = settings.default("collector_timeout")
# A report answered 500 this many times in a row is quarantined: enough to ride out a server
# restart or a short database hiccup, few enough that one poisoned report blocks for seconds.
DEFAULT_QUARANTINE_AFTER: int = settings.default("agent_quarantine_after")


class AgentConfig(msgspec.Struct, kw_only=True):
    servers: list[str] = []  # empty: the server the agent enrolled with
    state_dir: Path
    node_id: str | None = None  # MODELFORGE_NODE_ID
    interval: float = DEFAULT_INTERVAL
    inventory_every: int = DEFAULT_INVENTORY_EVERY  # an inventory report at least every N reports
    spool_max: int = DEFAULT_SPOOL_MAX
    backoff_initial: float = DEFAULT_BACKOFF_INITIAL
    backoff_max: float = DEFAULT_BACKOFF_MAX
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    collector_timeout: float = DEFAULT_COLLECTOR_TIMEOUT
    quarantine_after: int = DEFAULT_QUARANTINE_AFTER
    ca_file: str | None = None
    once: bool = False


def parse_servers(values: Sequence[str] | None) -> list[str]:
    """`--server` values, each possibly a comma-separated list, as one list of URLs."""
    out: list[str] = []
    for v in values or ():
        out += [s.strip() for s in v.split(",") if s.strip()]
    return out
