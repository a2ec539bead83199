"""/metrics: a snapshot of the read models in the Prometheus text format.

The route reads the read models once per scrape (`read_snapshot`, async, one connection) and
`render` writes them as text (as prometheus-client's writer would, without its per-line cost),
so a scrape is always the state of one moment and nothing is cached between scrapes.

Naming follows the Prometheus rules: base units (`_bytes`, `_hertz`, `_celsius`, `_watts`), 0-1
`_ratio` instead of percent, `_total` for counters. GPU series carry dcgm-exporter's label names
(`gpu`, `UUID`, `modelName`, `Hostname`, `pci_bus_id`) so its dashboards work after a metric-name
mapping; `node_id` is ours. An unsupported or failed metric is absent, a known 0 is 0 (the DCGM
lesson). `METRICS` is the catalog; docs/metrics.md is rendered from it.
"""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, Literal

import asyncpg
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from api.services.repository import LivenessPolicy, _fact
from collectors.facts import Known
from collectors.gpu_health import CLOCK_EVENT_REASONS
from runtime.process import older_collections_deferred

CONTENT_TYPE = CONTENT_TYPE_LATEST
VERSION = "0.1.0"

GPU_LABELS = ("gpu", "UUID", "modelName", "Hostname", "pci_bus_id", "node_id")
NODE_LABELS = ("Hostname", "node_id")
LIVENESS_STATES = ("online", "stale", "offline", "local")
INVENTORY_STATES = ("pending", "ok", "degraded", "failed")
HEALTH_STATES = ("healthy", "degraded", "failed")
HEALTH_ACTIONS = ("none", "monitor", "inspect_host", "reset_gpu", "service")


class MetricSpec(msgspec.Struct, frozen=True):
    name: str
    kind: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...]
    # the read-model telemetry key this metric comes from, and the factor to base units
    source: str = ""
    scale: float = 1.0
    # a health signal that is a yes/no fact, exported as 1/0 (dcgm-exporter's form)
    flag: bool = False


def _gpu(name: str, source: str, help_: str, scale: float = 1.0) -> MetricSpec:
    return MetricSpec(name, "gauge", help_, GPU_LABELS, source, scale)


GPU_TELEMETRY = (
    _gpu("modelforge_gpu_memory_used_bytes", "memory_used_bytes", "GPU framebuffer memory in use."),
    _gpu("modelforge_gpu_memory_total_bytes", "memory_total_bytes", "GPU framebuffer memory total."),
    _gpu("modelforge_gpu_utilization_ratio", "utilization_gpu_percent", "GPU utilization (0-1).", 0.01),
    _gpu(
        "modelforge_gpu_memory_utilization_ratio",
        "utilization_memory_percent",
        "GPU memory-controller utilization (0-1).",
        0.01,
    ),
    _gpu("modelforge_gpu_temperature_celsius", "temperature_celsius", "GPU temperature."),
    _gpu("modelforge_gpu_power_watts", "power_watts", "GPU power draw."),
    _gpu("modelforge_gpu_clock_graphics_hertz", "clock_graphics_mhz", "GPU graphics clock.", 1e6),
    _gpu("modelforge_gpu_clock_sm_hertz", "clock_sm_mhz", "GPU SM clock.", 1e6),
    _gpu("modelforge_gpu_clock_memory_hertz", "clock_memory_mhz", "GPU memory clock.", 1e6),
    _gpu("modelforge_gpu_fan_speed_ratio", "fan_speed_percent", "GPU fan speed, share of maximum.", 0.01),
    _gpu(
        "modelforge_gpu_performance_state",
        "performance_state",
        "GPU performance state number (0 = P0, maximum performance).",
    ),
)


def _dcgm(name: str, signal: str, help_: str, *, flag: bool = False) -> MetricSpec:
    return MetricSpec(name, "gauge", help_, GPU_LABELS, f"health.{signal}", flag=flag)


