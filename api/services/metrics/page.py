"""docs/metrics.md, the catalog page, rendered from the catalog (`python -m api.services.metrics
--write` writes it; tests/test_metrics.py holds the two equal)."""

from __future__ import annotations

from api.services.metrics.catalog import METRICS
from api.services.metrics.exposition import CONTENT_TYPE


def render_catalog() -> str:
    lines = [
        "# Metrics catalog",
        "",
        "<!-- Generated from api/services/metrics/catalog.py by `python -m api.services.metrics --write`; "
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
