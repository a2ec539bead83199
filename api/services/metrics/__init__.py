"""/metrics: a snapshot of the read models in the Prometheus text format.

The route reads the read models once per scrape (`snapshot.read_snapshot`, async, one
connection) and `exposition` writes them as text (as prometheus-client's writer would, without
its per-line cost), so a scrape is always the state of one moment and nothing is cached between
scrapes. `catalog` names every family (`METRICS`); docs/metrics.md is rendered from it (`page`,
`python -m api.services.metrics --write`).

Naming follows the Prometheus rules: base units (`_bytes`, `_hertz`, `_celsius`, `_watts`), 0-1
`_ratio` instead of percent, `_total` for counters. GPU series carry dcgm-exporter's label names
(`gpu`, `UUID`, `modelName`, `Hostname`, `pci_bus_id`) so its dashboards work after a metric-name
mapping; `node_id` is ours. An unsupported or failed metric is absent, a known 0 is 0 (the DCGM
lesson).
"""
