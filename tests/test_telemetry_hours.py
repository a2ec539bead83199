"""Telemetry hours over PostgreSQL (ledger/telemetry_hours.py): a read uses an hour only while the
log still holds the rows it was stored from, and answers what the log answers; the server's pass
stores the newest hours first and forgets those retention no longer keeps."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.services.reads import telemetry
from api.services.reads.telemetry import (
    TelemetryReads,
)
from api.wiring import event_store
from collectors.facts import UNSUPPORTED, Known
from collectors.observations import ACCELERATOR_METRICS, HOST_METRICS
from domain.telemetry_history import Window, window
from ledger import telemetry_hours
from ledger.events import (
    AcceleratorSample,
    AcceleratorTelemetryObserved,
    HostTelemetryObserved,
    NodeTelemetryObserved,
)
from ledger.telemetry_hours import (
    HoursPass,
    store_due,
)
from tests.loop_support import OtherWork
from tests.telemetry_support import observed_event

HOUR0 = datetime(2026, 11, 29, 6, 0, tzinfo=UTC)


def _snapshot(accelerator_id: str, uuid: str, minute: int) -> NodeTelemetryObserved:
    gpu = {
        "temperature_celsius": Known(40 + minute % 7),
        "power_watts": Known(100.5 + minute / 1000),
        "memory_used_bytes": Known(2**33 + minute * 2**20),
        "fan_speed_percent": UNSUPPORTED,
    }
    host = {"memory_available_bytes": Known(1000 + minute), "memory_total_bytes": Known(4096)}
    return NodeTelemetryObserved(
        telemetry=host, storage=[], accelerators=[AcceleratorSample(accelerator_id, uuid, gpu)]
    )


async def _seeded(make_api: Any) -> tuple[Any, str, dict[str, Any]]:
    """Four hours of one snapshot a minute from HOUR0, the third hour's last minute as the
    per-kind events of an older release."""
    api = make_api()
    await api.refresh()
    node_id = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]["id"]
    acc = (await api.get("/api/v1/hardware/accelerators")).json()["items"][0]
    out = []
    for minute in range(4 * 60):
        at = HOUR0 + timedelta(minutes=minute)
        if minute == 179:
            out.append(observed_event(HostTelemetryObserved(telemetry={}, storage=[]), at))
            out.append(observed_event(AcceleratorTelemetryObserved(acc["id"], acc["uuid"], {}), at))
        else:
            out.append(observed_event(_snapshot(acc["id"], acc["uuid"], minute), at))
    await event_store(api.pool).append(node_id, None, out)
    return api, node_id, acc


async def _store(
    api: Any,
    now: datetime,
    memory: HoursPass | None = None,
    keep: timedelta = timedelta(days=30),
    budget: float = 60.0,
) -> int:
    """A pass of the server's at `now` (with a memory of its own unless given one)."""
    return await store_due(
        api.pool,
        memory or HoursPass(),
        keep=keep,
        gpu_metrics=ACCELERATOR_METRICS,
        host_metrics=HOST_METRICS,
        now=now,
        budget=budget,
    )


async def _both(api: Any, acc: dict[str, Any], node_id: str, w: Window) -> tuple[Any, Any]:
    reads = TelemetryReads(api.pool)
    return await reads.accelerator(acc["id"], w), await reads.node(node_id, w)


def _log_decodes(monkeypatch: Any) -> list[int]:
    """The rows each read decodes from the log from now on, one count per decoding."""
    counts: list[int] = []
    in_slices = telemetry.in_slices

    async def counting(rows: Any, *a: Any) -> Any:
        counts.append(len(rows))
        return await in_slices(rows, *a)

    monkeypatch.setattr(telemetry, "in_slices", counting)
    return counts


