"""`modelforge-hw events`: the audit log over the HTTP API, oldest first; `--follow` keeps
printing events as they commit (the change feed's long poll)."""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from api.cli.gpus import NodeOpt, OutputOpt
from api.cli.moments import parse_moment
from api.cli.remote import FOLLOW_WAIT_SECONDS, Api, Server, Token, TokenFile, connect, resolve_node
from api.cli.rendering import Output, emit, nothing, plain, table, when, yaml_text
from api.services.wording import event_lines, stream_view

if TYPE_CHECKING:
    from api.services.reads.bodies import EventBody

DURATION = "ISO 8601 time or duration (1h, 2d)"


class EventClass(enum.StrEnum):
    lifecycle = "lifecycle"
    observation = "observation"


def event_row(e: EventBody, wide: bool) -> list[str]:
    row = [
        str(e.global_position),
        when(e.recorded_at),
        stream_view(e.stream_id).text if not wide else e.stream_id,
        e.event_type,
        e.event_class,
        # what the event says, as the console's event list says it
        "; ".join(event_lines(e.event_type, e.data)) if e.undecodable is None else "undecodable",
    ]
    if wide:
        data = plain(e.data) if e.undecodable is None else {"undecodable": plain(e.undecodable)}
        row += [str(e.stream_version), msgspec.json.encode(data).decode()]
    return row


def read_events(
    api: Api, params: list[tuple[str, str]], limit: int, follow: bool
) -> Iterator[list[EventBody]]:
    """Pages of the log; following, once caught up each request is held until events commit."""
    from api.services.reads.bodies import EventPage

    cursor: str | None = None
    delivered = 0
    caught_up = False
    while True:
        page_params = [*params, ("limit", str(min(1000, max(1, limit - delivered))))]
        page_params += [("cursor", cursor)] if cursor else []
        page_params += [("wait", str(FOLLOW_WAIT_SECONDS))] if caught_up else []
        page = msgspec.json.decode(api.get("/hardware/events", page_params), type=EventPage)
        cursor = page.next_cursor
        delivered += len(page.items)
        yield page.items
        if not follow and (delivered >= limit or not page.has_more):
            return
        if not page.has_more:
            caught_up = True


def events(
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    node: NodeOpt = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Only events of this GPU UUID.")] = None,
    event_type: Annotated[
        list[str] | None,
        typer.Option("--type", metavar="TYPE", help="Event type (repeatable).", show_default=False),
    ] = None,
    event_class: Annotated[
        EventClass | None, typer.Option("--class", help="lifecycle or observation.")
    ] = None,
    since: Annotated[str | None, typer.Option("--since", help=f"Recorded at or after: {DURATION}.")] = None,
    until: Annotated[str | None, typer.Option("--until", help=f"Recorded before: {DURATION}.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many events.")] = 1000,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="After the log so far, print events as they commit.")
    ] = False,
    output: OutputOpt = Output.table,
) -> None:
    """The audit log, oldest first; `--follow` keeps printing new events (the change feed)."""
    api = connect(server, token, token_file)
    now = datetime.now(UTC)
    params: list[tuple[str, str]] = []
    if node:
        params.append(("node_id", resolve_node(api.nodes(), node).id))
    if gpu:
        params.append(("accelerator_uuid", gpu))
    params += [("type", t) for t in event_type or []]
    if event_class:
        params.append(("class", event_class.value))
    if since:
        params.append(("since", parse_moment(since, now).isoformat()))
    if until:
        params.append(("until", parse_moment(until, now).isoformat()))
    wide = output is Output.wide
    header = ["POSITION", "RECORDED", "NODE", "TYPE", "CLASS", "SUMMARY"] + (
        ["VERSION", "DATA"] if wide else []
    )
    collected: list[EventBody] = []
    for page in read_events(api, params, limit, follow):
        if follow:
            # A live stream cannot wait for a table: one line (or one JSON document) per event.
            for e in page:
                if output is Output.json:
                    sys.stdout.write(msgspec.json.encode(e).decode() + "\n")
                elif output is Output.yaml:
                    sys.stdout.write("---\n" + yaml_text(e))
                else:
                    sys.stdout.write("  ".join(event_row(e, wide)) + "\n")
            sys.stdout.flush()
        else:
            collected += page
    if follow:
        return
    if emit(collected, output):
        return
    if not collected:
        nothing("events match")
    else:
        table(header, [event_row(e, wide) for e in collected], ids=(0, 2, 3))
