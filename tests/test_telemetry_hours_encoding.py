"""Telemetry hours' encoding (ledger/telemetry_hours.py), pure: a closed hour stored as columns gives
a history read exactly what decoding its snapshots gives, whole or cut by receive time as the
log's search cuts it; every column and packed run of ints comes back exactly."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.services.reads.telemetry import (
    accelerator_part,
    host_part,
    samples_in_window,
    stored_part,
)
from collectors.facts import Known
from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
from domain.telemetry_history import Window
from ledger import telemetry_hours
from ledger.compact import FORMAT_2, FORMAT_3, FORMAT_4, encode_body_of, gpu_set
from ledger.events import (
    AcceleratorSample,
    EventMetadata,
    EventPayload,
    NodeTelemetryObserved,
)
from ledger.telemetry_hours import (
    HourRow,
    StoredHour,
    decode_column,
    encode_column,
    gpu_samples,
    host_samples,
    pack_ints,
    stored_hour,
    unpack_ints,
)
from runtime.micros import micros
from tests.telemetry_support import exactly
from tests.test_telemetry_history_reads import (
    GPUS,
    NODE,
    SETS,
    SINCE,
    events,
    groups,
    observed_offsets,
    stored,
)

EXACT = msgspec.msgpack.Encoder()
# Hours of compact snapshots only, each listing GPUs of UUIDs a GPU set stores, each once: with
# formats 3 and 4 alone, hours a telemetry hour stores with their values.
compact_events = st.lists(
    st.tuples(
        st.builds(
            NodeTelemetryObserved,
            telemetry=groups(HOST_METRICS),
            storage=st.just([]),
            accelerators=st.lists(
                st.builds(
                    AcceleratorSample,
                    accelerator_id=st.just("a"),
                    uuid=st.sampled_from(GPUS[:2]),  # UUIDs a GPU set stores
                    telemetry=groups(ACCELERATOR_METRICS),
                ),
                min_size=1,
                max_size=2,
                unique_by=lambda e: e.uuid,
            ),
        ),
        st.just(True),
        observed_offsets,
        st.integers(-30, 630),
    ),
    min_size=1,
    max_size=30,
)


def _type_name(payload: EventPayload) -> str:
    tag = type(payload).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(events, compact_events),
    st.sampled_from([(FORMAT_4, FORMAT_3), (FORMAT_4, FORMAT_3, FORMAT_2), (FORMAT_4, 1)]),
    st.sampled_from([*GPUS, None]),
    st.integers(-40, 640),
    st.integers(0, 700),
    st.booleans(),
)
def test_a_stored_hour_reads_back_what_its_snapshots_decode_to(
    given_events: list[tuple[EventPayload, bool, int | None, int]],
    forms: tuple[int, ...],
    gpu: str | None,
    start: int,
    span: int,
    on_rows: bool,
) -> None:
    """Whole, and cut to the samples received in [low, high) as the log's search is (a window's
    padded start inside the hour), the cut's ends anywhere or on rows' receive times. `forms`:
    the compact snapshots' formats in turn (an hour holding one before 3 is left to the log)."""
    rows, _decoded = stored(given_events, list(range(len(given_events))), forms)
    hour_rows = [
        HourRow(r["global_position"], _type_name(p), r["body"], r["gpu_set_id"], r["received_at"])
        for r, (p, _c, _o, _r) in zip(rows, given_events, strict=True)
    ]
    hour = stored_hour(hour_rows, SETS, ACCELERATOR_METRICS, HOST_METRICS)
    assert hour.observations == len(rows)
    plain = all(r.body is not None and r.body[1] in (FORMAT_3, FORMAT_4) for r in hour_rows)
    if not plain:
        assert hour.common is None and not hour.gpus  # read from the log
        return
    assert hour.common is not None
    low, high = SINCE + timedelta(seconds=start), SINCE + timedelta(seconds=start + span)
    if on_rows:
        low, high = rows[start % len(rows)]["received_at"], rows[span % len(rows)]["received_at"]
    searched = [r for r in rows if low <= r["received_at"] < high]
    if gpu is None:
        expected, cut = host_part(rows, HOST_METRICS), host_part(searched, HOST_METRICS)
        got = host_samples(hour.common)
    else:
        expected = accelerator_part(rows, gpu, ACCELERATOR_METRICS, SETS)
        cut = accelerator_part(searched, gpu, ACCELERATOR_METRICS, SETS)
        got = gpu_samples(hour.common, hour.gpus.get(gpu))
    w = Window(since=SINCE - timedelta(days=1), until=SINCE + timedelta(days=1), step_seconds=3600)
    want, have = samples_in_window(w, [expected]), samples_in_window(w, [stored_part(got)])
    assert len(have.times) == len(want.times) and exactly(have) == exactly(want)
    want, have = samples_in_window(w, [cut]), samples_in_window(w, [stored_part(got.received_in(low, high))])
    assert len(have.times) == len(want.times) and exactly(have) == exactly(want)


