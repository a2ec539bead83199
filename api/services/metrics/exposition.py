"""The Prometheus text of a snapshot, written here rather than through prometheus-client's
registry: its generic path builds a dict, a sample tuple and a sorted, validated, escaped label
list for every line, about 20 us a line, and a fleet is 20-33 lines per GPU: tens of seconds of
the server's one event loop for 10,000 nodes of 8 GPUs (docs/performance.md). Here each node's
and GPU's labels are escaped and ordered once and shared by all of its lines. The bytes are those
prometheus-client writes (labels sorted by name, its escaping, its float format);
tests/test_metrics.py holds the two equal."""

from __future__ import annotations

import platform
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from api.services.metrics.catalog import (
    ACCELERATORS,
    BUILD_INFO,
    COUNTERS,
    GPU_CLOCK_EVENTS,
    GPU_HEALTH_ACTION,
    GPU_HEALTH_REASON,
    GPU_HEALTH_SIGNALS,
    GPU_HEALTH_STATUS,
    GPU_INFO,
    GPU_LABELS,
    GPU_TELEMETRY,
    GPU_XID,
    HEALTH_ACTIONS,
    HEALTH_STATES,
    INVENTORY_STATES,
    LIVENESS_STATES,
    LOG_HEAD,
    NODE_INVENTORY,
    NODE_LABELS,
    NODE_LAST_SEEN,
    NODE_LIVENESS,
    NODE_TELEMETRY,
    PROJECTION_LAG,
    REPLAY_LAG,
    STORAGE,
    UNSEALED_DAYS,
    VERSION,
    WEBHOOK_DELIVERIES,
    WEBHOOK_FAILED_ATTEMPTS,
    WEBHOOK_LAST_DELIVERED,
    WEBHOOK_OUTCOMES,
    WEBHOOK_STATE,
    WEBHOOK_STATES,
    WEBHOOK_SUBSCRIPTIONS,
    MetricSpec,
)
from api.services.metrics.samples import clock_event_mask, fact_value, sample_value, signal_value
from api.services.metrics.snapshot import GpuRow, NodeRow, Snapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _number(value: float) -> str:
    """A sample value as prometheus-client writes it (Go's float format)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Labels:
    """One node's or GPU's own labels, escaped once; each line of it writes its family's labels
    sorted by name, as the text format's writers do."""

    def __init__(self, names: tuple[str, ...], values: list[str]) -> None:
        self.escaped = {k: _escape(v) for k, v in zip(names, values, strict=True)}
        self._pairs = [f'{k}="{v}"' for k, v in sorted(self.escaped.items())]
        self.plain = "{" + ",".join(self._pairs) + "}" if self._pairs else ""
        self._around: dict[str, tuple[str, str]] = {}

    def text(self, extra: dict[str, str]) -> str:
        pairs = sorted({**self.escaped, **{k: _escape(v) for k, v in extra.items()}}.items())
        return "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else ""

    def around(self, name: str) -> tuple[str, str]:
        """The text before and after the value of one more label `name` (a state set's)."""
        found = self._around.get(name)
        if found is None:
            split = sum(1 for k in self.escaped if k < name)
            before, after = self._pairs[:split], self._pairs[split:]
            found = self._around[name] = (
                "{" + "".join(f"{p}," for p in before) + f'{name}="',
                '"' + "".join(f",{p}" for p in after) + "}",
            )
        return found


def _header(spec: MetricSpec) -> str:
    doc = spec.help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {spec.name} {doc}\n# TYPE {spec.name} {spec.kind}\n"


def _line(spec: MetricSpec, labels: str, value: float) -> str:
    return f"{spec.name}{labels} {_number(value)}\n"


def _states(
    spec: MetricSpec, labels: _Labels, name: str, states: tuple[str, ...], current: str
) -> Iterator[str]:
    """A state set: 1 for the current state, 0 for the others."""
    head, tail = labels.around(name)
    for state in states:
        yield f"{spec.name}{head}{_escape(state)}{tail} {'1.0' if state == current else '0.0'}\n"