# GPU health signals (collectors/gpu_health.py) under dcgm-exporter's names, so its alerts and
# dashboards work unchanged. Gauges all: prometheus-client would append `_total` to a counter's
# name, and the value is the device's own count as last read either way (rate() works alike).
GPU_HEALTH_SIGNALS = (
    _dcgm(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "ecc_errors.corrected_volatile",
        "Single-bit (corrected) ECC errors since the driver loaded.",
    ),
    _dcgm(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "ecc_errors.uncorrected_volatile",
        "Double-bit (uncorrected) ECC errors since the driver loaded.",
    ),
    _dcgm(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "ecc_errors.corrected_aggregate",
        "Single-bit (corrected) ECC errors over the GPU's lifetime.",
    ),
    _dcgm(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "ecc_errors.uncorrected_aggregate",
        "Double-bit (uncorrected) ECC errors over the GPU's lifetime.",
    ),
    _dcgm(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "remapped_rows.uncorrectable",
        "Rows remapped for uncorrectable errors (Ampere and later).",
    ),
    _dcgm(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "remapped_rows.correctable",
        "Rows remapped for correctable errors (Ampere and later).",
    ),
    _dcgm(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "remapped_rows.failure",
        "1 when row remapping has failed (the GPU needs service), else 0.",
        flag=True,
    ),
    _dcgm(
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "remapped_rows.pending",
        "1 when a row remap waits for a GPU reset, else 0.",
        flag=True,
    ),
    _dcgm(
        "DCGM_FI_DEV_RETIRED_SBE",
        "retired_pages.single_bit",
        "Pages retired for single-bit errors (before Ampere).",
    ),
    _dcgm(
        "DCGM_FI_DEV_RETIRED_DBE",
        "retired_pages.double_bit",
        "Pages retired for double-bit errors (before Ampere).",
    ),
    _dcgm(
        "DCGM_FI_DEV_RETIRED_PENDING",
        "retired_pages.pending",
        "1 when a page retirement waits for a GPU reset, else 0 (before Ampere).",
        flag=True,
    ),
    _dcgm(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "pcie_replay_count", "PCIe replays (retries) counted by the GPU."
    ),
)
GPU_CLOCK_EVENTS = MetricSpec(
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
    "gauge",
    "Active clock event (throttle) reasons as NVML's bitmask, e.g. 0x40 hardware thermal slowdown; "
    "absent unless every reason is known.",
    GPU_LABELS,
    "health.clock_event_reasons",
)
GPU_XID = MetricSpec(
    "DCGM_FI_DEV_XID_ERRORS",
    "gauge",
    "Code of the newest XID error the ledger recorded for the GPU (absent when none).",
    GPU_LABELS,
)
GPU_HEALTH_STATUS = MetricSpec(
    "modelforge_gpu_health_status",
    "gauge",
    "1 for the GPU's health verdict (docs/gpu-health.md), 0 for the others.",
    (*GPU_LABELS, "status"),
)
GPU_HEALTH_ACTION = MetricSpec(
    "modelforge_gpu_health_action",
    "gauge",
    "1 for the action the verdict recommends, 0 for the others.",
    (*GPU_LABELS, "action"),
)
GPU_HEALTH_REASON = MetricSpec(
    "modelforge_gpu_health_reason",
    "gauge",
    "One series per reason of the GPU's verdict (always 1); none for a healthy GPU.",
    (*GPU_LABELS, "code", "status", "action"),
)

NODE_TELEMETRY = (
    MetricSpec(
        "modelforge_node_memory_available_bytes",
        "gauge",
        "Host memory available.",
        NODE_LABELS,
        "memory_available_bytes",
    ),
    MetricSpec(
        "modelforge_node_memory_total_bytes", "gauge", "Host memory total.", NODE_LABELS, "memory_total_bytes"
    ),
)

STORAGE = (
    MetricSpec(
        "modelforge_node_filesystem_used_bytes",
        "gauge",
        "Bytes used on a mount.",
        (*NODE_LABELS, "mountpoint"),
        "used_bytes",
    ),
    MetricSpec(
        "modelforge_node_filesystem_size_bytes",
        "gauge",
        "Size of a mount.",
        (*NODE_LABELS, "mountpoint"),
        "total_bytes",
    ),
)

