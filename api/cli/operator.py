"""`modelforge-hw node|gpu|events`: the operator's read commands, over the HTTP API.

They need only the server's URL (`MODELFORGE_SERVER`) and a token (`MODELFORGE_TOKEN`, or a file
named by `--token-file` / `MODELFORGE_TOKEN_FILE`): no database credentials on a workstation.
Built on Typer (flag and environment binding, typed options); `api.cli.main` dispatches these
command names here and keeps the database commands on argparse.

Exit codes follow `api.cli.common.EXIT_CODES` by the problem's HTTP status: 404 -> 5, 409 -> 3,
410 -> 4, any other refusal 2; the server unreachable 1.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import typer
import yaml

from api.cli.common import CliError, parse_moment, table
from api.services.views import (
    AcceleratorBody,
    AcceleratorPage,
    EventBody,
    EventPage,
    HealthSignalsBody,
    NodeBody,
    NodePage,
)
from collectors.facts import Fact, Known
from runtime.settings import setting

COMMANDS = ("node", "gpu", "events")
# The change feed's hold per request: well under the server's limit, long enough to be cheap.
FOLLOW_WAIT_SECONDS = 30


class Output(enum.StrEnum):
    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


class EventClass(enum.StrEnum):
    lifecycle = "lifecycle"
    observation = "observation"


class GpuState(enum.StrEnum):
    active = "active"
    missing = "missing"
    decommissioned = "decommissioned"


class Health(enum.StrEnum):
    healthy = "healthy"
    degraded = "degraded"
    failed = "failed"


class RemoteError(Exception):
    """A problem+json answer, kept with its HTTP status for the exit code."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status = status


EXIT_OF_STATUS = {404: 5, 409: 3, 410: 4}

# --- the connection ----------------------------------------------------------------------------


class Api:
    def __init__(self, server: str, token: str) -> None:
        self.base = server.rstrip("/")
        self.client = httpx.Client(
            base_url=self.base + "/api/v1",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=httpx.Timeout(10.0, read=FOLLOW_WAIT_SECONDS + 15.0),
        )

    def get(self, path: str, params: list[tuple[str, str]] | None = None) -> bytes:
        try:
            r = self.client.get(path, params=tuple(params or ()))
        except httpx.HTTPError as exc:
            raise RemoteError(
                0, f"cannot reach {self.base}: {exc} (check MODELFORGE_SERVER and that the server runs)"
            ) from exc
        if r.status_code >= 400:
            try:
                problem = msgspec.json.decode(r.content, type=dict[str, Any])
                text = str(problem.get("detail") or problem.get("title") or r.reason_phrase)
            except msgspec.DecodeError:
                text = r.reason_phrase
            hint = " (check MODELFORGE_TOKEN or --token-file)" if r.status_code in (401, 403) else ""
            raise RemoteError(r.status_code, f"HTTP {r.status_code}: {text}{hint}")
        return r.content

    def nodes(self) -> list[NodeBody]:
        items: list[NodeBody] = []
        cursor: str | None = None
        while True:
            params = [("limit", "500")] + ([("cursor", cursor)] if cursor else [])
            page = msgspec.json.decode(self.get("/hardware/nodes", params), type=NodePage)
            items += page.items
            if not page.next_cursor:
                return items
            cursor = page.next_cursor

    def accelerators(
        self, node_id: str | None = None, state: str | None = None, health: str | None = None
    ) -> list[AcceleratorBody]:
        items: list[AcceleratorBody] = []
        cursor: str | None = None
        while True:
            params = [("limit", "500")]
            params += [("node_id", node_id)] if node_id else []
            params += [("status", state)] if state else []
            params += [("health", health)] if health else []
            params += [("cursor", cursor)] if cursor else []
            page = msgspec.json.decode(self.get("/hardware/accelerators", params), type=AcceleratorPage)
            items += page.items
            if not page.next_cursor:
                return items
            cursor = page.next_cursor