def _hour_of(snapshots: list[NodeTelemetryObserved]) -> tuple[list[dict[str, Any]], StoredHour]:
    """The snapshots as the log's rows (format 4, one every 10 s from SINCE, observed when
    received) and the telemetry hour stored from them."""
    rows: list[dict[str, Any]] = []
    for i, payload in enumerate(snapshots):
        at = SINCE + timedelta(seconds=10 * i)
        gpus = gpu_set(payload)
        SETS[gpus.sampled] = gpus.joined
        body = encode_body_of(FORMAT_4, payload, EventMetadata(received_at=at, source="agent"), NODE, gpus)[0]
        rows.append({"global_position": i, "body": body, "gpu_set_id": gpus.sampled, "received_at": at})
    hour_rows = [
        HourRow(r["global_position"], "NODE_TELEMETRY_OBSERVED", r["body"], r["gpu_set_id"], r["received_at"])
        for r in rows
    ]
    hour = stored_hour(hour_rows, SETS, ACCELERATOR_METRICS, HOST_METRICS)
    assert hour.common is not None
    return rows, hour


def test_an_hour_of_numbers_stored_verbatim_reads_back_as_numbers_as_the_log_does() -> None:
    """Utilization of no whole thousandth and a mix of ints and floats are stored verbatim; the
    read counts them as the numbers the log's decode gives, not as values one by one."""
    snapshots = []
    for i in range(12):
        gpu = {
            "utilization_gpu_percent": Known(100 / 3 + i),
            "power_watts": Known(250 if i % 2 else 250.5),
            "temperature_celsius": Known(40 + i),
        }
        snapshots.append(
            NodeTelemetryObserved(
                telemetry={}, storage=[], accelerators=[AcceleratorSample("a", GPUS[0], gpu)]
            )
        )
    rows, hour = _hour_of(snapshots)
    w = Window(since=SINCE - timedelta(days=1), until=SINCE + timedelta(days=1), step_seconds=3600)
    want = samples_in_window(w, [accelerator_part(rows, GPUS[0], ACCELERATOR_METRICS, SETS)])
    have = samples_in_window(w, [stored_part(gpu_samples(hour.common, hour.gpus[GPUS[0]]))])
    assert len(have.times) == 12 and exactly(have) == exactly(want)
    for metric in ("utilization_gpu_percent", "power_watts", "temperature_celsius"):
        assert isinstance(have.columns[ACCELERATOR_METRICS.index(metric)], np.ndarray), metric