BUILD_INFO = MetricSpec(
    "modelforge_build_info", "gauge", "The server's version (always 1).", ("version", "python_version")
)
GPU_INFO = MetricSpec(
    "modelforge_gpu_info",
    "gauge",
    "One series per known GPU (always 1); `status` is active or missing.",
    (*GPU_LABELS, "status", "driver_version"),
)
NODE_LIVENESS = MetricSpec(
    "modelforge_node_liveness",
    "gauge",
    "1 for the node's liveness state (by the central clock), 0 for the others.",
    (*NODE_LABELS, "liveness"),
)
NODE_INVENTORY = MetricSpec(
    "modelforge_node_inventory_status",
    "gauge",
    "1 for the node's inventory status, 0 for the others.",
    (*NODE_LABELS, "status"),
)
NODE_LAST_SEEN = MetricSpec(
    "modelforge_node_last_seen_timestamp_seconds",
    "gauge",
    "When the server last received a report or refresh from the node (Unix time).",
    NODE_LABELS,
)
ACCELERATORS = MetricSpec(
    "modelforge_accelerators", "gauge", "Accelerators known to the ledger, by status.", ("status",)
)
COUNTERS = (
    MetricSpec(
        "modelforge_ingest_refreshes_total",
        "counter",
        "Refreshes and agent reports reconciled by this process.",
        (),
        "refreshes",
    ),
    MetricSpec(
        "modelforge_ingest_failures_total",
        "counter",
        "Refreshes that recorded INVENTORY_FAILED in this process.",
        (),
        "failures",
    ),
    MetricSpec("modelforge_ingest_events_total", "counter", "Events appended by this process.", (), "events"),
    MetricSpec(
        "modelforge_ingest_report_transactions_total",
        "counter",
        "Transactions that committed agent reports in this process (group commit batches).",
        (),
        "report_transactions",
    ),
    MetricSpec(
        "modelforge_ingest_reports_committed_total",
        "counter",
        "Agent reports committed by this process's group commit.",
        (),
        "reports_committed",
    ),
    MetricSpec(
        "modelforge_rendered_read_hits_total",
        "counter",
        "Node and accelerator-page reads this process answered with a kept rendering.",
        (),
        "rendered_hits",
    ),
    MetricSpec(
        "modelforge_rendered_read_misses_total",
        "counter",
        "Node and accelerator-page reads this process rendered anew (a query each).",
        (),
        "rendered_misses",
    ),
    MetricSpec(
        "modelforge_rendered_read_probes_total",
        "counter",
        "Probes of the log that checked this process's kept renderings (shared by concurrent reads).",
        (),
        "rendered_probes",
    ),
    MetricSpec(
        "modelforge_state_cache_hits_total",
        "counter",
        "Units of work that found their stream's folded state kept by this process (not sent by"
        " PostgreSQL, not decoded).",
        (),
        "state_cache_hits",
    ),
    MetricSpec(
        "modelforge_state_cache_misses_total",
        "counter",
        "Units of work whose stream's folded state PostgreSQL sent (another server wrote it, it"
        " was not kept, or a rebuild rewrote it).",
        (),
        "state_cache_misses",
    ),
    MetricSpec(
        "modelforge_kept_appends_total",
        "counter",
        "Transactions that appended on folded states this process kept, their locks, checks and"
        " append in one round trip (agent report batches among them).",
        (),
        "kept_appends",
    ),
    MetricSpec(
        "modelforge_kept_appends_stale_total",
        "counter",
        "Appends on kept states that found another checkpoint stored (another server wrote the"
        " stream, or a transaction of this process rolled back) and opened their streams as usual.",
        (),
        "kept_appends_stale",
    ),
    MetricSpec(
        "modelforge_kept_positions_stale_total",
        "counter",
        "Report batches rolled back and run again because a stream position this process kept"
        " was no longer the stored one.",
        (),
        "kept_positions_stale",
    ),
    MetricSpec(
        "modelforge_fast_reads_total",
        "counter",
        "Node and accelerator-page reads this process sent from the fast path (admin token, a"
        " rendering), without Litestar's handler.",
        (),
        "fast_reads",
    ),
)
LOG_HEAD = MetricSpec("modelforge_log_head_position", "gauge", "Global position of the newest event.", ())
PROJECTION_LAG = MetricSpec(
    "modelforge_projection_lag_events",
    "gauge",
    "Events in the log not yet folded into the read models (inline folding: 0).",
    (),
)