async def test_a_read_of_stored_hours_is_the_read_of_the_log(make_api: Any, monkeypatch: Any) -> None:
    api, node_id, acc = await _seeded(make_api)
    w = window(HOUR0 - timedelta(minutes=20), HOUR0 + timedelta(hours=4), 60)
    from_log = await _both(api, acc, node_id, w)
    assert from_log[0].samples == 240  # 239 snapshots and one per-kind sample

    # The hours that ended GRACE before `now`, the newest first; the open one is not stored.
    assert await _store(api, HOUR0 + timedelta(hours=3, minutes=1)) == 2
    stored = await api.pool.fetch(
        "SELECT hour, subject, body IS NULL AS from_log FROM telemetry_hours WHERE node_id = $1 "
        "ORDER BY hour, subject",
        node_id,
    )
    assert [(r["hour"], r["subject"], r["from_log"]) for r in stored] == [
        (HOUR0, "", False),
        (HOUR0, acc["uuid"], False),
        (HOUR0 + timedelta(hours=1), "", False),
        (HOUR0 + timedelta(hours=1), acc["uuid"], False),
    ]
    assert await _store(api, HOUR0 + timedelta(hours=5)) == 2
    # the hour holding an older release's per-kind events is stored without a body
    assert await api.pool.fetchval(
        "SELECT body IS NULL FROM telemetry_hours WHERE node_id = $1 AND hour = $2 AND subject = ''",
        node_id,
        HOUR0 + timedelta(hours=2),
    )

    decoded_from_log = _log_decodes(monkeypatch)
    from_hours = await _both(api, acc, node_id, w)
    assert from_hours == from_log
    # Of the log, each read decoded only the hour stored without a body (its 59 snapshots and the
    # per-kind event of its subject), not the 240 rows of the four hours.
    assert decoded_from_log == [60, 60]


async def test_an_hour_straddling_the_searched_start_is_read_from_its_columns_as_the_log_is(
    make_api: Any, monkeypatch: Any
) -> None:
    """A window's padded start inside a stored hour: that hour comes from its columns, and a sample
    received before the start (its agent's clock more than an hour ahead) is left out there as the
    log's search leaves it out."""
    api, node_id, acc = await _seeded(make_api)
    ahead = _snapshot(acc["id"], acc["uuid"], 7)
    early = observed_event(ahead, HOUR0 + timedelta(minutes=100), HOUR0 + timedelta(minutes=10))
    await event_store(api.pool).append(node_id, None, [early])
    w = window(HOUR0 + timedelta(minutes=90), HOUR0 + timedelta(hours=4), 300)  # searched from minute 30
    from_log = await _both(api, acc, node_id, w)
    assert from_log[0].samples == 150  # minutes 90-239; the early one not searched for
    assert await _store(api, HOUR0 + timedelta(hours=5)) == 4
    decoded_from_log = _log_decodes(monkeypatch)
    assert await _both(api, acc, node_id, w) == from_log
    # only the hour stored without a body (the per-kind events') is decoded from the log
    assert decoded_from_log == [60, 60]


async def test_a_report_committed_into_a_stored_hour_is_still_counted(make_api: Any) -> None:
    api, node_id, acc = await _seeded(make_api)
    await _store(api, HOUR0 + timedelta(hours=5))
    w = window(HOUR0, HOUR0 + timedelta(hours=4), 300)
    before = await _both(api, acc, node_id, w)
    # received inside the first stored hour (a commit after the hour was stored)
    late = HOUR0 + timedelta(minutes=30, seconds=30)
    await event_store(api.pool).append(
        node_id, None, [observed_event(_snapshot(acc["id"], acc["uuid"], 999), late)]
    )
    telemetry_hours.STALE.clear()
    after = await _both(api, acc, node_id, w)
    assert after[0].samples == before[0].samples + 1
    assert after[1].samples == before[1].samples + 1
    assert (node_id, HOUR0) in telemetry_hours.STALE
    # the next pass stores that hour again, and the read takes it from there
    assert await _store(api, HOUR0 + timedelta(hours=5)) == 1
    assert not telemetry_hours.STALE
    await api.pool.execute("DELETE FROM telemetry_hours")
    assert await _both(api, acc, node_id, w) == after


