"""`modelforge-hw gpu history` and `gpu lemons`: one GPU's record by UUID across every node it was
in, and the GPUs that keep failing, ranked by failures per day of service (docs/lemons.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from api.cli.errors import RemoteError
from api.cli.moments import parse_moment
from api.cli.remote import Api, Server, Token, TokenFile, connect, resolve_gpu
from api.cli.rendering import Output, emit, nothing, table, when

if TYPE_CHECKING:
    from api.services.reads.bodies import EventBody
    from api.services.reads.gpu_history import GpuHistoryBody, GpuTenureBody

OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table, json or yaml.")]
# The route's largest page: a long history in few requests.
HISTORY_PAGE = 1000


def what(e: EventBody) -> str:
    """One line of what a GPU's event says."""
    from msgspec import to_builtins

    data = to_builtins(e.data) if e.data is not None else {}
    if not isinstance(data, dict):
        return ""
    match e.event_type:
        case "ACCELERATOR_DISCOVERED":
            return "rediscovered" if data.get("rediscovered") else "discovered"
        case "ACCELERATOR_MISSING":
            return f"missing: {data.get('reason', '')}"
        case "ACCELERATOR_XID_OBSERVED":
            return f"XID {data.get('code')} at {data.get('at')}"
        case "ACCELERATOR_HEALTH_CHANGED":
            codes = ",".join(str(r.get("code")) for r in data.get("reasons", []) if isinstance(r, dict))
            verdict = f"{data.get('before')} -> {data.get('after')} ({data.get('action')})"
            return f"{verdict} {codes}" if codes else verdict
        case "HARDWARE_CHANGED":
            return "changed: " + ", ".join(sorted(data.get("changes", {})))
    return ""


def _node_name(n: GpuTenureBody) -> str:
    return n.hostname or n.node_id[:8]


def history_table(body: GpuHistoryBody, events: list[EventBody]) -> None:
    places = len(body.nodes)
    print(f"GPU {body.uuid} ({body.model or 'unknown model'}): {places} node{'' if places == 1 else 's'}")
    table(
        ["NODE", "HOSTNAME", "ACCELERATOR", "STATE", "HEALTH", "FIRST SEEN", "LAST SEEN", "DAYS"],
        [
            [
                n.node_id,
                n.hostname or "",
                n.accelerator_id,
                n.status,
                n.health,
                when(n.first_seen_at),
                when(n.last_seen_at),
                f"{n.days:.1f}",
            ]
            for n in body.nodes
        ],
        ids=(0, 2),
    )
    print()
    if not events:
        nothing("lifecycle events")
        return
    hostnames = {n.node_id: _node_name(n) for n in body.nodes}
    table(
        ["POSITION", "RECORDED", "NODE", "TYPE", "WHAT"],
        [
            [
                str(e.global_position),
                when(e.recorded_at),
                hostnames.get(e.node_id, e.node_id[:8]),
                e.event_type,
                what(e),
            ]
            for e in events
        ],
        ids=(0, 3),
        wrap=(4,),
    )


def read_history(api: Api, gpu_uuid: str) -> tuple[GpuHistoryBody, list[EventBody]]:
    """Every page of the GPU's history: the last page's body (its nodes) and all the events."""
    from urllib.parse import quote

    import msgspec

    from api.services.reads.gpu_history import GpuHistoryBody

    events: list[EventBody] = []
    cursor: str | None = None
    while True:
        params = [("limit", str(HISTORY_PAGE))] + ([("cursor", cursor)] if cursor else [])
        raw = api.get(f"/hardware/gpus/{quote(gpu_uuid, safe='')}/history", params)
        body = msgspec.json.decode(raw, type=GpuHistoryBody)
        events += body.items
        if not body.has_more:
            return body, events
        cursor = body.next_cursor


def gpu_history(
    gpu: Annotated[str, typer.Argument(help="GPU UUID, UUID prefix or id prefix.", show_default=False)],
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """One GPU's lifecycle and health events across every node it was in, with its time on each."""
    import msgspec

    api = connect(server, token, token_file)
    try:
        # A whole UUID as the ledger has it needs no listing of the fleet.
        body, events = read_history(api, gpu)
    except RemoteError as exc:
        if exc.status != 404:
            raise
        body, events = read_history(api, resolve_gpu(api.accelerators(), gpu, one_row=False).uuid)
    whole = msgspec.structs.replace(body, items=events, has_more=False)
    if emit(whole, output):
        return
    history_table(body, events)


def gpu_lemons(
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    since: Annotated[
        str,
        typer.Option(
            "--since", help="Window start: a duration back from now (90d, 12h) or an ISO 8601 time."
        ),
    ] = "90d",
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="At most this many GPUs.")] = 20,
    output: OutputOpt = Output.table,
) -> None:
    """GPUs ranked by failures per day of service, with the events that are their failures."""
    import msgspec

    from api.services.reads.lemons import LemonsBody

    api = connect(server, token, token_file)
    start = parse_moment(since, datetime.now(UTC)).isoformat()
    body = msgspec.json.decode(
        api.get("/hardware/health/lemons", [("since", start), ("limit", str(limit))]), type=LemonsBody
    )
    if emit(body, output):
        return
    print(
        f"{body.total} GPU{'' if body.total == 1 else 's'} failed since {when(body.since)} "
        f"(a failure: {body.failure})"
    )
    if not body.items:
        return
    rows = []
    for g in body.items:
        names = {n.node_id: n.hostname or n.node_id[:8] for n in g.nodes}
        evidence = "; ".join(
            f"#{f.global_position} {when(f.at)} on {names.get(f.node_id, f.node_id[:8])} "
            f"{','.join(f.reasons)}"
            for f in g.evidence
        )
        rows.append(
            [
                str(g.rank),
                g.uuid,
                g.model or "",
                str(g.failures),
                f"{g.service_days:.1f}",
                f"{g.failures_per_day:.3f}",
                ",".join(names.values()),
                evidence,
            ]
        )
    table(
        ["RANK", "UUID", "MODEL", "FAILURES", "DAYS", "PER DAY", "NODES", "EVIDENCE"],
        rows,
        ids=(1,),
        wrap=(7,),
    )
