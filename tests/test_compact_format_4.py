"""Format 4 of the compact bodies: each GPU after the first refers to the values and the health it
shares with the first (ledger/compact.py), read back exactly by the whole decode and by a history."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest

from collectors.facts import Known
from ledger.compact import (
    ENCODER,
    FORMAT_3,
    FORMAT_4,
    GPU_TELEMETRY_1,
    Dense,
    UndecodableBody,
    encode_body,
    encode_body_of,
    gpu_set,
)
from ledger.compact import health as dense_health
from ledger.compact_decode import decode_body
from ledger.compact_views import gpu_values
from ledger.events import EventMetadata, NodeTelemetryObserved
from tests.builders import signals
from tests.telemetry_support import as_reading
from tests.test_compact import NODE, as_json, expected_values, reported, rows, stored_in


def test_a_steady_report_of_format_4_stores_what_its_gpus_share_with_the_first_once() -> None:
    payload, meta = reported()
    gpus = gpu_set(payload)
    body, _, _ = encode_body(payload, meta, NODE, gpus)
    format_3, _, _ = encode_body_of(FORMAT_3, payload, meta, NODE, gpus)
    assert body[1] == FORMAT_4 and decode_body(body, NODE, gpus.joined) == (payload, meta)
    # per GPU after the first: what it shares with the first from its power on (power 5 bytes,
    # the fan 2, three clocks 3 each, the memory total 5, the performance state 3) as one byte
    assert len(format_3) - len(body) == 7 * (5 + 2 + 3 * 3 + 5 + 3 - 1), (len(body), len(format_3))
    # the same health signals on every GPU: stored once
    with_health = msgspec.structs.replace(
        payload, accelerators=[msgspec.structs.replace(a, health=signals()) for a in payload.accelerators]
    )
    healthy, _, _ = encode_body(with_health, meta, NODE, gpus)
    healthy_3, _, _ = encode_body_of(FORMAT_3, with_health, meta, NODE, gpus)
    assert decode_body(healthy, NODE, gpus.joined) == (with_health, meta)
    # the first GPU's health whole, each other GPU's as a one-byte reference
    assert len(healthy) - len(body) == len(ENCODER.encode(dense_health(signals()))) + 7
    assert len(healthy_3) > len(healthy) + 7 * 30


@pytest.mark.parametrize(
    ("first", "other"),
    [(0.0, -0.0), (-0.0, 0.0), (1, True), (True, 1), (1, 1.0), (1.0, 1), (2619, 2619.0)],
    ids=repr,
)
def test_a_value_equal_to_the_first_gpus_but_stored_otherwise_is_not_taken_for_it(
    first: object, other: object
) -> None:
    # Format 4 refers to the first GPU's values only where they are stored alike: 0.0 and -0.0,
    # 1, True and 1.0 compare equal in Python, and each comes back as it was reported.
    payload, meta = reported(3)
    accelerators = [
        msgspec.structs.replace(a, telemetry={**a.telemetry, "clock_memory_mhz": Known(value)})
        for a, value in zip(payload.accelerators, (first, other, first), strict=True)
    ]
    payload = msgspec.structs.replace(payload, accelerators=accelerators)
    gpus = gpu_set(payload)
    body, _, _ = encode_body(payload, meta, NODE, gpus)
    decoded = decode_body(body, NODE, gpus.joined)
    assert decoded == (payload, meta)
    assert as_json(decoded) == as_json((payload, meta))
    got = [a.telemetry["clock_memory_mhz"] for a in decoded[0].accelerators]
    assert [(type(f.value), repr(f.value)) for f in got if isinstance(f, Known)] == [
        (type(v), repr(v)) for v in (first, other, first)
    ]


@pytest.mark.parametrize("day", ["one index", "one missing", "one moved"])
def test_a_gpu_after_the_first_reads_the_values_it_shares_with_the_first_on_any_day(day: str) -> None:
    # A steady day of format 4: each GPU after the first stores what it shares with the first as
    # a reference. Its history reads the first GPU's values there, whether the day is read at one
    # index or snapshot by snapshot (the GPU left out of one, or listed at another index).
    payload, meta = reported()
    events: list[tuple[NodeTelemetryObserved, EventMetadata, int]] = []
    for k in range(6):
        accelerators = list(payload.accelerators)
        if k == 2 and day == "one missing":
            del accelerators[5]
        elif k == 2 and day == "one moved":
            accelerators.insert(1, accelerators.pop(5))
        at = meta.received_at + timedelta(seconds=10 * k)
        events.append(
            (
                msgspec.structs.replace(payload, accelerators=accelerators),
                msgspec.structs.replace(meta, received_at=at, observed_at=at),
                FORMAT_4,
            )
        )
    bodies, sets = stored_in(events, NODE)
    assert all(body[1] == FORMAT_4 for body in bodies)
    decoded = [decode_body(b, NODE, s) for b, s in zip(bodies, sets, strict=True)]
    gpu = payload.accelerators[5].uuid
    names = list(GPU_TELEMETRY_1)
    got = [
        (i, at, [as_reading(v) for v in values])
        for i, at, values in rows(gpu_values(bodies, gpu, names, sets))
    ]
    assert got == expected_values(decoded, gpu, names)
    assert len(got) == (5 if day == "one missing" else 6)
    # the shared values read as the GPU's: its power, as every GPU of the steady snapshot has it
    assert {values[names.index("power_watts")] for _, _, values in got} == {as_reading(412.518)}


@pytest.mark.parametrize(
    "entries",
    [
        [[0, [[]]], [1, [1]]],  # the first GPU refers to itself
        [[0, [1]], [1, [1, 2, []]]],  # to values past the first's
        [[0, [1, 2]], [1, [[], 2]]],  # a reference before the end
        [[0, [1]], [1, [1], []]],  # to health the first lacks
    ],
    ids=["first", "past the first's values", "not last", "health"],
)
def test_a_body_of_format_4_with_a_reference_to_nothing_is_refused_by_name(entries: list[Dense]) -> None:
    payload, meta = reported(2)
    gpus = gpu_set(payload)
    body = encode_body(payload, meta, NODE, gpus)[0]
    doc = msgspec.msgpack.decode(body)
    doc[2][2] = entries
    with pytest.raises(UndecodableBody):
        decode_body(ENCODER.encode(doc), NODE, gpus.joined)
