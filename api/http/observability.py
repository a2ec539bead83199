"""The observability adapter: latest telemetry in the Prometheus text exposition format.

Only `known` values are exported, labelled by node and GPU UUID; an unsupported or failed metric
is absent, never 0 (the DCGM lesson). A known 0 is exported as 0. The server's own ingest counters
and projection lag come along.
"""

from __future__ import annotations

from collections.abc import Iterable

from api.services.inventory import IngestCounters
from api.services.repository import MetricSample

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def render(samples: Iterable[MetricSample], counters: IngestCounters) -> str:
    all_samples = list(samples)
    all_samples += [
        MetricSample(
            "modelforge_ingest_refreshes_total",
            "refreshes and agent reports reconciled",
            {},
            float(counters.refreshes),
        ),
        MetricSample(
            "modelforge_ingest_failures_total",
            "refreshes that recorded INVENTORY_FAILED",
            {},
            float(counters.failures),
        ),
        MetricSample(
            "modelforge_ingest_events_total", "events appended by this process", {}, float(counters.events)
        ),
    ]
    lines: list[str] = []
    seen: set[str] = set()
    for sample in sorted(all_samples, key=lambda s: s.name):
        if sample.name not in seen:
            seen.add(sample.name)
            kind = "counter" if sample.name.endswith("_total") else "gauge"
            lines.append(f"# HELP {sample.name} {_escape(sample.help)}")
            lines.append(f"# TYPE {sample.name} {kind}")
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
        lines.append(
            f"{sample.name}{{{labels}}} {_format(sample.value)}"
            if labels
            else f"{sample.name} {_format(sample.value)}"
        )
    return "\n".join(lines) + "\n"
