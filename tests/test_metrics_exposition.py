"""/metrics writes exactly the text prometheus-client's own writer makes of the same snapshot,
label values with quotes, backslashes, newlines and non-ASCII included."""

from __future__ import annotations

import platform
from datetime import UTC
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.services.metrics.catalog import GPU_HEALTH_SIGNALS, GPU_TELEMETRY, HEALTH_ACTIONS, HEALTH_STATES
from api.services.metrics.exposition import render
from api.services.metrics.samples import clock_event_mask, fact_value, sample_value, signal_value
from api.services.metrics.snapshot import GpuRow, NodeRow, Snapshot, WebhookRow
from api.services.reads.facts import stored_facts
from collectors.gpu_health import CLOCK_EVENT_REASONS
from tests.metrics_support import facts, signals_of


def reference_text(s: Snapshot) -> bytes:
    """The same snapshot through prometheus-client's registry and `generate_latest` (the writer
    /metrics stands in for, 5-7x faster): the same families in the same order,
    made with the same value decisions; only the writing differs."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from api.services.metrics import catalog as m

    def family(spec: Any) -> Any:
        if spec.kind == "counter":
            return CounterMetricFamily(spec.name.removesuffix("_total"), spec.help, labels=spec.labels)
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)

    def collect() -> Any:
        build = family(m.BUILD_INFO)
        build.add_metric([m.VERSION, platform.python_version()], 1)
        yield build
        node_specs = (m.NODE_LIVENESS, m.NODE_INVENTORY, m.NODE_LAST_SEEN, *m.NODE_TELEMETRY, *m.STORAGE)
        f = {spec.name: family(spec) for spec in node_specs}
        for n in s.nodes:
            base = [n.hostname, n.node_id]
            for state in m.LIVENESS_STATES:
                f[m.NODE_LIVENESS.name].add_metric([*base, state], 1 if n.liveness == state else 0)
            for state in m.INVENTORY_STATES:
                f[m.NODE_INVENTORY.name].add_metric([*base, state], 1 if n.inventory_status == state else 0)
            if n.last_received_at is not None:
                f[m.NODE_LAST_SEEN.name].add_metric(base, n.last_received_at.timestamp())
            for spec in m.NODE_TELEMETRY:
                value = sample_value(n.telemetry.get(spec.source))
                if value is not None:
                    f[spec.name].add_metric(base, value * spec.scale)
            for mount, used, total in n.storage:
                for spec, raw in zip(m.STORAGE, (used, total), strict=True):
                    value = sample_value(raw)
                    if value is not None:
                        f[spec.name].add_metric([*base, mount], value)
        yield from f.values()
        gpu_specs = (m.GPU_INFO, *m.GPU_TELEMETRY, m.GPU_HEALTH_STATUS, m.GPU_HEALTH_ACTION,
                     m.GPU_HEALTH_REASON, *m.GPU_HEALTH_SIGNALS, m.GPU_CLOCK_EVENTS, m.GPU_XID)  # fmt: skip
        f = {spec.name: family(spec) for spec in gpu_specs}
        for g in s.gpus:
            labels = [g.index, g.uuid, g.model, g.hostname, g.pci_bus_id, g.node_id]
            f[m.GPU_INFO.name].add_metric([*labels, g.status, g.driver_version], 1)
            for spec in m.GPU_TELEMETRY:
                value = fact_value(g.telemetry.get(spec.source))
                if value is not None:
                    f[spec.name].add_metric(labels, value * spec.scale)
            for state in m.HEALTH_STATES:
                f[m.GPU_HEALTH_STATUS.name].add_metric([*labels, state], 1 if g.health_status == state else 0)
            for name in m.HEALTH_ACTIONS:
                f[m.GPU_HEALTH_ACTION.name].add_metric([*labels, name], 1 if g.health_action == name else 0)
            for reason in g.health_reasons:
                f[m.GPU_HEALTH_REASON.name].add_metric([*labels, *reason], 1)
            for spec in m.GPU_HEALTH_SIGNALS:
                value = signal_value(g.health_signals, spec)
                if value is not None:
                    f[spec.name].add_metric(labels, value)
            mask = clock_event_mask(g.health_signals)
            if mask is not None:
                f[m.GPU_CLOCK_EVENTS.name].add_metric(labels, mask)
            if g.last_xid is not None:
                f[m.GPU_XID.name].add_metric(labels, g.last_xid)
        yield from f.values()
        accelerators = family(m.ACCELERATORS)
        for status, count in sorted(s.accelerator_counts.items()):
            accelerators.add_metric([status], count)
        yield accelerators
        for spec in m.COUNTERS:
            counter = family(spec)
            counter.add_metric([], s.counters.get(spec.source, 0))
            yield counter
        for spec, value in (
            (m.LOG_HEAD, s.head),
            (m.PROJECTION_LAG, max(0, s.head - s.folded)),
            (m.UNSEALED_DAYS, s.unsealed_days),
        ):
            single = family(spec)
            single.add_metric([], value)
            yield single
        f = {spec.name: family(spec) for spec in m.WEBHOOKS}
        for state in m.WEBHOOK_STATES:
            f[m.WEBHOOK_SUBSCRIPTIONS.name].add_metric(
                [state], sum(1 for w in s.webhooks if w.state == state)
            )
        for w in s.webhooks:
            for state in m.WEBHOOK_STATES:
                f[m.WEBHOOK_STATE.name].add_metric([w.subscription_id, state], 1 if w.state == state else 0)
            for outcome, count in zip(m.WEBHOOK_OUTCOMES, (w.delivered, w.rejected, w.retried), strict=True):
                f[m.WEBHOOK_DELIVERIES.name].add_metric([w.subscription_id, outcome], count)
            f[m.WEBHOOK_FAILED_ATTEMPTS.name].add_metric([w.subscription_id], w.attempts)
            if w.last_delivered_at is not None:
                f[m.WEBHOOK_LAST_DELIVERED.name].add_metric(
                    [w.subscription_id], w.last_delivered_at.timestamp()
                )
        yield from f.values()
        lag = family(m.REPLAY_LAG)
        if s.replay_lag is not None:
            lag.add_metric([], s.replay_lag)
        yield lag

    class Reference:
        def collect(self) -> Any:
            return collect()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Reference())
    return generate_latest(registry)


# Label values a scrape must carry through intact: quotes, backslashes, newlines, non-ASCII.
label_text = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ['a"b', "back\\slash", "two\nlines", "\\n", 'q"\\', "gpu-r001.dc1", ""]
)
gpu_rows = st.builds(
    GpuRow,
    node_id=label_text,
    hostname=label_text,
    uuid=label_text,
    status=st.sampled_from(["active", "missing"]),
    index=label_text,
    model=label_text,
    pci_bus_id=label_text,
    driver_version=label_text,
    telemetry=st.dictionaries(st.sampled_from([m.source for m in GPU_TELEMETRY]), facts).map(stored_facts),
    health_status=st.sampled_from(HEALTH_STATES),
    health_action=st.sampled_from(HEALTH_ACTIONS),
    health_reasons=st.lists(
        st.tuples(label_text, st.sampled_from(HEALTH_STATES), st.sampled_from(HEALTH_ACTIONS)), max_size=2
    ),
    health_signals=st.none()
    | st.builds(
        signals_of,
        st.fixed_dictionaries({spec.source: facts for spec in GPU_HEALTH_SIGNALS}),
        st.dictionaries(st.sampled_from(sorted(CLOCK_EVENT_REASONS)), facts),
    ),
    last_xid=st.none() | st.integers(0, 2**32 - 1),
)
node_rows = st.builds(
    NodeRow,
    node_id=label_text,
    hostname=label_text,
    liveness=st.sampled_from(["online", "stale", "offline", "local"]),
    inventory_status=st.sampled_from(["pending", "ok", "degraded", "failed"]),
    last_received_at=st.none() | st.datetimes(timezones=st.just(UTC)),
    telemetry=st.dictionaries(st.sampled_from(["memory_available_bytes", "memory_total_bytes"]), facts),
    storage=st.lists(st.tuples(label_text, facts, facts), max_size=2),
)
webhook_rows = st.builds(
    WebhookRow,
    subscription_id=label_text,
    state=st.sampled_from(["active", "failing"]),
    delivered=st.integers(0, 2**53),
    rejected=st.integers(0, 10**6),
    retried=st.integers(0, 10**6),
    attempts=st.integers(0, 100),
    last_delivered_at=st.none() | st.datetimes(timezones=st.just(UTC)),
)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(
    nodes=st.lists(node_rows, max_size=3),
    gpus=st.lists(gpu_rows, max_size=3),
    counts=st.dictionaries(st.sampled_from(["active", "missing", "removed"]), st.integers(0, 10**6)),
    counters=st.fixed_dictionaries(
        {}, optional={"events": st.integers(0, 2**53), "refreshes": st.integers(0, 9)}
    ),
    head=st.integers(0, 2**40),
    behind=st.integers(-5, 5),
    webhooks=st.lists(webhook_rows, max_size=2),
    lag=st.none() | st.floats(0, 1e6, allow_nan=False),
    unsealed=st.integers(0, 3),
)
def test_the_text_is_what_prometheus_clients_writer_makes_of_the_same_snapshot(
    nodes: list[NodeRow],
    gpus: list[GpuRow],
    counts: dict[str, int],
    counters: dict[str, int],
    head: int,
    behind: int,
    webhooks: list[WebhookRow],
    lag: float | None,
    unsealed: int,
) -> None:
    snapshot = Snapshot(
        nodes=nodes,
        gpus=gpus,
        accelerator_counts=counts,
        head=head,
        folded=head - behind,
        counters=counters,
        webhooks=webhooks,
        replay_lag=lag,
        unsealed_days=unsealed,
    )
    assert render(snapshot) == reference_text(snapshot)
