"""The operator CLI over HTTP (`node`, `gpu`, `events`) run as real commands against a real server
process: only MODELFORGE_SERVER and a token, no database URL."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from api.cli.moments import parse_moment
from api.services.reads.bodies import AcceleratorBody
from api.services.wording import fact_label
from collectors.facts import UNSUPPORTED, Unavailable
from collectors.gpu_health import RETIRED_PAGES, XidOccurrence
from collectors.observations import ACCELERATOR_METRICS, HardwareObservation, NvmlScan
from domain.node import node_id_for
from tests.agent_support import (
    OPERATOR_TOKEN,
    ROOT,
    ServerProcess,
    clean_env,
    create_token,
    enroll_direct,
    post_report,
    report_body,
    stop_process,
)
from tests.builders import T0, gpu, host, pending_remap, scan, signals, uncorrected_ecc, with_health


def hw(*args: str, env: dict[str, str], columns: int | None = 100) -> subprocess.CompletedProcess[str]:
    """The CLI as a subprocess, its output piped; `columns` None: no $COLUMNS either."""
    width = {} if columns is None else {"COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in env.items() if k != "COLUMNS"}, **width},
        cwd=ROOT,
        timeout=120,
    )


async def hw_async(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(hw, *args, env=env)


# GPU number -> its health signals: alpha's GPU 1 degraded (a row remap pending, XID 63), beta's
# GPU 7 failed (uncorrectable ECC errors), alpha's GPU 0 healthy; Hopper retires no pages.
NO_RETIREMENT = {"retired_pages": {n: UNSUPPORTED for n in RETIRED_PAGES}}
HEALTH = {
    0: signals(**NO_RETIREMENT),
    1: pending_remap(xids=[XidOccurrence(code=63, at=T0)], **NO_RETIREMENT),
    7: uncorrected_ecc(**NO_RETIREMENT),
}
DEGRADED, FAILED, HEALTHY = (gpu(n).uuid for n in (1, 7, 0))


# A CPU-only host: no NVIDIA driver, so NVML is unavailable and there are no GPUs.
NO_DRIVER = NvmlScan(
    status="unavailable",
    reason="NVML Shared Library Not Found",
    driver_version=Unavailable("NVML Shared Library Not Found"),
    cuda_driver_version=Unavailable("NVML Shared Library Not Found"),
    accelerators=[],
)


async def add_node(
    http: httpx.AsyncClient, url: str, key: str, hostname: str, gpus: list[int], nvml: NvmlScan | None = None
) -> str:
    token = (await create_token(http, url))["token"]
    r = await enroll_direct(http, url, token, key, hostname)
    assert r.status_code in (200, 201), r.text
    observed = [with_health(gpu(n), HEALTH[n]) if n in HEALTH else gpu(n) for n in gpus]
    obs = HardwareObservation(observed_at=T0, host=host(hostname), nvml=nvml or scan(observed))
    r = await post_report(http, url, r.json()["credential"], report_body(key, 1, stream="inventory", obs=obs))
    assert r.status_code in (200, 202), r.text
    return node_id_for(key)


async def settled(dsn: str, within: float = 60) -> None:
    """Until every event written so far is below the cluster's xmin horizon, i.e. readable by the
    gap-safe read: another session's open transaction on a shared server holds it back a while."""
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + within
        while await conn.fetchval(
            "SELECT coalesce(max(tx_id) >= pg_snapshot_xmin(pg_current_snapshot()), false) FROM events"
        ):
            assert time.monotonic() < deadline, "the xmin horizon never passed the newest event"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