METRICS: tuple[MetricSpec, ...] = (
    BUILD_INFO,
    NODE_LIVENESS,
    NODE_INVENTORY,
    NODE_LAST_SEEN,
    *NODE_TELEMETRY,
    *STORAGE,
    GPU_INFO,
    *GPU_TELEMETRY,
    GPU_HEALTH_STATUS,
    GPU_HEALTH_ACTION,
    GPU_HEALTH_REASON,
    *GPU_HEALTH_SIGNALS,
    GPU_CLOCK_EVENTS,
    GPU_XID,
    ACCELERATORS,
    *COUNTERS,
    LOG_HEAD,
    PROJECTION_LAG,
)


# --- the snapshot: what one scrape reads ----------------------------------------------------------


class NodeRow(msgspec.Struct, frozen=True):
    node_id: str
    hostname: str
    liveness: str
    inventory_status: str
    last_received_at: datetime | None
    telemetry: dict[str, Any]
    storage: list[tuple[str, Any, Any]]


class GpuRow(msgspec.Struct, frozen=True):
    node_id: str
    hostname: str
    uuid: str
    status: str
    index: str
    model: str
    pci_bus_id: str
    driver_version: str
    telemetry: dict[str, Any]
    health_status: str = "healthy"
    health_action: str = "none"
    # (code, status, action) of each reason of the verdict
    health_reasons: list[tuple[str, str, str]] = []
    # the latest health signals as stored (jsonb builtins); None without any
    health_signals: dict[str, Any] | None = None
    last_xid: int | None = None


class Snapshot(msgspec.Struct, frozen=True):
    nodes: list[NodeRow]
    gpus: list[GpuRow]
    accelerator_counts: dict[str, int]
    head: int
    folded: int
    counters: dict[str, int]


def _known_text(raw: Any) -> str:
    """A fact's value as a label: the empty string when it is not known."""
    if raw is None:
        return ""
    fact = _fact(raw)
    return str(fact.value) if isinstance(fact, Known) else ""


def sample_value(raw: Any) -> float | None:
    """A telemetry fact as a sample value, or None (absent) unless known and numeric.

    A boolean or text in a numeric metric is garbage, not a number: absent, never 1 or 0.
    """
    if raw is None:
        return None
    fact = _fact(raw)
    if not isinstance(fact, Known):
        return None
    value = fact.value
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value[:1] == "P" and value[1:].isdigit():
        return float(value[1:])
    return None


def signal_value(signals: dict[str, Any] | None, spec: MetricSpec) -> float | None:
    """A health signal as a sample value, or None (absent) unless known and of its kind: a count
    (an integer) or, for a flag, a boolean as 1/0. Unsupported is absent, never 0."""
    if not signals:
        return None
    group, _, name = spec.source.removeprefix("health.").partition(".")
    raw = signals.get(group)
    if name:
        raw = raw.get(name) if isinstance(raw, dict) else None
    if raw is None:
        return None
    fact = _fact(raw)
    if not isinstance(fact, Known):
        return None
    value = fact.value
    if spec.flag:
        return float(value) if isinstance(value, bool) else None
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else None


def clock_event_mask(signals: dict[str, Any] | None) -> int | None:
    """NVML's clock event reasons bitmask (as DCGM reports it), rebuilt from the per-reason
    facts; None unless every reason is a known boolean, since a partial mask would read as
    'not throttled' for the reasons it lacks."""
    reasons = (signals or {}).get("clock_event_reasons")
    if not isinstance(reasons, dict):
        return None
    mask = 0
    for name, bit in CLOCK_EVENT_REASONS.items():
        raw = reasons.get(name)
        fact = None if raw is None else _fact(raw)
        if not isinstance(fact, Known) or not isinstance(fact.value, bool):
            return None
        mask |= bit if fact.value else 0
    return mask


