"""Work leases and permanent node decommission (docs/NODE_DECOMMISSION.md).

Real PostgreSQL throughout. Most tests drive the in-process app of `make_api` (local refreshes with
the fake NVML, agent enrollment and reports through the same app); one runs a real server and a
real agent process (tests/agent_support.py) to show the agent stops for good; one runs the CLI.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from api.services.decommission import DecommissionService
from api.services.inventory import HardwareInventoryService
from domain.decommission import preview_of
from domain.node import node_id_for
from ledger.events import EventMetadata, HostTelemetryObserved, NewEvent, decommission_audit_stream
from ledger.store import EventStore, StreamTombstoned
from projections.inventory import ALL_PROJECTIONS, INVENTORY
from projections.rebuild import rebuild
from tests.agent_support import (
    AgentProcess,
    ServerProcess,
    assert_problem,
    create_token,
    enroll_direct,
    observation,
    post_report,
    report_body,
    wait_for,
)

LOCAL_KEY = "test-node-1"  # the make_api harness's identity
NODE = node_id_for(LOCAL_KEY)
BASE = "/api/v1/hardware/nodes/" + NODE


# --- helpers -------------------------------------------------------------------------------------------


async def stream_count(pool: asyncpg.Pool, stream_id: str) -> int:
    async with pool.acquire() as conn:
        return int(await conn.fetchval("SELECT count(*) FROM events WHERE stream_id = $1", stream_id))


async def rows_of(pool: asyncpg.Pool, table: str, node_id: str) -> int:
    async with pool.acquire() as conn:
        return int(await conn.fetchval(f"SELECT count(*) FROM {table} WHERE node_id = $1", node_id))


async def tombstoned_at(pool: asyncpg.Pool, node_id: str) -> datetime | None:
    async with pool.acquire() as conn:
        value: datetime | None = await conn.fetchval(
            "SELECT tombstoned_at FROM streams WHERE stream_id = $1", node_id
        )
        return value


async def enrolled_node(api: Any) -> tuple[str, str]:
    """Refresh the harness's host (a node with 2 GPUs) and enroll an agent credential for the same
    identity. Returns (credential, token_id)."""
    await api.refresh()
    r = await api.post("/api/v1/enrollment-tokens", json={"ttl_seconds": 600, "uses": 1})
    assert r.status_code == 201, r.text
    r = await enroll_direct(api.client, "", r.json()["token"], LOCAL_KEY)
    assert r.status_code == 201, r.text
    return r.json()["credential"], r.json()["credential_id"]


async def preview(api: Any, node: str = NODE) -> dict[str, Any]:
    r = await api.post(f"/api/v1/hardware/nodes/{node}/decommission/preview")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def execute(api: Any, p: dict[str, Any], reason: str = "hardware retired") -> httpx.Response:
    r: httpx.Response = await api.post(
        f"/api/v1/hardware/nodes/{p['node_id']}/decommission",
        json={"generation": p["generation"], "digest": p["digest"], "reason": reason, "actor": "alice"},
    )
    return r


async def all_events(api: Any, node_id: str) -> list[dict[str, Any]]:
    """The node's whole history as GET /hardware/events pages it. The audit read is gap-safe: it
    shows a transaction's events once every older transaction on the server has ended (any other
    database's too), so wait until it shows as many as the log holds."""

    async def read() -> list[dict[str, Any]] | None:
        out: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"node_id": node_id, "limit": "50", **({"cursor": cursor} if cursor else {})}
            page = (await api.get("/api/v1/hardware/events", params=params)).json()
            out += page["items"]
            cursor = page["next_cursor"]
            if not page["has_more"]:  # every page carries a cursor to resume from
                return out if len(out) == await stream_count(api.pool, node_id) else None

    result: list[dict[str, Any]] = await wait_for(read, 60, f"the audit log of {node_id}", every=0.2)
    return result


# --- preview, then execute -------------------------------------------------------------------------------