async def test_hours_retention_no_longer_keeps_are_removed(make_api: Any) -> None:
    api, node_id, _acc = await _seeded(make_api)
    memory = HoursPass()
    stored = await _store(api, HOUR0 + timedelta(hours=5), memory, keep=timedelta(hours=3))
    # hours HOUR0+2 and HOUR0+3 are within three hours of HOUR0+5 (floor); HOUR0+1 is not
    assert stored == 2
    assert {r["hour"] for r in await api.pool.fetch("SELECT hour FROM telemetry_hours")} == {
        HOUR0 + timedelta(hours=2),
        HOUR0 + timedelta(hours=3),
    }
    await _store(api, HOUR0 + timedelta(hours=5), memory, keep=timedelta(hours=1))
    assert {r["hour"] for r in await api.pool.fetch("SELECT hour FROM telemetry_hours")} == set()
    del node_id


async def test_two_servers_storing_one_hour_take_turns(make_api: Any) -> None:
    api, node_id, acc = await _seeded(make_api)
    stored = await asyncio.gather(
        *(
            telemetry_hours.store_hour(api.pool, node_id, HOUR0, ACCELERATOR_METRICS, HOST_METRICS)
            for _ in range(4)
        )
    )
    assert len({s.observations for s in stored}) == 1
    rows = await api.pool.fetch(
        "SELECT subject FROM telemetry_hours WHERE node_id = $1 AND hour = $2 ORDER BY subject",
        node_id,
        HOUR0,
    )
    assert [r["subject"] for r in rows] == ["", acc["uuid"]]


async def test_storing_an_hour_lets_the_event_loop_run(make_api: Any, monkeypatch: Any) -> None:
    """An eight-GPU node-hour is tens of milliseconds of CPU: the reports and requests the same
    event loop serves go on while it is made (made slow here; the other work's turns counted as
    the making starts and ends)."""
    api, node_id, _acc = await _seeded(make_api)
    made = telemetry_hours.stored_hour
    turns: list[int] = []

    async with OtherWork() as other:

        def slow(*a: Any) -> Any:
            turns.append(other.turns)
            until = time.perf_counter() + 0.3
            while time.perf_counter() < until:
                pass
            turns.append(other.turns)
            return made(*a)

        monkeypatch.setattr(telemetry_hours, "stored_hour", slow)
        await telemetry_hours.store_hour(api.pool, node_id, HOUR0, ACCELERATOR_METRICS, HOST_METRICS)
    assert turns[1] - turns[0] >= 10, turns


async def test_a_pass_stops_at_its_budget_and_the_next_goes_on_newest_first(make_api: Any) -> None:
    api, _node_id, _acc = await _seeded(make_api)
    memory = HoursPass()
    order = []
    for _ in range(5):
        stored = await _store(api, HOUR0 + timedelta(hours=5), memory, budget=1e-9)  # one hour spends it
        hours = {r["hour"] for r in await api.pool.fetch("SELECT hour FROM telemetry_hours")}
        order.append((stored, len(hours), min(hours)))
    h = [HOUR0 + timedelta(hours=k) for k in range(4)]
    assert order == [(1, 1, h[3]), (1, 2, h[2]), (1, 3, h[1]), (1, 4, h[0]), (0, 4, h[0])]


async def test_a_stored_hour_that_does_not_decode_is_read_from_the_log(make_api: Any) -> None:
    api, node_id, acc = await _seeded(make_api)
    w = window(HOUR0, HOUR0 + timedelta(hours=4), 300)
    from_log = await _both(api, acc, node_id, w)
    await _store(api, HOUR0 + timedelta(hours=5))
    await api.pool.execute(
        "UPDATE telemetry_hours SET body = '\\xc1ff'::bytea WHERE hour = $1 AND subject = $2",
        HOUR0,
        acc["uuid"],
    )
    await api.pool.execute(
        "UPDATE telemetry_hours SET body = '\\x93'::bytea WHERE hour = $1 AND subject = ''",
        HOUR0 + timedelta(hours=1),
    )
    telemetry_hours.STALE.clear()
    assert await _both(api, acc, node_id, w) == from_log
    assert {(node_id, HOUR0), (node_id, HOUR0 + timedelta(hours=1))} <= telemetry_hours.STALE
    await _store(api, HOUR0 + timedelta(hours=5))  # made again from the log
    assert not telemetry_hours.STALE
    assert await _both(api, acc, node_id, w) == from_log