def _slices(rows: list[asyncpg.Record], size: int = 250) -> Iterator[list[asyncpg.Record]]:
    """A fleet's rows in slices: turned into rows one slice at a time, with the event loop free
    between them (80,000 GPUs at once held agent reports up for over a second)."""
    for k in range(0, len(rows), size):
        yield rows[k : k + size]


def _node_row(r: asyncpg.Record, liveness: LivenessPolicy, now: datetime) -> NodeRow:
    return NodeRow(
        node_id=r["node_id"],
        hostname=r["hostname"] or "",
        liveness=liveness.judge(r["source"], r["received_at"], now),
        inventory_status=r["inventory_status"],
        last_received_at=r["received_at"],
        telemetry=dict(r["metrics"] or {}),
        storage=[(m, used, total) for m, used, total in r["storage"]],
    )


def _gpu_row(r: asyncpg.Record) -> GpuRow:
    return GpuRow(
        node_id=r["node_id"],
        hostname=r["hostname"] or "",
        uuid=r["uuid"],
        status=r["status"],
        index=_known_text(r["device_index"]),
        model=_known_text(r["name"]),
        pci_bus_id=_known_text(r["pci_bus_id"]),
        driver_version=_known_text(r["driver_version"]),
        # a missing GPU's last telemetry is history, not a current reading
        telemetry=dict(r["metrics"] or {}) if r["status"] == "active" else {},
        # The verdict and the XIDs are the ledger's record, not a reading: kept when missing.
        health_status=r["health_status"],
        health_action=r["health_action"],
        health_reasons=[(x["code"], x["status"], x["action"]) for x in r["health_reasons"] or []],
        health_signals=r["health_signals"] if r["status"] == "active" else None,
        last_xid=r["last_xid"] if isinstance(r["last_xid"], int) else None,
    )


async def read_snapshot(
    pool: asyncpg.Pool, liveness: LivenessPolicy, counters: dict[str, int], now: datetime | None = None
) -> Snapshot:
    """The fleet's rows as one repeatable-read snapshot, with the older collections deferred
    while its rows are read and built (`older_collections_deferred`)."""
    with older_collections_deferred():
        return await _read_snapshot(pool, liveness, counters, now or datetime.now(UTC))


