"""The history read of a node's stored observations (api/services/reads/telemetry.py: compact
snapshots opened only as far as one GPU or the host, and bucketed without a fact object per value)
gives the very series a plain loop counts from the log's whole decode of the same events: compact
snapshots of both formats and the jsonb events of older releases mixed, rows in any order, GPUs listed twice, names
outside the codebooks, every availability state, the states in the order first seen."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from api.services.reads.telemetry import accelerator_part, host_part, samples_in_window, state_of
from collectors.facts import UNKNOWN, UNSUPPORTED, Fact, Known, TemporarilyFailed, Unavailable
from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
from domain.telemetry_buckets import downsample_columns
from domain.telemetry_history import Bucket, Reading, Series, Window, reading
from ledger.compact import FORMAT_2, FORMAT_3, FORMAT_4, encode_body_of, gpu_set
from ledger.compact_decode import decode_body
from ledger.events import (
    AcceleratorSample,
    AcceleratorTelemetryObserved,
    EventMetadata,
    EventPayload,
    HostTelemetryObserved,
    NodeTelemetryObserved,
)
from tests.compact_format_1 import encode_body_1
from tests.telemetry_support import as_reading, sample_rows

SINCE = datetime(2026, 12, 3, 0, 0, tzinfo=UTC)
NODE = "5d0e7a3c-1b2f-5c4d-8e9a-0f1b2c3d4e5f"
GPUS = ["GPU-0d5e1c3a-9f7b-4c2e-8a61-3b9d2f4e5a70", "GPU-0D5E1C3A-9F7B-4C2E-8A61-3B9D2F4E5A71", "gpu-odd"]

facts: st.SearchStrategy[Fact] = st.one_of(
    st.builds(Known, st.integers(-(2**63), 2**64 - 1)),
    st.builds(Known, st.integers(0, 3)),  # equal values in one bucket
    st.builds(Known, st.floats(-1e12, 1e12, allow_nan=False)),
    # what format 2 stores in units: whole MiB and KiB, watts of whole milliwatts
    st.builds(Known, st.integers(0, 2**40).map(lambda q: q * 1024 * 1024)),
    st.builds(Known, st.integers(0, 2**50).map(lambda q: q * 1024)),
    st.builds(Known, st.integers(0, 10**9).map(lambda m: m / 1000)),
    st.builds(Known, st.sampled_from(["P0", "P8"])),
    st.builds(Known, st.booleans()),
    st.just(UNKNOWN),
    st.just(UNSUPPORTED),
    st.builds(Unavailable, st.sampled_from(["", "no driver"])),
    st.builds(TemporarilyFailed, st.just("timeout")),
)


def groups(metrics: tuple[str, ...]) -> st.SearchStrategy[dict[str, Fact]]:
    # Mostly every metric (a group as stored whole), sometimes a few, sometimes names besides.
    every = st.fixed_dictionaries({m: facts for m in metrics})
    some = st.dictionaries(st.one_of(st.sampled_from(metrics), st.text(max_size=4)), facts, max_size=6)
    return st.one_of(every, some)


entries = st.builds(
    AcceleratorSample,
    accelerator_id=st.just("a"),
    uuid=st.sampled_from(GPUS),
    telemetry=groups(ACCELERATOR_METRICS),
)
snapshots = st.builds(
    NodeTelemetryObserved,
    telemetry=groups(HOST_METRICS),
    storage=st.just([]),
    accelerators=st.lists(entries, max_size=4),
)
per_kind = st.one_of(
    st.builds(
        AcceleratorTelemetryObserved,
        accelerator_id=st.just("a"),
        uuid=st.sampled_from(GPUS),
        telemetry=groups(ACCELERATOR_METRICS),
    ),
    st.builds(HostTelemetryObserved, telemetry=groups(HOST_METRICS), storage=st.just([])),
)
# Observed offsets in s, or None (the received time then): a few shared by many events, so that
# samples tie in time and are counted in log order.
observed_offsets = st.one_of(st.none(), st.integers(-30, 630), st.sampled_from([0, 300]))
# (payload, stored compact?, observed offset in s or None, received offset in s)
events = st.lists(
    st.one_of(
        st.tuples(snapshots, st.booleans(), observed_offsets, st.integers(-30, 630)),
        st.tuples(per_kind, st.just(False), observed_offsets, st.integers(-30, 630)),
    ),
    min_size=1,
    max_size=30,
)
windows = st.builds(
    lambda span, step: Window(since=SINCE, until=SINCE + timedelta(seconds=span), step_seconds=step),
    st.integers(60, 600),
    st.integers(1, 300),
)


# The GPU sets the stored snapshots of formats 3 and 4 name (as `gpu_sets` holds them).
SETS: dict[uuid.UUID, str] = {}


def stored(
    given_events: list[tuple[EventPayload, bool, int | None, int]],
    order: list[int],
    forms: tuple[int, ...] = (FORMAT_4, 1, FORMAT_2, FORMAT_3),
) -> tuple[list[dict[str, Any]], list[tuple[int, EventPayload, EventMetadata]]]:
    """The rows the log's read returns (in `order`, as PostgreSQL may), and each event as the
    log's whole decode gives it back, with its position. A compact snapshot is stored in the
    formats `forms` in turn (1 to 3 as earlier releases stored them, 4 as this one does where the
    snapshot lists each GPU once, else 2)."""
    rows, decoded = [], []
    for position, (payload, compact, observed, received) in enumerate(given_events):
        meta = EventMetadata(
            received_at=SINCE + timedelta(seconds=received, milliseconds=position % 7),
            source="agent",
            observed_at=None
            if observed is None
            else SINCE + timedelta(seconds=observed, microseconds=position % 2),  # ties: log order
        )
        if compact:
            assert isinstance(payload, NodeTelemetryObserved)
            # formats 1 to 3 as earlier releases stored them, 4 as this one does where the
            # snapshot lists each GPU once (else 2)
            gpus = gpu_set(payload)
            form = forms[position % len(forms)]
            body = (
                encode_body_1(payload, meta)
                if form == 1
                else encode_body_of(form, payload, meta, NODE, gpus if gpus.storable else None)[0]
            )
            named = body[1] in (FORMAT_3, FORMAT_4)
            if named:
                SETS[gpus.sampled] = gpus.joined
            row = {
                "global_position": position,
                "body": body,
                "data_json": None,
                "metadata_json": None,
                "gpu_set_id": gpus.sampled if named else None,
                "received_at": meta.received_at,
            }
            decoded.append((position, *decode_body(body, NODE, gpus.joined if named else None)))
        else:
            data, metadata = msgspec.json.encode(payload).decode(), msgspec.json.encode(meta).decode()
            row = {
                "global_position": position,
                "body": None,
                "data_json": data,
                "metadata_json": metadata,
                "gpu_set_id": None,
                "received_at": meta.received_at,
            }
            decoded.append((position, payload, meta))
        rows.append(row)
    return [rows[i] for i in order], decoded


def counted(
    w: Window,
    decoded: list[tuple[int, EventPayload, EventMetadata]],
    gpu: str | None,
    metrics: tuple[str, ...],
) -> tuple[list[tuple[datetime, list[Reading | None]]], list[Series]]:
    """The samples in the order a plain loop counts them (time, then log order), each with its
    readings of the metrics, and the series it counts: each fact read whole, one at a time."""
    samples: list[tuple[datetime, int, dict[str, Fact]]] = []
    for position, payload, meta in decoded:
        at = meta.observed_at or meta.received_at
        facts: dict[str, Fact] | None = None
        if gpu is None:
            if isinstance(payload, NodeTelemetryObserved | HostTelemetryObserved):
                facts = payload.telemetry
        elif isinstance(payload, NodeTelemetryObserved):
            for a in payload.accelerators:
                if a.uuid == gpu:
                    facts = a.telemetry
        elif isinstance(payload, AcceleratorTelemetryObserved) and payload.uuid == gpu:
            facts = payload.telemetry
        if facts is not None and w.since <= at < w.until:
            samples.append((at, position, facts))
    samples.sort(key=lambda s: (s[0], s[1]))
    step = timedelta(seconds=w.step_seconds)
    series = []
    for metric in metrics:
        points = []
        for i in range(w.points):
            start = w.since + i * step
            states: dict[str, int] = {}
            numbers: list[float] = []
            for at, _, facts in samples:
                if start <= at < start + step and metric in facts:
                    state, number = reading(facts[metric])
                    states[state] = states.get(state, 0) + 1
                    if number is not None:
                        numbers.append(number)
            low = min(numbers) if numbers else None
            high = max(numbers) if numbers else None
            mean = (
                min(max(math.fsum(numbers) / len(numbers), min(numbers)), max(numbers)) if numbers else None
            )
            points.append(Bucket(start, sum(states.values()), states, low, mean, high))
        series.append(Series(metric=metric, points=points))
    ordered = [(at, [reading(f[m]) if m in f else None for m in metrics]) for at, _, f in samples]
    return ordered, series


@settings(max_examples=150, deadline=None)
@given(events, windows, st.randoms(use_true_random=False), st.sampled_from([*GPUS, None]), st.data())
def test_the_read_counts_what_the_whole_decode_says(
    given_events: list[tuple[EventPayload, bool, int | None, int]],
    w: Window,
    rnd: Any,
    gpu: str | None,
    data: st.DataObject,
) -> None:
    order = list(range(len(given_events)))
    rnd.shuffle(order)
    rows, decoded = stored(given_events, order)
    # the log read in parts, as a long window is and as a read decodes its rows (a slice at a
    # time), or whole
    cuts = sorted(data.draw(st.lists(st.integers(0, len(rows)), max_size=3)))
    pieces = [rows[a:b] for a, b in zip([0, *cuts], [*cuts, len(rows)], strict=True)]
    if gpu is None:
        metrics, parts = HOST_METRICS, [host_part(piece, HOST_METRICS) for piece in pieces]
    else:
        metrics = ACCELERATOR_METRICS
        parts = [accelerator_part(piece, gpu, ACCELERATOR_METRICS, SETS) for piece in pieces]
    samples = samples_in_window(w, parts)
    series = downsample_columns(w, samples, metrics, state_of)
    ordered, expected = counted(w, decoded, gpu, metrics)
    got = [(at, [as_reading(v) for v in values]) for at, values in sample_rows(samples)]
    assert got == ordered
    # compared as the JSON a client reads: the states' order too
    assert msgspec.json.encode(series) == msgspec.json.encode(expected)


def test_samples_observed_at_one_moment_are_counted_in_log_order_whatever_the_parts() -> None:
    def snapshot(temperature: int) -> NodeTelemetryObserved:
        gpu = AcceleratorSample("a", GPUS[0], {"temperature_celsius": Known(temperature)})
        return NodeTelemetryObserved(telemetry={}, storage=[], accelerators=[gpu])

    given: list[tuple[EventPayload, bool, int | None, int]] = [(snapshot(t), True, 0, 0) for t in range(4)]
    w = Window(since=SINCE, until=SINCE + timedelta(seconds=60), step_seconds=60)
    for order in ([3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 0, 1]):
        rows, decoded = stored(given, order)
        ordered, _ = counted(w, decoded, GPUS[0], ACCELERATOR_METRICS)
        for cut in range(len(rows) + 1):
            parts = [
                accelerator_part(part, GPUS[0], ACCELERATOR_METRICS, SETS)
                for part in (rows[:cut], rows[cut:])
            ]
            samples = samples_in_window(w, parts)
            got = [(at, [as_reading(v) for v in values]) for at, values in sample_rows(samples)]
            assert got == ordered, (order, cut)