async def test_preview_then_execute_tombstones_revokes_clears_read_models_and_keeps_history(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    _, credential_id = await enrolled_node(api)
    await api.refresh()
    node = (await api.get(BASE)).json()
    last_report = node["last_received_at"]
    assert last_report is not None and node["last_seen_at"] == last_report
    p = await preview(api)
    deps = p["dependencies"]
    assert p["status"] == "active" and p["generation"] == node["generation"] > 0
    assert len(p["digest"]) == 64 and p["can_execute"] is True and p["blockers"] == []
    assert [c["credential_id"] for c in deps["credentials"]] == [credential_id]
    assert len(deps["accelerators"]) == 2 and deps["leases"] == []
    tables = sorted(t["table"] for t in deps["telemetry"])
    assert tables == [
        "hw_accelerator_telemetry",
        "hw_accelerator_telemetry",
        "hw_host_telemetry",
        *["hw_node_storage"] * (len(tables) - 3),
    ]
    assert (await preview(api))["digest"] == p["digest"]  # deterministic
    before = await stream_count(api.pool, NODE)

    r = await execute(api, p)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["status"] == "decommissioned" and done["revoked_credentials"] == [credential_id]
    assert done["actor"] == "operator:alice" and done["previewed_generation"] == p["generation"]
    assert [e["event_type"] for e in done["events"]] == ["CREDENTIAL_REVOKED", "NODE_DECOMMISSIONED"]
    assert await stream_count(api.pool, NODE) == before + 2
    assert await tombstoned_at(api.pool, NODE) is not None

    # The tombstone (who, why, when, what was previewed) and the revocation, in the log.
    events = await all_events(api, NODE)
    assert len(events) == before + 2  # the whole history, still readable
    assert {"NODE_DISCOVERED", "ACCELERATOR_DISCOVERED", "NODE_TELEMETRY_OBSERVED"} <= {
        e["event_type"] for e in events
    }
    revoked, tomb = events[-2], events[-1]
    assert revoked["data"] == {
        "event_type": "CREDENTIAL_REVOKED",
        "credential_id": credential_id,
        "reason": "decommissioned",
    }
    assert tomb["event_type"] == "NODE_DECOMMISSIONED" and tomb["class"] == "lifecycle"
    assert tomb["data"]["actor"] == "operator:alice" and tomb["data"]["reason"] == "hardware retired"
    assert tomb["data"]["generation"] == p["generation"] and tomb["data"]["digest"] == p["digest"]
    assert tomb["metadata"]["actor"] == "operator:alice" and tomb["metadata"]["source"] == "operator"

    # Read models: listed as decommissioned, current truth gone, facts kept.
    node = (await api.get(BASE)).json()
    assert node["status"] == "decommissioned" and node["decommissioned_at"] is not None
    assert node["liveness"] == "offline" and node["telemetry"] == {} and node["storage"] == []
    assert node["hostname"] and node["fingerprint"] and node["generation"] == p["generation"] + 2
    # when it was last heard from stays true, though its telemetry row is gone, live and as of now
    assert node["last_received_at"] == node["last_seen_at"] == last_report, node
    now_past = (await api.get(BASE, params={"as_of": datetime.now(UTC).isoformat()})).json()
    assert now_past["last_received_at"] == now_past["last_seen_at"] == last_report, now_past
    # The console's node page: its GPUs are out of service, not "healthy", and it has no current
    # telemetry to tabulate.
    from api.http.console.routes import COOKIE
    from tests.conftest import OPERATOR_TOKEN

    api.client.cookies.set(COOKIE, OPERATOR_TOKEN)
    page = (await api.client.get(f"/console/nodes/{NODE}")).text
    assert 'id="node-health">no GPUs in service<' in page and "GPUs healthy" not in page
    assert "No current telemetry: the node is decommissioned." in page and 'id="gpu-telemetry"' not in page
    assert [n["id"] for n in (await api.get("/api/v1/hardware/nodes")).json()["items"]] == [NODE]
    accs = (await api.get("/api/v1/hardware/accelerators", params={"node_id": NODE})).json()["items"]
    assert [a["status"] for a in accs] == ["decommissioned", "decommissioned"]
    assert all(a["telemetry"] == {} and a["name"] for a in accs)
    for table in ("hw_host_telemetry", "hw_accelerator_telemetry", "hw_node_storage", "hw_work_leases"):
        assert await rows_of(api.pool, table, NODE) == 0, table
    creds = (await api.get("/api/v1/agent-credentials", params={"node_id": NODE})).json()["items"]
    assert [(c["status"], c["revoked_reason"]) for c in creds] == [("revoked", "decommissioned")]
    assert (await api.client.get("/api/v1/health")).json()["inventory"]["status"] == "pending"
    metrics = (await api.get("/metrics")).text
    assert NODE not in metrics and 'modelforge_accelerators{status="decommissioned"} 2.0' in metrics

    # Point in time: just before the tombstone the node was active, with its telemetry.
    before_tomb = datetime.fromisoformat(tomb["recorded_at"]) - timedelta(microseconds=1)
    past = (await api.get(BASE, params={"as_of": before_tomb.isoformat()})).json()
    assert past["status"] == "active" and past["telemetry"] != {}
    past_accs = (
        await api.get("/api/v1/hardware/accelerators", params={"as_of": before_tomb.isoformat()})
    ).json()["items"]
    assert [a["status"] for a in past_accs] == ["active", "active"]


async def test_a_report_that_changes_the_node_after_the_preview_makes_execute_409_and_changes_nothing(
    make_api,
) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    key = "agent-host-7"  # a node built by its agent's reports alone
    node_id = node_id_for(key)
    r = await api.post("/api/v1/enrollment-tokens", json={"ttl_seconds": 600, "uses": 1})
    credential = (await enroll_direct(api.client, "", r.json()["token"], key)).json()["credential"]

    async def report(sequence: int, gpus: int, mem_avail: int = 100) -> dict[str, Any]:
        body = report_body(key, sequence, obs=observation(gpus=gpus, mem_avail=mem_avail))
        r = await post_report(api.client, "", credential, body)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    await report(1, gpus=2)
    p = await preview(api, node_id)
    assert len(p["dependencies"]["accelerators"]) == 2 and len(p["dependencies"]["credentials"]) == 1
    # A GPU is pulled: the next report's complete scan has one.
    assert "ACCELERATOR_MISSING" in (await report(2, gpus=1))["lifecycle_events"]
    before = await stream_count(api.pool, node_id)

    problem = assert_problem(await execute(api, p), 409, "decommission-preview-stale")
    assert problem["previewed_generation"] == p["generation"]
    assert problem["current_generation"] > p["generation"]
    assert "ACCELERATOR_MISSING" in problem["detail"]
    assert "ACCELERATOR_MISSING" in [c["event_type"] for c in problem["changes"]]
    assert await stream_count(api.pool, node_id) == before
    assert await tombstoned_at(api.pool, node_id) is None
    node = (await api.get(f"/api/v1/hardware/nodes/{node_id}")).json()
    assert node["status"] == "active" and node["telemetry"] != {}
    creds = (await api.get("/api/v1/agent-credentials", params={"node_id": node_id})).json()["items"]
    assert [c["status"] for c in creds] == ["active"]

    # A digest that is not the preview's (same generation): 409 too.
    fresh = await preview(api, node_id)
    wrong = {**fresh, "digest": "0" * 64}
    problem = assert_problem(await execute(api, wrong), 409, "decommission-preview-stale")
    assert problem["current_digest"] == fresh["digest"] and "dependencies" in problem["detail"]

    # Telemetry alone (a heartbeat) moves neither the generation nor the digest.
    assert (await report(3, gpus=1, mem_avail=555))["lifecycle_events"] == []
    assert (await preview(api, node_id))["digest"] == fresh["digest"]
    r = await execute(api, fresh)
    assert r.status_code == 200, r.text
    accs = (await api.get("/api/v1/hardware/accelerators", params={"node_id": node_id})).json()["items"]
    assert [a["status"] for a in accs] == ["decommissioned", "decommissioned"]  # the missing one too
    assert_problem(await report_raw(api, credential, key, 4), 410, "node-decommissioned")


async def report_raw(api: Any, credential: str, key: str, sequence: int) -> httpx.Response:
    return await post_report(api.client, "", credential, report_body(key, sequence))


async def test_an_active_lease_blocks_naming_it_then_release_preview_execute_succeeds(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await api.refresh()
    r = await api.post(f"{BASE}/leases", json={"owner": "training-team", "reason": "llama fine-tune run 7"})
    assert r.status_code == 201, r.text
    lease = r.json()
    assert lease["status"] == "active" and lease["expires_at"] is None
    listed = (await api.get(f"{BASE}/leases")).json()["items"]
    assert [x["lease_id"] for x in listed] == [lease["lease_id"]]

    p = await preview(api)
    assert p["can_execute"] is False
    assert [b["lease_id"] for b in p["blockers"]] == [lease["lease_id"]]
    before = await stream_count(api.pool, NODE)
    problem = assert_problem(await execute(api, p), 409, "decommission-blocked")
    assert lease["lease_id"] in problem["detail"] and "training-team" in problem["detail"]
    assert [x["lease_id"] for x in problem["leases"]] == [lease["lease_id"]]
    assert await stream_count(api.pool, NODE) == before and await tombstoned_at(api.pool, NODE) is None

    r = await api.post(f"{BASE}/leases/{lease['lease_id']}/release", json={"reason": "run finished"})
    assert r.status_code == 200 and r.json()["status"] == "released", r.text
    assert (await api.get(f"{BASE}/leases")).json()["items"] == []
    assert_problem(await api.post(f"{BASE}/leases/{lease['lease_id']}/release"), 404, "lease-not-found")
    # The release moved the generation: the blocked preview is stale now.
    assert_problem(await execute(api, p), 409, "decommission-preview-stale")
    p2 = await preview(api)
    assert p2["blockers"] == [] and p2["generation"] == p["generation"] + 1
    r = await execute(api, p2)
    assert r.status_code == 200, r.text
    types = [e["event_type"] for e in await all_events(api, NODE) if e["class"] == "lifecycle"]
    assert types[-3:] == ["WORK_LEASE_ACQUIRED", "WORK_LEASE_RELEASED", "NODE_DECOMMISSIONED"]

    # Leases on a decommissioned or unknown node are refused.
    assert_problem(
        await api.post(f"{BASE}/leases", json={"owner": "x", "reason": "y"}), 410, "node-decommissioned"
    )
    unknown = "/api/v1/hardware/nodes/" + node_id_for("no-such-host")
    assert_problem(
        await api.post(f"{unknown}/leases", json={"owner": "x", "reason": "y"}), 404, "node-not-found"
    )
    assert_problem(await api.post(f"{unknown}/decommission/preview"), 404, "node-not-found")
    assert_problem(await api.post(f"{BASE}/leases", json={"owner": " ", "reason": "y"}), 400)
    assert (await api.client.post(f"{BASE}/leases", json={"owner": "x", "reason": "y"})).status_code == 401


async def test_an_expired_lease_no_longer_blocks(store: EventStore, make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await api.refresh()
    now = datetime.now(UTC)
    service = DecommissionService(HardwareInventoryService(store), clock=lambda: now)
    lease = await service.acquire_lease(NODE, "batch", "nightly eval", 60, actor="test")
    assert [b.lease_id for b in (await service.preview(NODE)).blockers] == [lease.lease_id]
    later = DecommissionService(HardwareInventoryService(store), clock=lambda: now + timedelta(seconds=61))
    p = await later.preview(NODE)
    assert p.blockers == [] and p.dependencies.leases == [] and p.can_execute
    assert [x.status for x in await later.list_leases(NODE)] == ["expired"]
    done = await later.execute(NODE, p.generation, p.digest, "retired", actor="test")
    assert done.status == "decommissioned"


# --- no revival ---------------------------------------------------------------------------------------


async def test_every_revival_path_is_refused_appends_nothing_to_the_node_stream_and_rebuild_keeps_it(  # type: ignore[no-untyped-def]
    make_api, store: EventStore, database_dsn: str, tmp_path: Path
) -> None:
    api = make_api()
    credential, _ = await enrolled_node(api)
    r = await post_report(api.client, "", credential, report_body(LOCAL_KEY, 1))
    assert r.status_code == 200, r.text
    fresh = await api.post("/api/v1/enrollment-tokens", json={"ttl_seconds": 600, "uses": 1})
    fresh_token = fresh.json()
    assert (await execute(api, await preview(api))).status_code == 200
    frozen = await stream_count(api.pool, NODE)

    refused_from = datetime.now(UTC)
    # 1. A local refresh on that host.
    assert_problem(await api.post("/api/v1/hardware/refresh"), 410, "node-decommissioned")
    # 2. A report (= heartbeat) with the old credential.
    p = assert_problem(
        await post_report(api.client, "", credential, report_body(LOCAL_KEY, 2)), 410, "node-decommissioned"
    )
    assert NODE in p["detail"]
    # 3. Re-enrollment with a fresh token and the same identity; the token's use is not spent.
    assert_problem(
        await enroll_direct(api.client, "", fresh_token["token"], LOCAL_KEY), 410, "node-decommissioned"
    )
    tokens = {t["token_id"]: t for t in (await api.get("/api/v1/enrollment-tokens")).json()["items"]}
    assert tokens[fresh_token["token_id"]]["uses_left"] == 1
    assert tokens[fresh_token["token_id"]]["status"] == "active"
    # 4. A direct append to the stream, with or without the expected version.
    telemetry = NewEvent(
        payload=HostTelemetryObserved(telemetry={}, storage=[]),
        metadata=EventMetadata(received_at=datetime.now(UTC), source="local"),
    )
    for expected in (None, frozen):
        with pytest.raises(StreamTombstoned):
            await store.append(NODE, expected, [telemetry])
    # And no operator path either.
    assert_problem(await execute(api, stale_preview(frozen)), 410, "node-decommissioned")
    assert_problem(await api.post(f"{BASE}/decommission/preview"), 410, "node-decommissioned")

    assert await stream_count(api.pool, NODE) == frozen
    node = (await api.get(BASE)).json()
    assert node["status"] == "decommissioned" and node["telemetry"] == {}
    # The refused attempts are audited beside the node's stream, at most once per hour each.
    assert_problem(await api.post("/api/v1/hardware/refresh"), 410, "node-decommissioned")
    audit = decommission_audit_stream(NODE)
    refused = [e for e in await all_events(api, audit) if e["event_type"] == "NODE_REVIVAL_REFUSED"]
    attempts = sorted(e["data"]["attempt"] for e in refused)
    same_hour = datetime.now(UTC).strftime("%H") == refused_from.strftime("%H")
    assert attempts == ["agent_report", "enrollment", "local_refresh"] or not same_hour, attempts
    assert {e["node_id"] for e in refused} == {audit} and {e["data"]["node_id"] for e in refused} == {NODE}

    # `rebuild --verify` passes (the operator's command), and a real rebuild keeps the tombstone.
    code, out, err = await asyncio.to_thread(
        run_cli, "rebuild", "--verify", "--database-url", database_dsn, "--state-dir", str(tmp_path / "cli")
    )
    assert code == 0 and "verified" in out, out + err
    report = await rebuild(api.pool, ALL_PROJECTIONS)
    assert report.swapped and not report.differences
    node = (await api.get(BASE)).json()
    assert node["status"] == "decommissioned" and node["telemetry"] == {} and node["storage"] == []
    accs = (await api.get("/api/v1/hardware/accelerators", params={"node_id": NODE})).json()["items"]
    assert {a["status"] for a in accs} == {"decommissioned"}
    assert await rows_of(api.pool, "hw_accelerator_telemetry", NODE) == 0
    creds = (await api.get("/api/v1/agent-credentials", params={"node_id": NODE})).json()["items"]
    assert {c["status"] for c in creds} == {"revoked"}
    async with api.pool.acquire() as conn:
        audit_state = await conn.fetchval(
            "SELECT count(*) FROM projection_state WHERE stream_id = $1", decommission_audit_stream(NODE)
        )
    assert audit_state == 0  # the audit stream is no node
    # Still refused after the rebuild.
    assert_problem(await api.post("/api/v1/hardware/refresh"), 410, "node-decommissioned")
    assert await stream_count(api.pool, NODE) == frozen


def stale_preview(generation: int) -> dict[str, Any]:
    return {"node_id": NODE, "generation": generation, "digest": "0" * 64}


async def test_two_concurrent_executes_of_one_preview_exactly_one_succeeds(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await enrolled_node(api)
    p = await preview(api)
    answers = await asyncio.gather(*(execute(api, p, reason=f"race {i}") for i in range(4)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200, 410, 410, 410], [r.text for r in answers]
    for r in answers:
        if r.status_code == 410:
            assert_problem(r, 410, "node-decommissioned")
    async with api.pool.acquire() as conn:
        tombs = await conn.fetchval(
            "SELECT count(*) FROM events WHERE stream_id = $1 AND event_type = 'NODE_DECOMMISSIONED'", NODE
        )
        revocations = await conn.fetchval(
            "SELECT count(*) FROM events WHERE stream_id = $1 AND event_type = 'CREDENTIAL_REVOKED'", NODE
        )
    assert tombs == 1 and revocations == 1


async def test_the_fold_and_preview_are_pure_and_agree_with_the_live_state(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await enrolled_node(api)
    async with api.pool.acquire() as conn:
        state = await INVENTORY.load_state(conn, NODE)
    now = datetime.now(UTC)
    assert preview_of(state, now).digest == (await preview(api))["digest"]
    assert preview_of(state, now).generation == state.lifecycle_version


# --- the agent, end to end ---------------------------------------------------------------------------


async def test_a_running_agent_stops_with_78_and_its_host_cannot_enroll_again(
    database_dsn: str, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    server = ServerProcess(database_dsn, tmp_path / "server").start()
    agent = AgentProcess(tmp_path, "decom-agent-1")
    try:
        await server.wait_healthy()
        async with httpx.AsyncClient(timeout=15) as http:
            from tests.agent_support import OPERATOR

            token = (await create_token(http, server.url))["token"]
            assert (await agent.enroll(server.url, token)).returncode == 0, agent.log_text()
            agent.start(server.url, interval=0.2)
            node_id = agent.expected_node_id

            async def reported() -> bool:
                assert agent.alive(), agent.log_text()[-3000:]
                async with pool.acquire() as conn:
                    n = await conn.fetchval(
                        "SELECT coalesce(sum(reports), 0) FROM agent_stream_positions WHERE node_id = $1",
                        node_id,
                    )
                return bool(n >= 2)

            await wait_for(reported, 20, "two reports")
            r = await http.post(
                f"{server.url}/api/v1/hardware/nodes/{node_id}/decommission/preview", headers=OPERATOR
            )
            assert r.status_code == 200, r.text
            p = r.json()
            r = await http.post(
                f"{server.url}/api/v1/hardware/nodes/{node_id}/decommission",
                json={"generation": p["generation"], "digest": p["digest"], "reason": "rack 12 retired"},
                headers=OPERATOR,
            )
            if r.status_code == 409:  # a report changed the node in between: preview again
                p = (
                    await http.post(
                        f"{server.url}/api/v1/hardware/nodes/{node_id}/decommission/preview", headers=OPERATOR
                    )
                ).json()
                r = await http.post(
                    f"{server.url}/api/v1/hardware/nodes/{node_id}/decommission",
                    json={"generation": p["generation"], "digest": p["digest"], "reason": "rack 12 retired"},
                    headers=OPERATOR,
                )
            assert r.status_code == 200, r.text
            frozen = await stream_count(pool, node_id)

            async def exited() -> bool:
                return agent.proc is not None and agent.proc.poll() is not None

            await wait_for(exited, 20, "the agent to stop publishing")
            assert agent.proc is not None and agent.proc.returncode == 78, agent.log_text()[-3000:]
            log = agent.log_text()
            assert "agent.publishing_stopped" in log and "decommissioned" in log
            # the way back it names is the one that works: not --force under this identity
            assert "new identity" in log and "--force" not in log, log[-2000:]

            # The host, reimaged or not, cannot enroll again under this identity.
            second = await create_token(http, server.url)
            again = await enroll_direct(http, server.url, second["token"], agent.node_id)
            assert_problem(again, 410, "node-decommissioned")
            tokens = (await http.get(server.url + "/api/v1/enrollment-tokens", headers=OPERATOR)).json()
            left = {t["token_id"]: t["uses_left"] for t in tokens["items"]}
            assert left[second["token_id"]] == 1
            assert await stream_count(pool, node_id) == frozen
    finally:
        if agent.alive():
            agent.stop()
        assert server.stop() == 0, server.log_text()[-3000:]


# --- the CLI ------------------------------------------------------------------------------------------


def run_cli(*argv: str) -> tuple[int, str, str]:
    """`modelforge-hw ARGV` in this process (argument parsing, output and exit code as on a
    terminal-less shell; tests/test_cli.py covers the console script itself), run in a worker
    thread since the CLI runs its own event loop. Logging is configured back afterwards."""
    import contextlib
    import io

    import structlog

    from api.cli.main import main

    saved = structlog.get_config()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        structlog.configure(**saved)
    return code, out.getvalue(), err.getvalue()


async def test_cli_lease_preview_and_execute(make_api, database_dsn: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await api.refresh()
    db = ("--database-url", database_dsn, "--state-dir", str(tmp_path / "cli"))

    async def cli(*args: str) -> tuple[int, str, str]:
        return await asyncio.to_thread(run_cli, *args, *db)

    # NODE may be the node id or its identity key.
    code, out, err = await cli(
        "lease", "acquire", LOCAL_KEY, "--owner", "eval", "--reason", "bench", "--ttl", "2h"
    )
    assert code == 0, err
    lease_id = out.strip()
    code, out, err = await cli("lease", "list", NODE, "--json")
    assert code == 0 and [x["lease_id"] for x in json.loads(out)["items"]] == [lease_id], err
    code, out, err = await cli("decommission", "preview", NODE)
    assert code == 3 and "BLOCKED" in out and lease_id in out, out + err
    code, out, err = await cli("decommission", "preview", NODE, "--json")
    assert code == 0, err
    p = json.loads(out)
    assert [b["lease_id"] for b in p["blockers"]] == [lease_id]
    args = ("--generation", str(p["generation"]), "--digest", p["digest"], "--reason", "retired")
    code, out, err = await cli("decommission", "execute", NODE, *args)
    assert code == 3 and lease_id in err and err.count("\n") == 1, err
    code, out, err = await cli("lease", "release", NODE, lease_id)
    assert code == 0 and "released" in out, err
    code, out, err = await cli("decommission", "execute", NODE, *args)
    assert code == 3 and "changed since the preview" in err, err
    code, out, err = await cli("decommission", "preview", NODE)
    assert code == 0 and "--generation" in out, err
    p = json.loads((await cli("decommission", "preview", NODE, "--json"))[1])
    args = ("--generation", str(p["generation"]), "--digest", p["digest"], "--reason", "retired")
    code, out, err = await cli("decommission", "execute", NODE, *args, "--actor", "bob")
    assert code == 0 and "decommissioned" in out, err
    code, out, err = await cli("decommission", "execute", NODE, *args, "--json")
    assert code == 4 and json.loads(out)["status"] == 410, err
    code, out, err = await cli("lease", "acquire", NODE, "--owner", "x", "--reason", "y")
    assert code == 4, err
    code, out, err = await cli("decommission", "preview", "no-such-host")
    assert code == 5, err
    tomb = [e for e in await all_events(api, NODE) if e["event_type"] == "NODE_DECOMMISSIONED"]
    assert tomb[0]["data"]["actor"] == "cli:bob" and tomb[0]["data"]["reason"] == "retired"
    code, out, err = await cli("refresh", "--node-id", LOCAL_KEY)
    assert code == 2 and "decommissioned" in err and "new identity" in err, err


async def test_the_preview_lists_a_nodes_gpus_by_index_in_the_cli_and_the_console(
    make_api: Any, database_dsn: str, tmp_path: Path
) -> None:
    """As nvidia-smi and `gpu list` do; the preview's own order (by UUID, which its digest binds)
    is not one an operator reads a node in."""
    from tests.fixtures_nvml import multi_gpu_scenario

    api = make_api(multi_gpu_scenario(8))
    await api.refresh()
    uuids = dict(enumerate(g.uuid for g in api.scenario.gpus))  # a scenario lists its GPUs by index
    assert sorted(uuids.values()) != [uuids[i] for i in range(8)], "the UUIDs' order is not the indexes'"
    db = ("--database-url", database_dsn, "--state-dir", str(tmp_path / "cli"))
    code, out, err = await asyncio.to_thread(run_cli, "decommission", "preview", LOCAL_KEY, *db)
    assert code == 0, err
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  GPU-")]
    assert listed == [uuids[i] for i in range(8)], out
    node_id = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]["id"]
    from api.http.console.routes import COOKIE
    from tests.conftest import OPERATOR_TOKEN

    api.client.cookies.set(COOKIE, OPERATOR_TOKEN)  # the console's sign-in
    r = await api.client.get(f"/console/nodes/{node_id}/decommission")
    assert r.status_code == 200, r.text[:500]
    page = r.text
    assert [page.index(uuids[i]) for i in range(8)] == sorted(page.index(uuids[i]) for i in range(8))