async def _read_snapshot(
    pool: asyncpg.Pool, liveness: LivenessPolicy, counters: dict[str, int], now: datetime
) -> Snapshot:
    async with pool.acquire() as conn, conn.transaction(readonly=True, isolation="repeatable_read"):
        node_rows = await conn.fetch(
            "SELECT n.node_id, n.hostname, n.source, n.inventory_status, t.received_at, t.metrics, "
            "coalesce((SELECT jsonb_agg(jsonb_build_array(s.mount, s.used_bytes, s.total_bytes) "
            "ORDER BY s.mount) FROM hw_node_storage s WHERE s.node_id = n.node_id), '[]'::jsonb) "
            "AS storage "
            "FROM hw_nodes n LEFT JOIN hw_host_telemetry t ON t.node_id = n.node_id "
            "WHERE n.status = 'active' ORDER BY n.node_id"
        )
        # Each GPU's sample from the event its telemetry row points at (schema.sql, mf_samples:
        # every such event read once for all of its GPUs).
        gpu_rows = await conn.fetch(
            "WITH t AS MATERIALIZED (SELECT accelerator_id, position FROM hw_accelerator_telemetry), "
            "samples AS MATERIALIZED (SELECT * FROM mf_samples(ARRAY(SELECT DISTINCT position FROM t))) "
            "SELECT a.node_id, n.hostname, a.uuid, a.status, a.device_index, a.name, a.pci_bus_id, "
            "a.driver_version, s.out_sample->'telemetry' AS metrics, a.health_status, a.health_action, "
            "a.health_reasons, a.health_xids->-1->'code' AS last_xid, "
            "nullif(s.out_sample->'health', 'null'::jsonb) AS health_signals FROM hw_accelerators a "
            "JOIN hw_nodes n ON n.node_id = a.node_id "
            "LEFT JOIN t ON t.accelerator_id = a.accelerator_id "
            "LEFT JOIN samples s ON s.out_position = t.position AND s.out_uuid = a.uuid "
            "WHERE a.status IN ('active', 'missing') AND n.status = 'active' ORDER BY a.node_id, a.uuid"
        )
        counts = await conn.fetch("SELECT status, count(*) AS n FROM hw_accelerators GROUP BY status")
        head = await conn.fetchval("SELECT coalesce(max(global_position), 0) FROM events")
        folded = await conn.fetchval("SELECT coalesce(max(position), 0) FROM projection_state")
    nodes: list[NodeRow] = []
    for rows in _slices(node_rows):
        nodes.extend(_node_row(r, liveness, now) for r in rows)
        await asyncio.sleep(0)
    gpus: list[GpuRow] = []
    for rows in _slices(gpu_rows):
        gpus.extend(_gpu_row(r) for r in rows)
        await asyncio.sleep(0)
    return Snapshot(
        nodes=nodes,
        gpus=gpus,
        accelerator_counts={r["status"]: int(r["n"]) for r in counts},
        head=int(head),
        folded=int(folded),
        counters=counters,
    )


# --- the text -------------------------------------------------------------------------------------
#
# Written here rather than through prometheus-client's registry: its generic path builds a dict,
# a sample tuple and a sorted, validated, escaped label list for every line, about 20 us a line
# here, and a fleet is 20-33 lines per GPU: a scrape of 10,000 nodes x 8 GPUs held the server's
# one event loop for 30-55 s (docs/performance.md, issue 12, tenth step). Here each node's and
# GPU's labels are escaped and ordered once and shared by all of its lines. The bytes are those
# prometheus-client writes (labels sorted by name, its escaping, its float format);
# tests/test_metrics.py holds the two equal.


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
            value = sample_value(g.telemetry.get(spec.source))
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

    yield _header(ACCELERATORS)
    for status, count in sorted(s.accelerator_counts.items()):
        yield _line(ACCELERATORS, _Labels(ACCELERATORS.labels, [status]).plain, count)
    for spec in COUNTERS:
        yield _header(spec)
        yield _line(spec, "", s.counters.get(spec.source, 0))
    for spec, value in ((LOG_HEAD, s.head), (PROJECTION_LAG, max(0, s.head - s.folded))):
        yield _header(spec)
        yield _line(spec, "", value)


CHUNK_LINES = 4096  # about 0.8 MB of a fleet's GPU lines


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


# --- the catalog page -------------------------------------------------------------------------------