def test_a_gpu_in_some_snapshots_of_the_hour_is_cut_by_its_own_receive_times() -> None:
    """GPU 0 in snapshots 0, 2 and 4 of six: cut to the snapshots received from the third on, it
    keeps snapshots 2 and 4, each with its own time and value."""
    snapshots = [
        NodeTelemetryObserved(
            telemetry={},
            storage=[],
            accelerators=[
                AcceleratorSample("a", u, {"temperature_celsius": Known(40 + i)})
                for u in ([GPUS[1]] if i % 2 else [GPUS[0], GPUS[1]])
            ],
        )
        for i in range(6)
    ]
    rows, hour = _hour_of(snapshots)
    whole = gpu_samples(hour.common, hour.gpus[GPUS[0]])
    cut = whole.received_in(SINCE + timedelta(seconds=20), SINCE + timedelta(hours=1))
    temperature = ACCELERATOR_METRICS.index("temperature_celsius")
    assert whole.positions.tolist() == [0, 2, 4] and cut.positions.tolist() == [2, 4]
    assert cut.columns[temperature].tolist() == [42.0, 44.0]  # type: ignore[union-attr]
    received = [micros(r["received_at"]) for r in rows[2::2]]
    assert cut.received.tolist() == cut.times.tolist() == received  # observed when received


def test_columns_keep_every_value_exactly() -> None:
    numbers: list[list[Any]] = [
        [10, 12, 9, 9, 2**61, -(2**61)],
        [691.8, 692.216, 0.001, 1e12],
        [-127, 128, -32768, 32768, 2**31, -(2**31) - 1],  # every width of the differences
        [7],
    ]
    for column in numbers:
        encoded = encode_column(column)
        assert encoded[0] in (telemetry_hours.INTS, telemetry_hours.THOUSANDTHS), column
        back = decode_column(msgspec.msgpack.decode(EXACT.encode(encoded)))
        assert isinstance(back, np.ndarray) and back.dtype == np.float64
        assert back.tolist() == [float(v) for v in column], column
    verbatim: list[list[Any]] = [
        [0.0, -0.0, 1.5],  # -0.0 is not a thousandth's 0
        [0.1 + 0.2, 1.0],  # 0.30000000000000004 is no whole thousandth
        [math.inf, 1.0],
        [2**63, 1],  # beyond the differences' range
        [2.0**60 + 2**12],  # thousandths beyond a float's whole numbers
        [1, 2.5, None, [2], "P0", True],
        [True, False],
        [],
    ]
    for column in verbatim:
        encoded = encode_column(column)
        assert encoded[0] == telemetry_hours.VERBATIM, column
        back = decode_column(msgspec.msgpack.decode(EXACT.encode(encoded)))
        # msgpack tells an int from a float and 0.0 from -0.0: exactly the values given
        assert EXACT.encode(back) == EXACT.encode(column), column
    repeated: list[list[Any]] = [
        ["P0"] * 3,
        [None, None],
        [[2, "no fan"]] * 4,
        [math.inf] * 2,
        [math.nan] * 2,
    ]
    for column in repeated:
        encoded = encode_column(column)
        assert encoded[0] == telemetry_hours.REPEATED, column
        back = decode_column(msgspec.msgpack.decode(EXACT.encode(encoded)))
        assert EXACT.encode(back) == EXACT.encode(column), column
    for unlike in ([1, True], [0.0, -0.0], ["P0", "P0", "P8"]):
        assert encode_column(unlike)[0] == telemetry_hours.VERBATIM, unlike
    assert encode_column([100, 101, 101])[0] == telemetry_hours.INTS
    assert encode_column([691.8, 691.9])[0] == telemetry_hours.THOUSANDTHS


def test_packed_ints_take_the_narrowest_width_and_come_back() -> None:
    cases = (
        ([5, 6, -100], 1),
        ([2**40, 2**40 + 300], 2),  # the first in full, whatever the differences' width
        ([10**6, 0], 4),
        ([2**61, -(2**61)], 8),
        ([7], 1),
    )
    for values, width in cases:
        packed = pack_ints(values)
        assert packed[0] == width and len(packed) == 1 + 8 + width * (len(values) - 1), values
        assert unpack_ints(packed).tolist() == values
    assert unpack_ints(pack_ints([])).tolist() == []
    with pytest.raises(telemetry_hours.UndecodableBody):
        unpack_ints(bytes([3, 0, 0, 0]))
    with pytest.raises(telemetry_hours.UndecodableBody):
        unpack_ints(bytes([2, 0, 0, 0]))
    with pytest.raises(telemetry_hours.UndecodableBody):
        unpack_ints(bytes([2]) + bytes(8) + bytes(3))
