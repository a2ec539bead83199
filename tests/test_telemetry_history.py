"""The telemetry history routes over a real PostgreSQL: an hour of seeded samples with a gap of
ten minutes, a fan the GPU does not report, a report delivered late, a sample of another GPU and
the per-kind events of older logs; the buckets, the refusals and the plan of the log's read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from api.services.reads import telemetry
from api.services.reads.telemetry import ACCELERATOR_SAMPLES, HOST_SAMPLES, TelemetryReads
from api.services.scopes import OperatorTokens
from domain.telemetry_history import window
from tests.loop_support import OtherWork, ran_between, turns_at_calls
from tests.telemetry_support import BASE, WINDOW, seed


async def _fixture(make_api: Any) -> tuple[Any, str, dict[str, Any]]:
    api = make_api()
    await api.refresh()
    node_id = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]["id"]
    acc = (await api.get("/api/v1/hardware/accelerators")).json()["items"][0]
    await seed(api.pool, node_id, acc["id"], acc["uuid"])
    return api, node_id, acc


def _series(body: dict[str, Any], metric: str) -> list[dict[str, Any]]:
    return next(s["points"] for s in body["series"] if s["metric"] == metric)


async def test_accelerator_history_buckets_gaps_and_unsupported(make_api) -> None:  # type: ignore[no-untyped-def]
    api, node_id, acc = await _fixture(make_api)
    r = await api.get(f"/api/v1/hardware/accelerators/{acc['id']}/telemetry", params={**WINDOW, "step": 300})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["subject"], body["node_id"], body["uuid"], body["step_seconds"]) == (
        "accelerator",
        node_id,
        acc["uuid"],
        300,
    )
    # 49 snapshots, the older release's sample and the late report; not the one observed before.
    assert body["samples"] == 51
    temperature = _series(body, "temperature_celsius")
    assert len(temperature) == 12
    assert [p["count"] for p in temperature] == [5, 6, 5, 5, 0, 0, 5, 5, 5, 5, 5, 5]
    assert temperature[0] == {
        "start": "2026-11-30T10:00:00Z",
        "count": 5,
        "states": {"known": 5},
        "min": 40.0,
        "mean": 42.0,
        "max": 44.0,
    }
    # the gap: no number at all, never 0
    assert temperature[4] == {
        "start": "2026-11-30T10:20:00Z",
        "count": 0,
        "states": {},
        "min": None,
        "mean": None,
        "max": None,
    }
    # the late report lands where it was observed (minute 5.5, its reading 45)
    assert temperature[1]["count"] == 6 and abs(temperature[1]["mean"] - 280 / 6) < 1e-9
    assert temperature[11]["max"] == 99.0  # minute 59: the older release's per-kind sample
    fan = _series(body, "fan_speed_percent")
    assert fan[0]["states"] == {"unsupported": 5} and fan[0]["mean"] is None
    assert fan[4]["states"] == {}
    # a metric no sample carries: every bucket empty
    assert all(p["count"] == 0 and p["mean"] is None for p in _series(body, "clock_sm_mhz"))
    assert {s["metric"] for s in body["series"]} >= {"power_watts", "performance_state"}


async def test_node_history_reads_the_host_metrics(make_api) -> None:  # type: ignore[no-untyped-def]
    api, node_id, _acc = await _fixture(make_api)
    r = await api.get(f"/api/v1/hardware/nodes/{node_id}/telemetry", params={**WINDOW, "step": 600})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["subject"], body["id"], body["uuid"], body["samples"]) == ("node", node_id, None, 51)
    assert [s["metric"] for s in body["series"]] == ["memory_available_bytes", "memory_total_bytes"]
    available = _series(body, "memory_available_bytes")
    assert [p["count"] for p in available] == [11, 10, 0, 10, 10, 10]
    assert (available[0]["min"], available[0]["max"]) == (1000.0, 1009.0)
    assert available[5]["max"] == 1059.0  # HOST_TELEMETRY_OBSERVED of an older release


async def test_defaults_keep_a_series_under_500_points(make_api) -> None:  # type: ignore[no-untyped-def]
    api, node_id, acc = await _fixture(make_api)
    r = await api.get(f"/api/v1/hardware/accelerators/{acc['id']}/telemetry")
    assert r.status_code == 200, r.text
    body = r.json()
    until = datetime.fromisoformat(body["until"])
    assert datetime.fromisoformat(body["since"]) == until - timedelta(hours=1)
    assert abs((datetime.now(UTC) - until).total_seconds()) < 60
    points = _series(body, "temperature_celsius")
    assert 450 <= len(points) <= 500 and body["step_seconds"] == 8
    # the refresh's own sample, just now, is in the last hour
    assert body["samples"] == 1
    r = await api.get(f"/api/v1/hardware/nodes/{node_id}/telemetry", params={"until": WINDOW["until"]})
    assert r.json()["samples"] == 51 and r.json()["since"] == "2026-11-30T10:00:00Z"


async def test_refusals_name_the_parameter(make_api) -> None:  # type: ignore[no-untyped-def]
    api, node_id, acc = await _fixture(make_api)
    path = f"/api/v1/hardware/accelerators/{acc['id']}/telemetry"

    async def problem(params: dict[str, Any], route: str = path) -> dict[str, Any]:
        r = await api.get(route, params=params)
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        return r.json()  # type: ignore[no-any-return]

    assert "step" in str(await problem({**WINDOW, "step": 0}))
    too_many = await problem({**WINDOW, "step": 1})
    assert too_many["parameter"] == "step" and "3600 points" in too_many["detail"]
    day = {"since": (BASE - timedelta(days=1)).isoformat(), "until": BASE.isoformat()}
    assert (await problem({**day, "step": 30}, f"/api/v1/hardware/nodes/{node_id}/telemetry"))[
        "parameter"
    ] == "step"
    backwards = await problem({"since": WINDOW["until"], "until": WINDOW["since"]})
    assert backwards["parameter"] == "since" and "before" in backwards["detail"]
    assert (await problem({"since": WINDOW["since"], "until": WINDOW["since"]}))["parameter"] == "since"
    bad_time = await problem({"since": "yesterday"})
    assert "since" in str(bad_time), bad_time
    assert "step" in str(await problem({"step": "often"}))
    assert "step" in str(await problem({"step": 10**12}))
    assert (await problem({"until": "0001-01-01T00:30:00Z"}))["parameter"] == "until"
    for route in (
        f"/api/v1/hardware/accelerators/{'0' * 32}/telemetry",
        "/api/v1/hardware/nodes/nope/telemetry",
    ):
        r = await api.get(route)
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")


async def test_1964_points_pass(make_api) -> None:  # type: ignore[no-untyped-def]
    api, _node_id, acc = await _fixture(make_api)
    day = {"since": (BASE - timedelta(days=1)).isoformat(), "until": BASE.isoformat(), "step": 44}
    r = await api.get(f"/api/v1/hardware/accelerators/{acc['id']}/telemetry", params=day)
    assert r.status_code == 200 and len(_series(r.json(), "power_watts")) == 1964


async def test_a_viewer_reads_the_history(make_api) -> None:  # type: ignore[no-untyped-def]
    api, node_id, acc = await _fixture(make_api)
    viewer = {"Authorization": f"Bearer {(await OperatorTokens(api.pool).create(ttl_seconds=3600)).token}"}
    for path in (
        f"/api/v1/hardware/accelerators/{acc['id']}/telemetry",
        f"/api/v1/hardware/nodes/{node_id}/telemetry",
    ):
        r = await api.client.get(path, params=WINDOW, headers=viewer)
        assert r.status_code == 200 and r.json()["samples"] == 51, r.text
        assert (await api.client.get(path, params=WINDOW)).status_code == 401


async def test_the_history_reads_one_stream_by_index(make_api) -> None:  # type: ignore[no-untyped-def]
    """The log's read finds the node's observations by the index of its stream's key in every segment,
    never by a scan of the whole log (with a fleet's data PostgreSQL takes
    `events_stream_observation_received_idx`: docs/telemetry.md)."""
    api, node_id, _acc = await _fixture(make_api)
    async with api.pool.acquire() as conn, conn.transaction():
        await conn.execute("SET LOCAL enable_seqscan = off")
        for sql, args in (
            (ACCELERATOR_SAMPLES, (node_id, BASE, BASE + timedelta(hours=1))),
            (HOST_SAMPLES, (node_id, BASE, BASE + timedelta(hours=1))),
        ):
            plan = [r[0] for r in await conn.fetch("EXPLAIN " + sql, *args)]
            scans = [line for line in plan if " on events" in line]
            conditions = [line for line in plan if "Index Cond" in line or "Recheck Cond" in line]
            assert scans and len(conditions) >= len(scans), plan
            assert not any("Seq Scan" in line for line in scans), plan
            assert all("hashtextextended(stream_id" in line for line in conditions), plan
            assert all("received_at" in line for line in conditions), plan


async def test_a_long_window_read_in_two_parts_is_the_one_read_whole(
    make_api: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two hours from half an hour before the seeded one: the log is read in two parts split at
    BASE + 30 min, the minute-30 snapshot received exactly there, the late report (observed in the
    earlier half, received in the later one) and the one observed before BASE among them."""
    api, _node_id, acc = await _fixture(make_api)
    reads = TelemetryReads(api.pool)
    w = window(BASE - timedelta(minutes=30), BASE + timedelta(minutes=90), 60)
    calls: list[int] = []
    part = telemetry.accelerator_part
    monkeypatch.setattr(
        telemetry, "accelerator_part", lambda rows, *a: calls.append(len(rows)) or part(rows, *a)
    )
    async with api.pool.acquire(), api.pool.acquire():
        pass  # two connections made, so one is idle beside the read's own
    split = await reads.accelerator(acc["id"], w)
    assert len(calls) == 2 and all(calls), calls
    monkeypatch.setattr(telemetry, "SPLIT_FROM", timedelta(days=1))
    calls.clear()
    whole = await reads.accelerator(acc["id"], w)
    assert len(calls) == 1, calls
    assert split == whole
    assert whole.samples == 52