def resolve_node(nodes: list[NodeBody], ref: str) -> NodeBody:
    """One node by its full id, an id prefix, or its hostname; ambiguous refs name the candidates."""
    exact = [n for n in nodes if n.id == ref]
    if exact:
        return exact[0]
    candidates = [n for n in nodes if n.id.startswith(ref.lower()) or n.hostname == ref]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise RemoteError(404, f"no node with an id starting with {ref!r} or hostname {ref!r}")
    listed = ", ".join(f"{n.id[:12]} ({n.hostname or 'no hostname'})" for n in candidates[:10])
    raise CliError(f"{ref!r} matches {len(candidates)} nodes: {listed}; give more of the id")


def resolve_gpu(gpus: list[AcceleratorBody], ref: str) -> AcceleratorBody:
    """One GPU by its UUID, a UUID prefix (with or without `GPU-`), or an id prefix."""
    low = ref.lower()
    exact = [g for g in gpus if g.id == ref or g.uuid.lower() == low]
    if exact:
        return exact[0]
    candidates = [
        g
        for g in gpus
        if g.id.startswith(low)
        or g.uuid.lower().startswith(low)
        or g.uuid.lower().removeprefix("gpu-").startswith(low)
    ]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise RemoteError(404, f"no GPU with a UUID or id starting with {ref!r}")
    listed = ", ".join(f"{g.uuid} (index {g.index})" for g in candidates[:10])
    raise CliError(f"{ref!r} matches {len(candidates)} GPUs: {listed}; give more of the UUID")


# --- output ------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    return msgspec.to_builtins(value)


def emit(value: Any, output: Output) -> None:
    if output is Output.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(value).decode(), indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(_plain(value), sort_keys=False, allow_unicode=True))


def _when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if moment else ""


def _gib(size: int | None) -> str:
    return f"{size / 2**30:.1f} GiB" if size else ""


def _nothing(what: str) -> None:
    sys.stdout.write(f"no {what}\n")


def _node_health(n: NodeBody) -> str:
    """The worst GPU verdict, with how many GPUs are not healthy ("failed (1 failed, 2 degraded)")."""
    h = n.health
    counts = [f"{v} {k}" for k, v in (("failed", h.failed), ("degraded", h.degraded)) if v]
    return h.status + (f" ({', '.join(counts)})" if counts else "")


def _fact_text(fact: Fact) -> str:
    """A known value as it is; any other state named in brackets, so it never reads as a value."""
    if isinstance(fact, Known):
        return ("yes" if fact.value else "no") if isinstance(fact.value, bool) else str(fact.value)
    reason = getattr(fact, "reason", None)
    return f"({fact.__struct_config__.tag}{f': {reason}' if reason else ''})"


# --- commands ----------------------------------------------------------------------------------


def _bound(name: str) -> Any:
    """A Typer option bound to the model's flag and variable (runtime/settings.py)."""
    s = setting(name)
    return typer.Option(s.flag, envvar=s.env, help=s.help.removeprefix("Operator CLI: "), show_default=False)


ServerOpt = Annotated[str, _bound("server")]
TokenOpt = Annotated[str | None, _bound("token")]
TokenFileOpt = Annotated[Path | None, _bound("token_file")]
OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table, wide, json or yaml.")]
NodeOpt = Annotated[
    str | None, typer.Option("--node", help="Node: id, id prefix or hostname.", show_default=False)
]

app = typer.Typer(
    name="modelforge-hw",
    add_completion=False,
    no_args_is_help=True,
    help="Read the fleet over the HTTP API.",
    pretty_exceptions_enable=False,
)
node_app = typer.Typer(no_args_is_help=True, help="Compute nodes: list, show.")
gpu_app = typer.Typer(no_args_is_help=True, help="GPUs: list, show.")
app.add_typer(node_app, name="node")
app.add_typer(gpu_app, name="gpu")


def connect(server: str, token: str | None, token_file: Path | None) -> Api:
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CliError(f"cannot read the token file {token_file}: {exc.strerror}") from exc
    if not token:
        raise CliError(
            "a token is required: MODELFORGE_TOKEN, --token, --token-file or MODELFORGE_TOKEN_FILE"
        )
    return Api(server, token)