def render_catalog() -> str:
    lines = [
        "# Metrics catalog",
        "",
        "<!-- Generated from api/services/metrics.py by `python -m api.services.metrics --write`; "
        "do not edit. -->",
        "",
        "`GET /metrics` (an operator or viewer token) answers the Prometheus text format with",
        f"Content-Type `{CONTENT_TYPE}`. Everything is read from the read models at scrape time.",
        "A telemetry metric that is unsupported, unavailable or failed on a device is absent",
        "(no series), never 0; a measured 0 is 0. Decommissioned nodes and their GPUs are not",
        "exported (they still count in `modelforge_accelerators`).",
        "",
        "## Labels and dcgm-exporter",
        "",
        "GPU series use dcgm-exporter's label names, so its dashboards need only a metric-name mapping:",
        "",
        "| label | meaning | dcgm-exporter |",
        "|---|---|---|",
        "| `gpu` | device index on the node (empty when unknown) | `gpu` |",
        "| `UUID` | the GPU's UUID (the accelerator's identity on its node) | `UUID` |",
        "| `modelName` | product name, e.g. `NVIDIA H100 80GB HBM3` | `modelName` |",
        "| `Hostname` | the node's current hostname (metadata, not identity) | `Hostname` |",
        "| `pci_bus_id` | PCI bus id | `pci_bus_id` |",
        "| `node_id` | the node's ledger id (stable; use it to join) | — |",
        "",
        "| modelforge | dcgm-exporter |",
        "|---|---|",
        "| `modelforge_gpu_utilization_ratio` | `DCGM_FI_DEV_GPU_UTIL` / 100 |",
        "| `modelforge_gpu_memory_utilization_ratio` | `DCGM_FI_DEV_MEM_COPY_UTIL` / 100 |",
        "| `modelforge_gpu_memory_used_bytes` | `DCGM_FI_DEV_FB_USED` × 2^20 |",
        "| `modelforge_gpu_temperature_celsius` | `DCGM_FI_DEV_GPU_TEMP` |",
        "| `modelforge_gpu_power_watts` | `DCGM_FI_DEV_POWER_USAGE` |",
        "| `modelforge_gpu_clock_sm_hertz` | `DCGM_FI_DEV_SM_CLOCK` × 10^6 |",
        "| `modelforge_gpu_clock_memory_hertz` | `DCGM_FI_DEV_MEM_CLOCK` × 10^6 |",
        "",
        "## GPU health",
        "",
        "The health signals (docs/gpu-health.md) carry dcgm-exporter's own names and meanings, so its",
        "alerts and dashboards apply unchanged. Like every metric here, a signal is exported only when",
        "it is a known fact: an unsupported one (ECC on a consumer GPU, row remapping before Ampere,",
        "page retirement after it) or one from an agent that sends no signals is absent, never 0.",
        "",
        "- All are gauges (dcgm-exporter types some as counters): the value is the device's own count",
        "  as last read, and `rate()`/`increase()` work on it alike. The `_VOL_` ECC counts restart at",
        "  each driver load; the `_AGG_` ones are the GPU's lifetime.",
        "- SBE (single-bit) is NVML's *corrected* count, DBE (double-bit) its *uncorrected* one.",
        "- `DCGM_FI_DEV_ROW_REMAP_FAILURE`, `DCGM_FI_DEV_ROW_REMAP_PENDING` and",
        "  `DCGM_FI_DEV_RETIRED_PENDING` are 1 or 0.",
        "- `DCGM_FI_DEV_CLOCKS_EVENT_REASONS` is NVML's bitmask, as DCGM reports it (0x8 hardware",
        "  slowdown, 0x40 hardware thermal slowdown, 0x80 power brake; 0x1 idle and 0x4 software power",
        "  cap are normal operation); absent unless every reason is known.",
        "- `DCGM_FI_DEV_XID_ERRORS` is the code of the newest XID the ledger recorded for the GPU, as",
        "  dcgm-exporter's is the last XID seen; it stays until another XID replaces it (the verdict",
        "  counts an XID for 24 hours only). Absent when the GPU never reported one. It is kept for a",
        "  missing GPU (an XID 79 is often why it went missing), while the signals are not.",
        "- `modelforge_gpu_health_status` is 1 for the verdict (`healthy`, `degraded`, `failed`) and 0",
        "  for the others, `modelforge_gpu_health_action` the same for the recommended action (`none`,",
        "  `monitor`, `inspect_host`, `reset_gpu`, `service`); `modelforge_gpu_health_reason` has one",
        "  series per reason (`code`, with its own `status` and `action`).",
        "",
        "## Metrics",
        "",
        "| name | type | labels | from | help |",
        "|---|---|---|---|---|",
    ]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "—"
        scale = f" × {spec.scale:g}" if spec.scale != 1.0 else ""
        source = f"`{spec.source}`{scale}" if spec.source else "—"
        lines.append(f"| `{spec.name}` | {spec.kind} | {labels} | {source} | {spec.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
    if sys.argv[1:] == ["--write"]:
        page.write_text(render_catalog(), encoding="utf-8")
    else:
        sys.stdout.write(render_catalog())