@pytest.fixture
async def fleet(database_dsn: str, tmp_path: Path) -> AsyncIterator[tuple[ServerProcess, dict[str, str]]]:
    server = ServerProcess(database_dsn, tmp_path).start()
    try:
        await server.wait_healthy()
        async with httpx.AsyncClient() as http:
            ids = {
                "alpha": await add_node(http, server.url, "key-alpha", "gpu-alpha", [0, 1]),
                "beta": await add_node(http, server.url, "key-beta", "gpu-beta", [7]),
                "cpu": await add_node(http, server.url, "key-cpu", "cpu-only", [], nvml=NO_DRIVER),
            }
        await settled(database_dsn)
        yield server, ids
    finally:
        # A follower's long poll may still be held: the server answers it at once as it stops.
        assert server.proc is not None
        stop_process(server.proc)


def env_for(server: ServerProcess, **extra: str) -> dict[str, str]:
    return clean_env(**{"MODELFORGE_SERVER": server.url, "MODELFORGE_TOKEN": OPERATOR_TOKEN, **extra})


async def test_node_and_gpu_commands(fleet: tuple[ServerProcess, dict[str, str]], tmp_path: Path) -> None:
    server, ids = fleet
    env = env_for(server)

    r = await hw_async("node", "list", env=env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["ID", "HOSTNAME", "LIVENESS"]
    alpha = next(line for line in lines if "gpu-alpha" in line).split()
    assert alpha[0] == ids["alpha"][:8] and alpha[5] == "2"  # the GPU count

    # A host without GPUs or driver reads as such, not as "healthy" with a "(CUDA ?)" driver.
    cpu = next(line for line in lines if "cpu-only" in line)
    assert cpu.split()[5:] == ["0", "no", "GPUs", "-"], cpu
    cpu_shown = (await hw_async("node", "show", "cpu-only", env=env)).stdout
    assert re.search(r"gpu health +no GPUs", cpu_shown) and re.search(r"^driver +-\s*$", cpu_shown, re.M), (
        cpu_shown
    )
    assert "CUDA ?" not in cpu_shown and "0 healthy" not in cpu_shown

    # Piped (no terminal, no $COLUMNS): every column whole, however long, as kubectl prints it.
    piped = await asyncio.to_thread(hw, "node", "list", "-o", "wide", env=env, columns=None)
    assert piped.returncode == 0 and "…" not in piped.stdout, piped.stdout
    assert ids["alpha"] in piped.stdout and "key-alpha" in piped.stdout
    assert piped.stdout.splitlines()[0].split() == [
        "ID",
        "HOSTNAME",
        "LIVENESS",
        "STATUS",
        "INVENTORY",
        "GPUS",
        "HEALTH",
        "DRIVER",
        "IDENTITY",
        "CPU",
        "MEMORY",
        "LAST",
        "SEEN",
    ]

    # A narrow terminal: the table fits it, the ids whole, the other columns shortened.
    narrow = hw("node", "list", env=env, columns=60)
    assert narrow.returncode == 0 and all(len(line) <= 60 for line in narrow.stdout.splitlines()), (
        narrow.stdout
    )

    as_json = json.loads((await hw_async("node", "list", "-o", "json", env=env)).stdout)
    assert {n["hostname"] for n in as_json} == {"gpu-alpha", "gpu-beta", "cpu-only"}
    as_yaml = yaml.safe_load((await hw_async("node", "list", "-o", "yaml", env=env)).stdout)
    assert {n["id"] for n in as_yaml} == set(ids.values())

    # One node by hostname, by id prefix, by the identity key its agent was given; the same body.
    by_host = json.loads((await hw_async("node", "show", "gpu-beta", "-o", "json", env=env)).stdout)
    by_prefix = json.loads((await hw_async("node", "show", ids["beta"][:6], "-o", "json", env=env)).stdout)
    by_key = json.loads((await hw_async("node", "show", "key-beta", "-o", "json", env=env)).stdout)
    assert by_host["id"] == by_prefix["id"] == by_key["id"] == ids["beta"]
    shown = await hw_async("node", "show", "gpu-alpha", env=env)
    assert shown.returncode == 0 and "GPU-00000000-0000-4000-8000-000000000001" in shown.stdout

    # Unknown: exit 5 and one line; ambiguous (the empty prefix matches all): exit 2 naming both.
    missing = await hw_async("node", "show", "no-such-host", env=env)
    assert missing.returncode == 5 and missing.stderr.count("\n") == 1 and "no-such-host" in missing.stderr
    ambiguous = await hw_async("node", "show", "", env=env)
    assert ambiguous.returncode == 2
    assert "gpu-alpha" in ambiguous.stderr and "gpu-beta" in ambiguous.stderr

    gpus = json.loads((await hw_async("gpu", "list", "--node", "gpu-alpha", "-o", "json", env=env)).stdout)
    assert sorted(g["index"] for g in gpus) == [0, 1] and {g["node_id"] for g in gpus} == {ids["alpha"]}
    one = json.loads(
        (
            await hw_async("gpu", "show", "GPU-00000000-0000-4000-8000-000000000007", "-o", "json", env=env)
        ).stdout
    )
    assert one["node_id"] == ids["beta"]
    table = await hw_async("gpu", "list", env=env)
    assert table.stdout.splitlines()[0].split()[:2] == ["UUID", "NODE"] and "gpu-beta" in table.stdout
    # by node, then in index order, as nvidia-smi lists a host's GPUs
    listed = [(r["NODE"], int(r["INDEX"])) for r in rows_by_header(table.stdout)]
    assert listed == sorted(listed) and listed[:2] == [("gpu-alpha", 0), ("gpu-alpha", 1)], listed
    none = await hw_async("gpu", "list", "--state", "missing", env=env)
    assert none.returncode == 0 and none.stdout.startswith("no GPUs")

    # The token from a file; a wrong token is refused with a hint and exit 2.
    token_file = tmp_path / "token"
    token_file.write_text(OPERATOR_TOKEN + "\n")
    from_file = clean_env(MODELFORGE_SERVER=server.url, MODELFORGE_TOKEN_FILE=str(token_file))
    assert (await hw_async("node", "list", env=from_file)).returncode == 0
    refused = await hw_async("node", "list", env=env_for(server, MODELFORGE_TOKEN="wrong"))
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr and "MODELFORGE_TOKEN" in refused.stderr
    # No server configured: Typer names the variable.
    unset = await hw_async("node", "list", env=clean_env(MODELFORGE_TOKEN=OPERATOR_TOKEN))
    assert unset.returncode == 2 and "MODELFORGE_SERVER" in unset.stderr


def rows_by_header(stdout: str) -> list[dict[str, str]]:
    """A table's rows as {header: cell}, cut at the header's column starts (rich left-aligns
    every column and puts two spaces between them; a cell may hold single spaces)."""
    header, *lines = stdout.splitlines()
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    out = []
    for line in lines:
        bounds = [*[s for s, _ in starts[1:]], len(line)]
        out.append({name: line[s:e].strip() for (s, name), e in zip(starts, bounds, strict=True)})
    return out


def row_of(stdout: str, column: str, value: str) -> dict[str, str]:
    return next(r for r in rows_by_header(stdout) if r[column] == value)


async def test_gpu_health_in_lists_show_and_the_health_filter(
    fleet: tuple[ServerProcess, dict[str, str]],
) -> None:
    server, ids = fleet
    env = env_for(server)

    listed = await hw_async("gpu", "list", env=env)
    assert listed.returncode == 0, listed.stderr
    assert {r["UUID"]: r["HEALTH"] for r in rows_by_header(listed.stdout)} == {
        DEGRADED: "degraded",
        FAILED: "failed",
        HEALTHY: "healthy",
    }
    wide = hw("gpu", "list", "-o", "wide", env=env, columns=250)
    cells = {r["UUID"]: (r["HEALTH"], r["ACTION"], r["REASONS"]) for r in rows_by_header(wide.stdout)}
    assert cells == {
        DEGRADED: ("degraded", "reset_gpu", "row_remap_pending,xid_63"),
        FAILED: ("failed", "service", "ecc_uncorrected"),
        HEALTHY: ("healthy", "none", ""),
    }

    # The filter is the server's: only the GPUs with that verdict, in every output.
    degraded = await hw_async("gpu", "list", "--health", "degraded", env=env)
    assert [r["UUID"] for r in rows_by_header(degraded.stdout)] == [DEGRADED]
    failed = json.loads((await hw_async("gpu", "list", "--health", "failed", "-o", "json", env=env)).stdout)
    assert [(g["uuid"], g["health"]["status"], g["health"]["action"]) for g in failed] == [
        (FAILED, "failed", "service")
    ]
    none = await hw_async("gpu", "list", "--health", "failed", "--node", "gpu-alpha", env=env)
    assert none.returncode == 0 and none.stdout == "no GPUs on node gpu-alpha with health failed\n"
    bad = await hw_async("gpu", "list", "--health", "sick", env=env)
    assert bad.returncode == 2 and "sick" in bad.stderr

    shown = await asyncio.to_thread(hw, "gpu", "show", DEGRADED, env=env, columns=160)
    assert shown.returncode == 0, shown.stderr
    fields = [line.split(None, 1) for line in shown.stdout.splitlines()[1:] if line.strip()]

    def field(name: str) -> list[str]:
        return [value.strip() for key, value in fields if key == name]

    assert field("node") == [f"gpu-alpha ({ids['alpha']})"], "the node by its host, then its id"
    assert field("health") == ["degraded"] and field("action") == ["reset_gpu"]
    assert field("reason") == [
        "row_remap_pending (degraded, reset_gpu): row remapping pending: reset the GPU",
        "xid_63 (degraded, reset_gpu): XID 63: ECC page retirement or row remapping recorded",
    ]
    assert field("xid") == ["63 at 2026-11-30 12:00:00Z"]
    # Signals and metrics labelled as the console labels them, a state that is not a value in words.
    labelled = dict(
        re.split(r"\s{2,}", line.strip(), maxsplit=1)
        for line in shown.stdout.splitlines()
        if line.startswith(("signal ", "telemetry "))
    )
    signal = {k.removeprefix("signal "): v for k, v in labelled.items() if k.startswith("signal ")}
    assert signal["Remapped rows: pending"] == "yes" and signal["Remapped rows: uncorrectable"] == "1"
    assert signal["Retired pages: single bit"] == "not supported", "not supported is never shown as 0"
    assert signal["Clock event reasons"] == "none" and signal["XID events"] == "yes"
    # each group in nvidia-smi's order, as the console lists them, not alphabetically
    assert [k for k in signal if k.startswith(("ECC:", "Retired"))] == [
        "ECC: corrected (volatile)",
        "ECC: uncorrected (volatile)",
        "ECC: corrected (aggregate)",
        "ECC: uncorrected (aggregate)",
        "Retired pages: single bit",
        "Retired pages: double bit",
        "Retired pages: pending",
    ]
    assert list(signal)[-3:] == ["PCIe replays", "Clock event reasons", "XID events"]
    telemetry = {k.removeprefix("telemetry "): v for k, v in labelled.items() if k.startswith("telemetry ")}
    assert list(telemetry) == [fact_label(m) for m in ACCELERATOR_METRICS], telemetry
    assert "_" not in shown.stdout.split("\nsignal ", 1)[1], "no API name stands as a label"
    beta = await asyncio.to_thread(hw, "gpu", "show", FAILED, env=env, columns=160)
    assert "ecc_uncorrected (failed, service)" in beta.stdout and "\nxid " not in beta.stdout

    nodes = await asyncio.to_thread(hw, "node", "list", env=env, columns=160)
    assert row_of(nodes.stdout, "HOSTNAME", "gpu-alpha")["HEALTH"] == "degraded (1 degraded)"
    assert row_of(nodes.stdout, "HOSTNAME", "gpu-beta")["HEALTH"] == "failed (1 failed)"


async def test_events_filters_and_follow(fleet: tuple[ServerProcess, dict[str, str]]) -> None:
    server, ids = fleet
    env = env_for(server)
    all_events = json.loads((await hw_async("events", "-o", "json", "--since", "1h", env=env)).stdout)
    assert set(ids.values()) <= {e["node_id"] for e in all_events}
    beta = json.loads(
        (await hw_async("events", "--node", "gpu-beta", "--class", "lifecycle", "-o", "json", env=env)).stdout
    )
    assert beta and {e["node_id"] for e in beta} == {ids["beta"]}
    assert {e["class"] for e in beta} == {"lifecycle"}
    typed = json.loads((await hw_async("events", "--type", "NODE_DISCOVERED", "-o", "json", env=env)).stdout)
    assert sorted(e["node_id"] for e in typed) == sorted(ids.values())
    # The table says what each event says, as the console's event list does.
    discovered = await asyncio.to_thread(
        hw, "events", "--node", "gpu-beta", "--type", "ACCELERATOR_DISCOVERED", env=env, columns=250
    )
    (row,) = rows_by_header(discovered.stdout)
    assert row["SUMMARY"].startswith("discovered ") and " at index 7, PCI " in row["SUMMARY"], row
    future = await hw_async("events", "--since", "2999-01-01T00:00:00", env=env)
    assert future.returncode == 0 and future.stdout == "no events match\n"
    bad = await hw_async("events", "--since", "yesterday", env=env)
    assert bad.returncode == 2 and "duration" in bad.stderr

    # --follow: the log so far, then an event committed later arrives on the same long poll.
    follow = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "api.cli", "events", "--follow", "-o", "json", "--type", "NODE_DISCOVERED"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        seen: list[dict[str, Any]] = []
        for _ in ids:  # one NODE_DISCOVERED per node of the fleet
            line = await asyncio.wait_for(asyncio.to_thread(follow.stdout.readline), 60)  # type: ignore[union-attr]
            seen.append(json.loads(line))
        async with httpx.AsyncClient() as http:
            gamma = await add_node(http, server.url, "key-gamma", "gpu-gamma", [9])
        line = await asyncio.wait_for(asyncio.to_thread(follow.stdout.readline), 60)  # type: ignore[union-attr]
        assert json.loads(line)["node_id"] == gamma
        assert {e["node_id"] for e in seen} == set(ids.values())
    finally:
        follow.terminate()
        follow.wait(timeout=20)


@given(st.integers(min_value=0, max_value=10_000), st.sampled_from(["s", "m", "h", "d", "w"]))
def test_durations_count_back_from_now(amount: int, unit: str) -> None:
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    seconds = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[unit]
    assert parse_moment(f"{amount}{unit}", now) == now - timedelta(seconds=amount * seconds)


def test_iso_times_without_an_offset_are_utc() -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    assert parse_moment("2026-11-24T14:00:00", now) == datetime(2026, 11, 24, 14, tzinfo=UTC)
    assert parse_moment("2026-11-24T14:00:00+01:00", now) == datetime(2026, 11, 24, 13, tzinfo=UTC)


@given(
    st.lists(st.integers(min_value=1, max_value=80), min_size=1, max_size=10),
    st.integers(min_value=0, max_value=300),
    st.data(),
)
def test_column_widths_fit_and_keep_the_ids_whole(
    natural: list[int], available: int, data: st.DataObject
) -> None:
    from api.cli.rendering import fit_widths

    fixed = set(data.draw(st.sets(st.integers(min_value=0, max_value=len(natural) - 1))))
    widths = fit_widths(natural, fixed, available)
    assert all(widths[i] == natural[i] for i in fixed)
    assert all(min(natural[i], 3) <= widths[i] <= natural[i] for i in range(len(natural)))
    free = [i for i in range(len(natural)) if i not in fixed]
    if sum(natural[i] for i in fixed) + sum(min(natural[i], 3) for i in free) <= available:
        assert sum(widths) <= available


def test_a_table_prints_its_cells_as_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    from api.cli.rendering import table

    # A GPU on PCI bus 0xAB holds rich's emoji code `:AB:`; a reason may hold `[...]`.
    cells = ["00000000:AB:00.0", "[bold]unavailable[/bold]: NVML", ":smile: x"]
    table(["PCI", "REASON", "NOTE"], [cells])
    out = capsys.readouterr().out
    assert all(cell in out for cell in cells), out


def accelerator_body(
    node: str, index: int | None, uuid: str | None = None, status: str = "active", seen: str = "00:00"
) -> AcceleratorBody:
    import random

    import msgspec

    from api.services.reads.bodies import AcceleratorBody

    return msgspec.convert(
        {
            "id": f"{node}-{index}",
            "node_id": node,
            "uuid": uuid or f"GPU-{random.Random(f'{node}{index}').getrandbits(64):016x}",
            "status": status,
            "index": index,
            "pci_bus_id": None,
            "name": "NVIDIA H200",
            "memory_total_bytes": None,
            "compute_capability": None,
            "mig_mode": {"state": "unknown"},
            "driver_version": None,
            "cuda_driver_version": None,
            "telemetry": {},
            "telemetry_observed_at": None,
            "facts": {},
            "first_seen_at": "2026-12-01T00:00:00Z",
            "last_seen_at": f"2026-12-01T{seen}:00Z",
            "missing_since": None,
            "health": {
                "status": "healthy",
                "action": "none",
                "reasons": [],
                "recent_xids": [],
                "signals": None,
            },
        },
        AcceleratorBody,
    )


def test_gpus_read_by_node_then_in_index_order(capsys: pytest.CaptureFixture[str]) -> None:
    import random

    from api.cli.gpus import gpu_table
    from api.cli.rendering import Output

    gpus = [accelerator_body(node, i) for node in ("node-b", "node-a") for i in (*range(12), None)]
    random.Random(7).shuffle(gpus)
    gpu_table(gpus, {}, Output.table)
    rows = rows_by_header(capsys.readouterr().out)
    # by node, index 10 after 9 (numbers, not text), a GPU without an index last on its node
    expected = [(node, str(i)) for node in ("node-a", "node-b") for i in (*range(12), "")]
    assert [(r["NODE"], r["INDEX"]) for r in rows] == expected


def test_a_gpu_moved_to_another_node_resolves_to_where_it_is_now(capsys: pytest.CaptureFixture[str]) -> None:
    from api.cli.remote import resolve_gpu

    uuid = "GPU-0123abcd-0000-4000-8000-000000000001"
    moved = [
        accelerator_body("node-old", 0, uuid, status="missing", seen="08:00"),
        accelerator_body("node-new", 3, uuid, seen="07:00"),
    ]
    assert resolve_gpu(moved, uuid).node_id == "node-new"
    assert capsys.readouterr().err == ""  # a move is no anomaly


def test_a_gpu_active_on_two_nodes_at_once_is_named_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    # e.g. a host enrolled again under a new node id while the old node still reports
    from api.cli.remote import resolve_gpu

    uuid = "GPU-0123abcd-0000-4000-8000-000000000001"
    twice = [
        accelerator_body("node-b", 0, uuid, seen="09:00"),
        accelerator_body("node-a", 0, uuid, seen="08:00"),
    ]
    assert resolve_gpu(twice, "GPU-0123abcd").node_id == "node-b"
    err = capsys.readouterr().err
    assert f"{uuid} is active on 2 nodes; showing id node-b-0 on node node-b (seen last)" in err, err
    assert "the others: id node-a-0 on node node-a" in err, err
    # by its id, the other row, and no warning: the operator chose
    assert resolve_gpu(twice, "node-a-0").node_id == "node-a"
    assert capsys.readouterr().err == ""
    # a command that shows every row of the UUID (gpu history) has nothing to warn about
    resolve_gpu(twice, uuid, one_row=False)
    assert capsys.readouterr().err == ""
