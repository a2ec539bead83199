"""The metric families /metrics exports: each one's name, type, help, labels and where its value
comes from (`METRICS`, in the order of the text)."""

from __future__ import annotations

from typing import Literal

import msgspec

# The node liveness family's states are the rule's own.
from api.services.reads.liveness import LIVENESS_STATES as LIVENESS_STATES
from runtime.version import VERSION as VERSION  # the build info's label

GPU_LABELS = ("gpu", "UUID", "modelName", "Hostname", "pci_bus_id", "node_id")
NODE_LABELS = ("Hostname", "node_id")
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
    _gpu(
        "modelforge_gpu_memory_used_bytes",
        "memory_used_bytes",
        "GPU framebuffer memory in use, without what the driver reserves (as nvidia-smi's Used).",
    ),
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
        "modelforge_folded_appends_total",
        "counter",
        "Report batches appended in one statement outside a transaction block, their events folded"
        " at positions reserved before they were sent (docs/architecture.md, one statement per batch).",
        (),
        "folded_appends",
    ),
    MetricSpec(
        "modelforge_folded_appends_refused_total",
        "counter",
        "Report batches whose one statement the database refused as decided on something not"
        " current (a kept state, a reserved position, a stream position's row): nothing written, the"
        " batch appended in a transaction instead.",
        (),
        "folded_appends_refused",
    ),
    MetricSpec(
        "modelforge_positions_reserved_total",
        "counter",
        "Reservations of global positions from the log's sequence (128 a time) for folded appends.",
        (),
        "positions_reserved",
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
    MetricSpec(
        "modelforge_telemetry_columns_stored_total",
        "counter",
        "Node-hours of telemetry this process stored as columns for the history reads (each closed"
        " hour of each reporting node, once).",
        (),
        "telemetry_hours_stored",
    ),
    MetricSpec(
        "modelforge_telemetry_columns_short_passes_total",
        "counter",
        "Telemetry-hours passes of this process that stopped at their CPU budget before they had"
        " looked at every hour: rising at an hour's end is the backlog of a big fleet, rising all"
        " the time is a server falling behind (shorten --telemetry-hours-interval).",
        (),
        "telemetry_hours_short_passes",
    ),
)
LOG_HEAD = MetricSpec("modelforge_log_head_position", "gauge", "Global position of the newest event.", ())
PROJECTION_LAG = MetricSpec(
    "modelforge_projection_lag_events",
    "gauge",
    "Events in the log not yet folded into the read models (inline folding: 0).",
    (),
)
UNSEALED_DAYS = MetricSpec(
    "modelforge_log_unsealed_day_segments",
    "gauge",
    "Day segments of the log whose day is over and whose indexes are not yet rebuilt packed (the"
    " retention pass seals them an hour after their day: 0 unless it fails).",
    (),
)
REPLAY_LAG = MetricSpec(
    "modelforge_database_replay_lag_seconds",
    "gauge",
    "How far the hot standby serving reads is behind its primary (only with a read standby).",
    (),
)

# Webhook subscriptions (docs/integrations.md), as their rows say: any server's /metrics shows
# every subscription, whichever server delivers it. Never the URL (it may hold a receiver's
# token in its path); the subscription id joins with `modelforge-hw webhook list`.
WEBHOOK_STATES = ("active", "failing")
WEBHOOK_OUTCOMES = ("delivered", "rejected", "retried")
WEBHOOK_SUBSCRIPTIONS = MetricSpec(
    "modelforge_webhook_subscriptions", "gauge", "Webhook subscriptions, by state.", ("state",)
)
WEBHOOK_STATE = MetricSpec(
    "modelforge_webhook_state",
    "gauge",
    "1 for the subscription's state (failing: its attempts ran out; retried every backoff maximum),"
    " 0 for the other.",
    ("subscription_id", "state"),
)
WEBHOOK_DELIVERIES = MetricSpec(
    "modelforge_webhook_deliveries_total",
    "counter",
    "Delivery attempts by outcome: delivered (2xx), rejected (another 4xx: skipped), retried (no"
    " answer, 5xx, 408, 429).",
    ("subscription_id", "outcome"),
)
WEBHOOK_FAILED_ATTEMPTS = MetricSpec(
    "modelforge_webhook_failed_attempts",
    "gauge",
    "Failed attempts in a row at the subscription's next event (0 when its receiver answers).",
    ("subscription_id",),
)
WEBHOOK_LAST_DELIVERED = MetricSpec(
    "modelforge_webhook_last_delivered_timestamp_seconds",
    "gauge",
    "When the subscription's receiver last acknowledged a delivery (Unix time); absent before the first.",
    ("subscription_id",),
)
WEBHOOKS = (
    WEBHOOK_SUBSCRIPTIONS,
    WEBHOOK_STATE,
    WEBHOOK_DELIVERIES,
    WEBHOOK_FAILED_ATTEMPTS,
    WEBHOOK_LAST_DELIVERED,
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
    UNSEALED_DAYS,
    *WEBHOOKS,
    REPLAY_LAG,
)