@pytest.mark.parametrize("subject", ["accelerator", "node"])
async def test_a_history_read_lets_other_work_run_while_it_decodes_and_buckets(
    make_api: Any, monkeypatch: pytest.MonkeyPatch, subject: str
) -> None:
    """A day of one GPU is tens of milliseconds of CPU, and an agent's report or another request
    waits on the same event loop meanwhile: the read decodes its rows a slice at a time and
    buckets one series at a time, and what else is ready runs between two of them."""
    api, node_id, acc = await _fixture(make_api)
    monkeypatch.setattr(telemetry, "SLICE", 8)
    other = OtherWork()
    series: list[int] = []
    bucket = telemetry.series_of_columns

    def counted_series(*args: Any) -> Any:
        for one in bucket(*args):
            series.append(other.turns)
            yield one

    name = "accelerator_part" if subject == "accelerator" else "host_part"
    slices = turns_at_calls(monkeypatch, telemetry, name, other)
    monkeypatch.setattr(telemetry, "series_of_columns", counted_series)
    reads = TelemetryReads(api.pool)
    w = window(BASE - timedelta(minutes=30), BASE + timedelta(minutes=90), 60)
    async with other:
        body = await (reads.accelerator(acc["id"], w) if subject == "accelerator" else reads.node(node_id, w))
    assert body.samples >= 50
    # every slice of at most 8 rows, and the other work ran between any two of them
    assert len(slices) >= 7, slices
    assert ran_between(slices), slices
    assert len(series) == len(body.series) > 1
    assert ran_between(series), series