@node_app.command("list")
def node_list(
    server: ServerOpt,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """Every compute node, with its liveness, inventory status and GPU count."""
    api = connect(server, token, token_file)
    nodes = api.nodes()
    if output in (Output.json, Output.yaml):
        emit(nodes, output)
        return
    if not nodes:
        _nothing("nodes registered yet (enroll an agent or run `modelforge-hw refresh`)")
        return
    counts: dict[str, int] = {}
    for g in api.accelerators():
        if g.status != "decommissioned":
            counts[g.node_id] = counts.get(g.node_id, 0) + 1
    header = ["ID", "HOSTNAME", "LIVENESS", "STATUS", "INVENTORY", "GPUS", "HEALTH", "DRIVER"]
    rows = [
        [
            n.id if output is Output.wide else n.id[:8],
            n.hostname or "",
            n.liveness,
            n.status,
            n.inventory_status,
            str(counts.get(n.id, 0)),
            _node_health(n),
            n.driver_version or "",
        ]
        for n in nodes
    ]
    if output is Output.wide:
        header += ["IDENTITY", "CPU", "MEMORY", "LAST SEEN"]
        for r, n in zip(rows, nodes, strict=True):
            r += [n.identity_key or "", n.cpu.model or "", _gib(n.memory_total_bytes), _when(n.last_seen_at)]
    table(header, rows)


@node_app.command("show")
def node_show(
    node: Annotated[str, typer.Argument(help="Node id, id prefix or hostname.", show_default=False)],
    server: ServerOpt,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """One node (by id, id prefix or hostname) and its GPUs."""
    api = connect(server, token, token_file)
    found = resolve_node(api.nodes(), node)
    if output in (Output.json, Output.yaml):
        emit(found, output)
        return
    gpus = api.accelerators(node_id=found.id)
    facts = [
        ["id", found.id],
        ["hostname", found.hostname or ""],
        ["identity", f"{found.identity_key or ''} ({found.identity_source or 'unknown source'})"],
        ["status", found.status],
        ["liveness", found.liveness],
        ["inventory", found.inventory_status + "".join(f"; {r}" for r in found.inventory_reasons)],
        ["os", " ".join(x for x in (found.os.name, found.os.version, found.os.kernel) if x)],
        ["cpu", f"{found.cpu.model or ''} ({found.cpu.logical_cores or '?'} logical cores)"],
        ["memory", _gib(found.memory_total_bytes)],
        ["driver", f"{found.driver_version or ''} (CUDA {found.cuda_driver_version or '?'})"],
        [
            "gpu health",
            f"{found.health.status}: {found.health.healthy} healthy, {found.health.degraded} degraded, "
            f"{found.health.failed} failed",
        ],
        ["first seen", _when(found.first_seen_at)],
        ["last seen", _when(found.last_seen_at)],
    ]
    table(["FIELD", "VALUE"], facts, wrap=(1,))
    sys.stdout.write("\n")
    if gpus:
        _gpu_table(gpus, {found.id: found}, output)
    else:
        _nothing("GPUs on this node")


def _gpu_table(gpus: list[AcceleratorBody], nodes: dict[str, NodeBody], output: Output) -> None:
    header = ["UUID", "NODE", "INDEX", "NAME", "MEMORY", "STATE", "HEALTH"]
    rows = [
        [
            g.uuid,
            (nodes[g.node_id].hostname or g.node_id[:8]) if g.node_id in nodes else g.node_id[:8],
            "" if g.index is None else str(g.index),
            g.name or "",
            _gib(g.memory_total_bytes),
            g.status,
            g.health.status,
        ]
        for g in gpus
    ]
    if output is Output.wide:
        header += ["ACTION", "REASONS", "PCI", "CC", "DRIVER", "LAST SEEN"]
        for r, g in zip(rows, gpus, strict=True):
            r += [
                g.health.action,
                ",".join(x.code for x in g.health.reasons),
                g.pci_bus_id or "",
                g.compute_capability or "",
                g.driver_version or "",
                _when(g.last_seen_at),
            ]
    table(header, rows)


@gpu_app.command("list")
def gpu_list(
    server: ServerOpt,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    node: NodeOpt = None,
    state: Annotated[GpuState | None, typer.Option("--state", help="Only GPUs in this state.")] = None,
    health: Annotated[
        Health | None, typer.Option("--health", help="Only GPUs with this health verdict.")
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """Every GPU, or those of one node, in one state or with one health verdict."""
    api = connect(server, token, token_file)
    nodes = api.nodes()
    node_id = resolve_node(nodes, node).id if node else None
    gpus = api.accelerators(
        node_id=node_id, state=state.value if state else None, health=health.value if health else None
    )
    if output in (Output.json, Output.yaml):
        emit(gpus, output)
        return
    if not gpus:
        _nothing(
            "GPUs"
            + (f" on node {node}" if node else "")
            + (f" in state {state.value}" if state else "")
            + (f" with health {health.value}" if health else "")
        )
        return
    _gpu_table(gpus, {n.id: n for n in nodes}, output)


@gpu_app.command("show")
def gpu_show(
    gpu: Annotated[str, typer.Argument(help="GPU UUID, UUID prefix or id prefix.", show_default=False)],
    server: ServerOpt,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    output: OutputOpt = Output.table,
) -> None:
    """One GPU by UUID (or a prefix of its UUID or id)."""
    api = connect(server, token, token_file)
    found = resolve_gpu(api.accelerators(), gpu)
    if output in (Output.json, Output.yaml):
        emit(found, output)
        return
    # Only known values: unsupported or failed readings are not numbers to show.
    telemetry = {k: v.value for k, v in found.telemetry.items() if isinstance(v, Known)}
    h = found.health
    health = [
        ["health", h.status],
        ["action", h.action],
        *[["reason", f"{r.code} ({r.status}, {r.action}): {r.detail}"] for r in h.reasons],
        *[["xid", f"{x.code} at {_when(x.at)}"] for x in reversed(h.recent_xids)],
    ]
    # Every signal, its state named when it is not a value (an unsupported ECC count is not 0).
    signals = [] if h.signals is None else _signal_rows(h.signals)
    rows = [
        ["uuid", found.uuid],
        ["id", found.id],
        ["node", found.node_id],
        ["index", "" if found.index is None else str(found.index)],
        ["name", found.name or ""],
        ["state", found.status + (f" since {_when(found.missing_since)}" if found.missing_since else "")],
        ["pci", found.pci_bus_id or ""],
        ["memory", _gib(found.memory_total_bytes)],
        ["compute capability", found.compute_capability or ""],
        ["driver", f"{found.driver_version or ''} (CUDA {found.cuda_driver_version or '?'})"],
        ["first seen", _when(found.first_seen_at)],
        ["last seen", _when(found.last_seen_at)],
        *health,
        *[[f"signal {k}", _fact_text(v)] for k, v in signals],
    ] + [[f"telemetry {k}", str(v)] for k, v in sorted(telemetry.items())]
    table(["FIELD", "VALUE"], rows, wrap=(1,))


def _signal_rows(signals: HealthSignalsBody) -> list[tuple[str, Fact]]:
    out: list[tuple[str, Fact]] = [("ecc_mode", signals.ecc_mode)]
    for group in ("ecc_errors", "remapped_rows", "retired_pages"):
        out += [(f"{group}.{k}", v) for k, v in sorted(getattr(signals, group).items())]
    out.append(("pcie_replay_count", signals.pcie_replay_count))
    # Only the reasons in effect: the others are the normal case and would be most of the list.
    active = [k for k, v in signals.clock_event_reasons.items() if isinstance(v, Known) and v.value is True]
    unknown = [v for v in signals.clock_event_reasons.values() if not isinstance(v, Known)]
    reasons: Fact = unknown[0] if unknown else Known(", ".join(active) or "none")
    out += [("clock_event_reasons", reasons), ("xid_events", signals.xid_events)]
    return out


def _event_row(e: EventBody, wide: bool) -> list[str]:
    row = [
        str(e.global_position),
        _when(e.recorded_at),
        e.node_id[:8] if not wide else e.node_id,
        e.event_type,
        e.event_class,
    ]
    if wide:
        data = _plain(e.data) if e.undecodable is None else {"undecodable": _plain(e.undecodable)}
        row += [str(e.stream_version), msgspec.json.encode(data).decode()]
    return row


def read_events(
    api: Api, params: list[tuple[str, str]], limit: int, follow: bool
) -> Iterator[list[EventBody]]:
    """Pages of the log; following, once caught up each request is held until events commit."""
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


@app.command("events")
def events(
    server: ServerOpt,
    token: TokenOpt = None,
    token_file: TokenFileOpt = None,
    node: NodeOpt = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Only events of this GPU UUID.")] = None,
    event_type: Annotated[
        list[str] | None, typer.Option("--type", help="Event type (repeatable).", show_default=False)
    ] = None,
    event_class: Annotated[
        EventClass | None, typer.Option("--class", help="lifecycle or observation.")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Recorded at or after: ISO 8601 time or duration (1h, 2d).")
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help="Recorded before: ISO 8601 time or duration (1h, 2d).")
    ] = None,
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
    header = ["POSITION", "RECORDED", "NODE", "TYPE", "CLASS"] + (["VERSION", "DATA"] if wide else [])
    collected: list[EventBody] = []
    for page in read_events(api, params, limit, follow):
        if follow:
            # A live stream cannot wait for a table: one line (or one JSON document) per event.
            for e in page:
                if output is Output.json:
                    sys.stdout.write(msgspec.json.encode(e).decode() + "\n")
                elif output is Output.yaml:
                    sys.stdout.write("---\n" + yaml.safe_dump(_plain(e), sort_keys=False))
                else:
                    sys.stdout.write("  ".join(_event_row(e, wide)) + "\n")
            sys.stdout.flush()
        else:
            collected += page
    if follow:
        return
    if output in (Output.json, Output.yaml):
        emit(collected, output)
    elif not collected:
        _nothing("events match")
    else:
        table(header, [_event_row(e, wide) for e in collected], ids=(0, 2, 3))


def command_specs() -> list[tuple[tuple[str, ...], list[str], list[str], dict[str, list[str] | str]]]:
    """(path, subcommands, options, option -> choices or "file"/"dir"/"") for every Typer command,
    for the shell completion scripts (api/cli/completion.py)."""
    specs: list[tuple[tuple[str, ...], list[str], list[str], dict[str, list[str] | str]]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        children: dict[str, Any] = getattr(command, "commands", {}) or {}
        options: list[str] = []
        values: dict[str, list[str] | str] = {}
        for param in command.params:
            if getattr(param, "param_type_name", "") != "option":
                continue
            names = [*param.opts, *param.secondary_opts]
            options += names
            if getattr(param, "is_flag", False):
                continue
            # Typer >= 0.20 describes a parameter's type with a descriptor; click with `type`.
            described = getattr(param, "type_descriptor", None) or getattr(param, "type", None)
            choices = getattr(described, "choices", None)
            kind: list[str] | str = (
                [str(getattr(c, "value", c)) for c in choices]
                if choices
                else "file"
                if "file" in param.name
                else ""
            )
            for name in names:
                values[name] = kind
        options.append("--help")
        specs.append((path, sorted(children), options, values))
        for name in sorted(children):
            walk(children[name], (*path, name))

    root = typer.main.get_command(app)
    for name in COMMANDS:
        walk(root.commands[name], (name,))  # type: ignore[attr-defined]
    return specs


def run(argv: list[str]) -> int:
    """Run one operator command; returns the exit code (one line on stderr when it fails)."""
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="modelforge-hw", standalone_mode=False)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        return 130
    except typer.TyperException as exc:  # usage errors: Typer prints them as click does
        show = getattr(exc, "show", None)
        if show is not None:
            show()
        return 2
    except RemoteError as exc:
        print(f"modelforge-hw: {exc}", file=sys.stderr)
        return 1 if exc.status == 0 else EXIT_OF_STATUS.get(exc.status, 2)
    return 0
