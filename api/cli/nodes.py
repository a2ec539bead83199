"""`modelforge-hw node list|show|telemetry`: compute nodes over the HTTP API."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from api.cli.gpus import OutputOpt, gpu_table
from api.cli.remote import Server, Token, TokenFile, connect, resolve_node
from api.cli.rendering import Output, driver, emit, gib, nothing, table, when
from api.cli.telemetry import node_telemetry

if TYPE_CHECKING:
    from api.services.reads.bodies import NodeBody

node_app = typer.Typer(
    no_args_is_help=True,
    help="compute nodes over the HTTP API: list, show, telemetry (MODELFORGE_SERVER, MODELFORGE_TOKEN)",
)


def node_health(n: NodeBody) -> str:
    """The worst GPU verdict, with how many GPUs are not healthy ("failed (1 failed, 2 degraded)")."""
    h = n.health
    if not h.healthy + h.degraded + h.failed:
        return "no GPUs"
    counts = [f"{v} {k}" for k, v in (("failed", h.failed), ("degraded", h.degraded)) if v]
    return h.status + (f" ({', '.join(counts)})" if counts else "")


def gpu_health_line(n: NodeBody) -> str:
    """How the node's GPUs are, by verdict ("degraded: 7 healthy, 1 degraded, 0 failed")."""
    h = n.health
    if not h.healthy + h.degraded + h.failed:
        return "no GPUs"
    return f"{h.status}: {h.healthy} healthy, {h.degraded} degraded, {h.failed} failed"


@node_app.command("list")
def node_list(
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """Every compute node, with its liveness, inventory status and GPU count."""
    api = connect(server, token, token_file)
    nodes = api.nodes()
    if emit(nodes, output):
        return
    if not nodes:
        nothing("nodes registered yet (enroll an agent or run `modelforge-hw refresh`)")
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
            node_health(n),
            n.driver_version or "-",
        ]
        for n in nodes
    ]
    if output is Output.wide:
        header += ["IDENTITY", "CPU", "MEMORY", "LAST SEEN"]
        for r, n in zip(rows, nodes, strict=True):
            r += [n.identity_key or "", n.cpu.model or "", gib(n.memory_total_bytes), when(n.last_seen_at)]
    table(header, rows)


@node_app.command("show")
def node_show(
    node: Annotated[
        str, typer.Argument(help="Node id, identity key, id prefix or hostname.", show_default=False)
    ],
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """One node (by id, identity key, id prefix or hostname) and its GPUs."""
    api = connect(server, token, token_file)
    found = resolve_node(api.nodes(), node)
    if emit(found, output):
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
        ["memory", gib(found.memory_total_bytes)],
        ["driver", driver(found.driver_version, found.cuda_driver_version)],
        ["gpu health", gpu_health_line(found)],
        ["first seen", when(found.first_seen_at)],
        ["last seen", when(found.last_seen_at)],
    ]
    table(["FIELD", "VALUE"], facts, wrap=(1,))
    sys.stdout.write("\n")
    if gpus:
        gpu_table(gpus, {found.id: found}, output)
    else:
        nothing("GPUs on this node")


node_app.command("telemetry")(node_telemetry)