async def test_hours_of_another_encoding_are_read_from_the_log_and_stored_again(
    make_api: Any, monkeypatch: Any
) -> None:
    """After an upgrade that changes the hours' encoding the rows of the release before are not
    read (the answer is the log's), and the server's next pass stores every hour again."""
    api, node_id, acc = await _seeded(make_api)
    w = window(HOUR0, HOUR0 + timedelta(hours=4), 300)
    from_log = await _both(api, acc, node_id, w)
    assert await _store(api, HOUR0 + timedelta(hours=5)) == 4
    await api.pool.execute(
        "UPDATE telemetry_hours SET format = $1, body = CASE WHEN body IS NULL THEN NULL ELSE '\\x00'::bytea END",
        telemetry_hours.FORMAT - 1,
    )
    decoded_from_log = _log_decodes(monkeypatch)
    assert await _both(api, acc, node_id, w) == from_log
    assert decoded_from_log == [240, 240]  # every row of the window, for the GPU and the host
    assert await _store(api, HOUR0 + timedelta(hours=5)) == 4
    formats = await api.pool.fetch("SELECT DISTINCT format FROM telemetry_hours WHERE node_id = $1", node_id)
    assert [r["format"] for r in formats] == [telemetry_hours.FORMAT]
    decoded_from_log.clear()
    assert await _both(api, acc, node_id, w) == from_log
    assert decoded_from_log == [60, 60]  # the hour stored without a body only


async def test_metrics_count_the_hours_stored_and_the_passes_cut_short(make_api: Any) -> None:
    api, _node_id, _acc = await _seeded(make_api)

    async def counted() -> tuple[float, float]:
        families = {f.name: f for f in text_string_to_metric_families((await api.get("/metrics")).text)}
        return (
            families["modelforge_telemetry_columns_stored"].samples[0].value,
            families["modelforge_telemetry_columns_short_passes"].samples[0].value,
        )

    assert await counted() == (0, 0)
    memory = api.context.telemetry_hours  # the server's passes keep their counts here
    await _store(api, HOUR0 + timedelta(hours=5), memory, budget=1e-9)  # one hour, then cut short
    assert await counted() == (1, 1)
    await _store(api, HOUR0 + timedelta(hours=5), memory)  # the other three, every hour looked at
    assert await counted() == (4, 1)


@pytest.mark.parametrize("page", [1, 2, 3, 64])
async def test_a_pass_stores_every_due_node_whatever_the_page_of_nodes(
    make_api: Any, monkeypatch: Any, page: int
) -> None:
    """Three nodes with two closed hours each, the nodes due asked for `page` at a time."""
    nodes: list[str] = []
    for k in range(3):
        api = make_api(node_id=f"hours-node-{k}")
        await api.refresh()
        node_id = next(
            n["id"] for n in (await api.get("/api/v1/hardware/nodes")).json()["items"] if n["id"] not in nodes
        )
        nodes.append(node_id)
        acc = (await api.get("/api/v1/hardware/accelerators", params={"node_id": node_id})).json()["items"][0]
        await event_store(api.pool).append(
            node_id,
            None,
            [
                observed_event(_snapshot(acc["id"], acc["uuid"], m), HOUR0 + timedelta(minutes=m))
                for m in range(0, 120, 7)
            ],
        )
    monkeypatch.setattr(telemetry_hours, "DUE_PAGE", page)
    assert await _store(api, HOUR0 + timedelta(hours=3)) == 6
    stored = await api.pool.fetch("SELECT node_id, hour FROM telemetry_hours WHERE subject = ''")
    assert sorted((r["node_id"], r["hour"]) for r in stored) == sorted(
        (n, HOUR0 + timedelta(hours=h)) for n in nodes for h in (0, 1)
    )