def _lines(s: Snapshot) -> Iterator[str]:
    """The text, one family after another (a family's lines are contiguous in the format), each
    node's and GPU's labels made once for all of its families. A row that gives a family no line
    (a metric not known, no health signals sent) yields "": `render_chunks` counts rows, not
    lines, so a family of 80,000 GPUs without a line is not one pass with the event loop held."""
    yield _header(BUILD_INFO)
    yield _line(BUILD_INFO, _Labels(BUILD_INFO.labels, [VERSION, platform.python_version()]).plain, 1)

    # Labels made as the first family goes, not all before it: the text keeps flowing.
    nodes: list[tuple[NodeRow, _Labels]] = []
    yield _header(NODE_LIVENESS)
    for n in s.nodes:
        labels = _Labels(NODE_LABELS, [n.hostname, n.node_id])
        nodes.append((n, labels))
        yield from _states(NODE_LIVENESS, labels, "liveness", LIVENESS_STATES, n.liveness)
    yield _header(NODE_INVENTORY)
    for n, labels in nodes:
        yield from _states(NODE_INVENTORY, labels, "status", INVENTORY_STATES, n.inventory_status)
    yield _header(NODE_LAST_SEEN)
    for n, labels in nodes:
        if n.last_received_at is None:
            yield ""
        else:
            yield _line(NODE_LAST_SEEN, labels.plain, n.last_received_at.timestamp())
    for spec in NODE_TELEMETRY:
        yield _header(spec)
        for n, labels in nodes:
            value = sample_value(n.telemetry.get(spec.source))
            yield "" if value is None else _line(spec, labels.plain, value * spec.scale)
    for k, spec in enumerate(STORAGE):
        yield _header(spec)
        for n, labels in nodes:
            yield ""
            for mount, *sizes in n.storage:
                value = sample_value(sizes[k])
                if value is not None:
                    yield _line(spec, labels.text({"mountpoint": mount}), value)

    gpus: list[tuple[GpuRow, _Labels]] = []
    yield _header(GPU_INFO)
    for g in s.gpus:
        labels = _Labels(GPU_LABELS, [g.index, g.uuid, g.model, g.hostname, g.pci_bus_id, g.node_id])
        gpus.append((g, labels))
        yield _line(GPU_INFO, labels.text({"status": g.status, "driver_version": g.driver_version}), 1)
    for spec in GPU_TELEMETRY:
        yield _header(spec)
        for g, labels in gpus:
            value = fact_value(g.telemetry.get(spec.source))
            # unsupported / failed: absent, never 0
            yield "" if value is None else _line(spec, labels.plain, value * spec.scale)
    yield _header(GPU_HEALTH_STATUS)
    for g, labels in gpus:
        yield from _states(GPU_HEALTH_STATUS, labels, "status", HEALTH_STATES, g.health_status)
    yield _header(GPU_HEALTH_ACTION)
    for g, labels in gpus:
        yield from _states(GPU_HEALTH_ACTION, labels, "action", HEALTH_ACTIONS, g.health_action)
    yield _header(GPU_HEALTH_REASON)
    for g, labels in gpus:
        yield ""
        for code, status, action in g.health_reasons:
            yield _line(GPU_HEALTH_REASON, labels.text({"code": code, "status": status, "action": action}), 1)
    for spec in GPU_HEALTH_SIGNALS:
        yield _header(spec)
        for g, labels in gpus:
            value = signal_value(g.health_signals, spec)
            # unsupported / failed / not sent: absent, never 0
            yield "" if value is None else _line(spec, labels.plain, value)
    yield _header(GPU_CLOCK_EVENTS)
    for g, labels in gpus:
        mask = clock_event_mask(g.health_signals)
        yield "" if mask is None else _line(GPU_CLOCK_EVENTS, labels.plain, mask)
    yield _header(GPU_XID)
    for g, labels in gpus:
        yield "" if g.last_xid is None else _line(GPU_XID, labels.plain, g.last_xid)
    yield from _released(gpus)
    yield from _released(nodes)

    yield _header(ACCELERATORS)
    for status, count in sorted(s.accelerator_counts.items()):
        yield _line(ACCELERATORS, _Labels(ACCELERATORS.labels, [status]).plain, count)
    for spec in COUNTERS:
        yield _header(spec)
        yield _line(spec, "", s.counters.get(spec.source, 0))
    for spec, value in (
        (LOG_HEAD, s.head),
        (PROJECTION_LAG, max(0, s.head - s.folded)),
        (UNSEALED_DAYS, s.unsealed_days),
    ):
        yield _header(spec)
        yield _line(spec, "", value)
    yield from _webhook_lines(s)
    yield _header(REPLAY_LAG)
    yield "" if s.replay_lag is None else _line(REPLAY_LAG, "", s.replay_lag)


def _released(rows: list[tuple[NodeRow, _Labels]] | list[tuple[GpuRow, _Labels]]) -> Iterator[str]:
    """The rows' labels dropped one row at a time, each counted as a row without a line: freed
    at the end of the text all at once, a fleet's are a stretch of a hundred milliseconds."""
    while rows:
        rows.pop()
        yield ""


def _webhook_lines(s: Snapshot) -> Iterator[str]:
    yield _header(WEBHOOK_SUBSCRIPTIONS)
    for state in WEBHOOK_STATES:
        count = sum(1 for w in s.webhooks if w.state == state)
        yield _line(WEBHOOK_SUBSCRIPTIONS, _Labels(WEBHOOK_SUBSCRIPTIONS.labels, [state]).plain, count)
    subscriptions = [(w, _Labels(("subscription_id",), [w.subscription_id])) for w in s.webhooks]
    yield _header(WEBHOOK_STATE)
    for w, labels in subscriptions:
        yield from _states(WEBHOOK_STATE, labels, "state", WEBHOOK_STATES, w.state)
    yield _header(WEBHOOK_DELIVERIES)
    for w, labels in subscriptions:
        for outcome, count in zip(WEBHOOK_OUTCOMES, (w.delivered, w.rejected, w.retried), strict=True):
            yield _line(WEBHOOK_DELIVERIES, labels.text({"outcome": outcome}), count)
    yield _header(WEBHOOK_FAILED_ATTEMPTS)
    for w, labels in subscriptions:
        yield _line(WEBHOOK_FAILED_ATTEMPTS, labels.plain, w.attempts)
    yield _header(WEBHOOK_LAST_DELIVERED)
    for w, labels in subscriptions:
        if w.last_delivered_at is not None:
            yield _line(WEBHOOK_LAST_DELIVERED, labels.plain, w.last_delivered_at.timestamp())


CHUNK_LINES = 1024  # about 0.2 MB of a fleet's GPU lines, and a few milliseconds of the event loop


def render_chunks(snapshot: Snapshot) -> Iterator[bytes]:
    """The text in pieces of at most CHUNK_LINES lines, one for every CHUNK_LINES rows or lines
    made (a piece may be empty): the route sends each as it is made, and lets the event loop run
    between them, so a fleet's scrape (hundreds of MB) is never whole in memory and never holds
    up agent reports for long."""
    batch: list[str] = []
    for line in _lines(snapshot):
        batch.append(line)
        if len(batch) >= CHUNK_LINES:  # lines or rows that gave none: a piece may be empty
            yield "".join(batch).encode()
            batch.clear()
    if batch:
        yield "".join(batch).encode()


def render(snapshot: Snapshot) -> bytes:
    return b"".join(render_chunks(snapshot))
