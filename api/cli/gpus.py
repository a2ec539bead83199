"""`modelforge-hw gpu list|show|telemetry|history|lemons`: GPUs over the HTTP API, with their health
verdict."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Annotated

import typer

from api.cli.gpu_history import gpu_history, gpu_lemons
from api.cli.remote import Server, Token, TokenFile, connect, resolve_gpu, resolve_node
from api.cli.rendering import Output, driver, emit, gib, nothing, table, when
from api.cli.telemetry import gpu_telemetry
from api.services.wording import fact_label, fact_view, signal_rows

if TYPE_CHECKING:
    from api.services.reads.bodies import AcceleratorBody, HealthSignalsBody, NodeBody
    from collectors.facts import Fact

gpu_app = typer.Typer(
    no_args_is_help=True, help="GPUs over the HTTP API: list, show, telemetry, history, lemons"
)

OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table, wide, json or yaml.")]
NodeOpt = Annotated[
    str | None,
    typer.Option("--node", help="Node: id, identity key, id prefix or hostname.", show_default=False),
]


class GpuState(enum.StrEnum):
    active = "active"
    missing = "missing"
    decommissioned = "decommissioned"


class Health(enum.StrEnum):
    healthy = "healthy"
    degraded = "degraded"
    failed = "failed"


# The states whose reason is NVML's or the collector's own words, worth a line of their own.
_WITH_REASON = ("unavailable", "temporarily_failed")


def fact_text(name: str, fact: Fact | None) -> str:
    """A fact as the console reads it: a known value with its unit (`72 °C`, `yes`), any other state
    in words (`not supported`, `unavailable: <reason>`), so it never reads as a value."""
    view = fact_view(name, fact)
    return f"{view.text}: {view.reason}" if view.state in _WITH_REASON and view.reason else view.text


def _host(g: AcceleratorBody, nodes: dict[str, NodeBody]) -> str:
    node = nodes.get(g.node_id)
    return (node.hostname if node is not None else None) or g.node_id[:8]


def gpu_table(gpus: list[AcceleratorBody], nodes: dict[str, NodeBody], output: Output) -> None:
    """GPUs by node, then in index order, as nvidia-smi lists a host's."""
    header = ["UUID", "NODE", "INDEX", "NAME", "MEMORY", "STATE", "HEALTH"]
    gpus = sorted(gpus, key=lambda g: (_host(g, nodes), g.node_id, g.index is None, g.index or 0, g.uuid))
    rows = [
        [
            g.uuid,
            _host(g, nodes),
            "" if g.index is None else str(g.index),
            g.name or "",
            gib(g.memory_total_bytes),
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
                when(g.last_seen_at),
            ]
    table(header, rows)


@gpu_app.command("list")
def gpu_list(
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
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
    if emit(gpus, output):
        return
    if not gpus:
        nothing(
            "GPUs"
            + (f" on node {node}" if node else "")
            + (f" in state {state.value}" if state else "")
            + (f" with health {health.value}" if health else "")
        )
        return
    gpu_table(gpus, {n.id: n for n in nodes}, output)


@gpu_app.command("show")
def gpu_show(
    gpu: Annotated[str, typer.Argument(help="GPU UUID, UUID prefix or id prefix.", show_default=False)],
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """One GPU by UUID (or a prefix of its UUID or id)."""
    from collectors.observations import ACCELERATOR_METRICS

    api = connect(server, token, token_file)
    found = resolve_gpu(api.accelerators(), gpu)
    if emit(found, output):
        return
    node = api.node(found.node_id)
    h = found.health
    health = [
        ["health", h.status],
        ["action", h.action],
        *[["reason", f"{r.code} ({r.status}, {r.action}): {r.detail}"] for r in h.reasons],
        *[["xid", f"{x.code} at {when(x.at)}"] for x in reversed(h.recent_xids)],
    ]
    # Every signal and metric labelled as the console labels it, its state in words when it is not
    # a value (an unsupported ECC count is not 0, a fan without a sensor is not at 0 %).
    signals = [] if h.signals is None else _signal_rows(h.signals)
    telemetry = [
        *[(m, found.telemetry.get(m)) for m in ACCELERATOR_METRICS],
        *sorted((m, f) for m, f in found.telemetry.items() if m not in ACCELERATOR_METRICS),
    ]
    rows = [
        ["uuid", found.uuid],
        ["id", found.id],
        [
            "node",
            f"{node.hostname} ({found.node_id})" if node.hostname else found.node_id,
        ],
        ["index", "" if found.index is None else str(found.index)],
        ["name", found.name or ""],
        ["state", found.status + (f" since {when(found.missing_since)}" if found.missing_since else "")],
        ["pci", found.pci_bus_id or ""],
        ["memory", gib(found.memory_total_bytes)],
        ["compute capability", found.compute_capability or ""],
        ["driver", driver(found.driver_version, found.cuda_driver_version)],
        ["first seen", when(found.first_seen_at)],
        ["last seen", when(found.last_seen_at)],
        *health,
        *[[f"signal {fact_label(k)}", fact_text(k, v)] for k, v in signals],
        *[[f"telemetry {fact_label(m)}", fact_text(m, f)] for m, f in telemetry],
    ]
    table(["FIELD", "VALUE"], rows, wrap=(1,))


def _signal_rows(signals: HealthSignalsBody) -> list[tuple[str, Fact]]:
    """The console's rows, in its order, with the clock event reasons as one row: only those in
    effect (the others are the normal case and would be most of the list)."""
    from collectors.facts import Known

    rows = signal_rows(signals)
    reasons = [(k, v) for k, v in rows if k.startswith("clock_event_reasons.")]
    active = [
        fact_label(k).removeprefix("Clock event: ")
        for k, v in reasons
        if isinstance(v, Known) and v.value is True
    ]
    unknown = [v for _, v in reasons if not isinstance(v, Known)]
    collapsed: Fact = unknown[0] if unknown else Known(", ".join(active) or "none")
    at = rows.index(reasons[0]) if reasons else len(rows) - 1
    rows = [r for r in rows if not r[0].startswith("clock_event_reasons.")]
    rows.insert(at, ("clock_event_reasons", collapsed))
    return rows


gpu_app.command("telemetry")(gpu_telemetry)
gpu_app.command("history")(gpu_history)
gpu_app.command("lemons")(gpu_lemons)
