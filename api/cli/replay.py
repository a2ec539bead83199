"""`modelforge-hw replay`: the audit log from the database, filtered, followed as it grows, or the
inventory as it stood at a moment (`--as-of`)."""

from __future__ import annotations

import enum
import sys
from typing import Annotated, Any

import typer

from api.cli.common import (
    DatabaseUrl,
    LogLevel,
    NodeOption,
    StateDir,
    resolve_node,
    server_config,
    with_database,
)
from api.cli.moments import moment
from api.cli.rendering import erase_progress, print_json, short, table

MOMENT = "ISO 8601 time or a duration ago (30m, 1h, 2d)"


class EventClass(enum.StrEnum):
    lifecycle = "lifecycle"
    observation = "observation"


class Format(enum.StrEnum):
    table = "table"
    jsonl = "jsonl"


def _page_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1000:
        raise typer.BadParameter(f"must be a whole number from 1 to 1000, not {text!r}")
    return value


def replay(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    node: NodeOption = None,
    accelerator: Annotated[str | None, typer.Option("--gpu", "--accelerator", help="GPU UUID")] = None,
    event_type: Annotated[
        list[str] | None, typer.Option("--type", metavar="TYPE", help="event type (repeatable)")
    ] = None,
    event_class: Annotated[EventClass | None, typer.Option("--class")] = None,
    since: Annotated[str | None, typer.Option("--since", help=f"recorded at or after: {MOMENT}")] = None,
    until: Annotated[str | None, typer.Option("--until", help=f"recorded before: {MOMENT}")] = None,
    limit: Annotated[int, typer.Option("--limit", help="at most this many events")] = 1_000_000,
    page_size: Annotated[
        int, typer.Option("--page-size", parser=_page_size, help="events read per round trip (1-1000)")
    ] = 1000,
    output_format: Annotated[
        Format | None, typer.Option("--format", help="default: table on a TTY, else jsonl")
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", help="after the log so far, keep printing events as they commit (the change feed)"
        ),
    ] = False,
    as_of: Annotated[
        str | None,
        typer.Option("--as-of", help="reconstruct the inventory as it stood at this time (ISO 8601)"),
    ] = None,
) -> int:
    """the audit log, or the inventory as of a moment"""
    config = server_config(database_url=database_url, state_dir=state_dir, log_level=log_level)
    fmt = output_format or (Format.table if sys.stdout.isatty() else Format.jsonl)
    at = moment(as_of)

    async def work(pool: Any) -> int:
        from api.services.audit import AuditRepository
        from api.services.reads.events import EventReads

        node_id = await resolve_node(pool, node)
        events = EventReads(pool)
        if at is not None:
            audit = AuditRepository(pool)
            # One fold of the log serves both tables.
            nodes, accs, position = await audit.inventory_as_of(at, node_id=node_id)
            if fmt is Format.jsonl:
                for n in nodes:
                    print_json({"kind": "node", "as_of": at, "position": position, "node": n})
                for acc in accs:
                    print_json({"kind": "accelerator", "as_of": at, "position": position, "accelerator": acc})
            else:
                print(f"inventory as of {at.isoformat()} (folded to global position {position})")
                table(
                    ["NODE", "HOSTNAME", "STATUS", "INVENTORY", "DRIVER", "FINGERPRINT"],
                    [
                        [
                            n.id,
                            n.hostname or "",
                            n.status,
                            n.inventory_status,
                            n.driver_version or "",
                            (n.fingerprint or "")[:16],
                        ]
                        for n in nodes
                    ],
                )
                print()
                table(
                    ["NODE", "INDEX", "UUID", "NAME", "PCI", "STATUS"],
                    [
                        [a.node_id[:8], str(a.index), a.uuid, a.name or "", a.pci_bus_id or "", a.status]
                        for a in accs
                    ],
                    ids=(0, 2),
                )
            return 0
        cursor: str | None = None
        rows: list[list[str]] = []
        printed = 0
        caught_up = False
        while True:
            page = await events.page(
                node_id=node_id,
                types=event_type or None,
                event_class=event_class.value if event_class else None,
                accelerator_uuid=accelerator,
                since=moment(since),
                until=moment(until),
                cursor=cursor,
                limit=min(page_size, limit - printed),
                # Following: once caught up, hold each read until an event commits.
                wait_seconds=30 if caught_up else 0,
            )
            cursor = page.next_cursor
            for e in page.items:
                row = [
                    str(e.global_position),
                    str(e.stream_version),
                    e.event_type,
                    e.metadata.observed_at.isoformat() if e.metadata and e.metadata.observed_at else "",
                    e.metadata.received_at.isoformat() if e.metadata else "",
                    e.recorded_at.isoformat() if e.recorded_at else "",
                    e.metadata.source if e.metadata else "",
                    short(e.data)
                    if e.undecodable is None
                    else "UNDECODABLE " + short(e.undecodable.stored_data),
                ]
                if fmt is Format.jsonl:
                    print_json(e)
                elif follow:
                    print("  ".join(row), flush=True)  # a live stream cannot wait for the table
                else:
                    rows.append(row)
            if fmt is Format.jsonl and follow:
                sys.stdout.flush()
            printed += len(page.items)
            if fmt is Format.table and not follow and sys.stderr.isatty():
                sys.stderr.write(f"\r  {printed:,} events read   ")
                sys.stderr.flush()
            if printed >= limit:
                break
            if not page.has_more:
                if not follow:
                    break
                caught_up = True
        if fmt is Format.table and not follow:
            erase_progress()
            table(
                ["POSITION", "VERSION", "TYPE", "OBSERVED", "RECEIVED", "RECORDED", "SOURCE", "DATA"],
                rows,
                ids=(0, 1, 2),
            )
        return 0

    return with_database(config, work)
