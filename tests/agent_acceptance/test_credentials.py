"""Who may publish and enroll: a node's credential publishes for that node only, a revoked one is
refused and stops the agent, enrollment tokens that are expired, used up, revoked or forged are
refused, no secret reaches a log, and the credential and token read models rebuild row for row."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import asyncpg
import httpx

from domain.node import node_id_for
from tests.agent_acceptance.plane import (
    event_count,
    parse_moment,
    tag,
    wait_reports,
)
from tests.agent_support import (
    OPERATOR,
    OPERATOR_TOKEN,
    ROOT,
    AgentProcess,
    ServerProcess,
    assert_no_secrets,
    assert_problem,
    create_token,
    enroll_direct,
    post_report,
    report_body,
    wait_for,
)


async def test_credential_of_node_a_cannot_publish_for_node_b(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    t = tag()
    key_a, key_b = f"a-{t}", f"b-{t}"
    token = (await create_token(http, server.url, uses=2))["token"]
    cred_a = (await enroll_direct(http, server.url, token, key_a)).json()["credential"]
    cred_b = (await enroll_direct(http, server.url, token, key_b)).json()["credential"]
    before = await event_count(db, node_id_for(key_b))
    assert_problem(
        await post_report(http, server.url, cred_a, report_body(key_b, 1)), 403, "credential-node-mismatch"
    )
    assert_problem(
        await post_report(http, server.url, cred_b, report_body(key_a, 1)), 403, "credential-node-mismatch"
    )
    assert await event_count(db, node_id_for(key_b)) == before
    assert await event_count(db, node_id_for(key_a)) == 1  # its CREDENTIAL_ISSUED only
    # node_id that is not the identity's: refused before any credential question.
    forged = json.loads(report_body(key_a, 1))
    forged["node_id"] = node_id_for(key_b)
    assert_problem(
        await post_report(http, server.url, cred_a, json.dumps(forged).encode()), 400, "node-id-mismatch"
    )
    r = await post_report(http, server.url, cred_b, report_body(key_b, 1))
    assert r.status_code == 200, r.text


async def test_revoked_credential_is_401_and_the_agent_stops_saying_why(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    token = (await create_token(http, server.url))["token"]
    agent = AgentProcess(tmp_path, f"revoked-{tag()}")
    assert (await agent.enroll(server.url, token)).returncode == 0, agent.log_text()
    agent.start(server.url)
    try:
        await wait_reports(db, [agent], 2)
        credential = agent.credential()
        r = await http.post(
            f"{server.url}/api/v1/agent-credentials/{credential['credential_id']}/revoke",
            json={"reason": "host reimaged"},
            headers=OPERATOR,
        )
        assert r.status_code == 200 and r.json()["status"] == "revoked", r.text
        after_revoke = await event_count(db, agent.expected_node_id)
        await wait_for(lambda: _exited(agent), 15, "the agent to stop publishing")
        assert agent.proc is not None and agent.proc.returncode == 78, agent.log_text()[-3000:]
    finally:
        if agent.alive():
            agent.stop()
    log = agent.log_text()
    assert "agent.publishing_stopped" in log and "revoked" in log
    assert await event_count(db, agent.expected_node_id) == after_revoke  # nothing after the revocation
    p = assert_problem(
        await post_report(http, server.url, credential["credential"], report_body(agent.node_id, 10_000)),
        401,
        "credential-revoked",
    )
    assert p["detail"]
    listed = await http.get(
        server.url + "/api/v1/agent-credentials", params={"node_id": agent.expected_node_id}, headers=OPERATOR
    )
    assert [c["status"] for c in listed.json()["items"]] == ["revoked"]
    assert "secret" not in listed.text and credential["credential"] not in listed.text


async def _exited(agent: AgentProcess) -> bool:
    return agent.proc is not None and agent.proc.poll() is not None


async def test_expired_used_up_revoked_or_forged_enrollment_tokens_are_401(
    server: ServerProcess, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    t = tag()
    expiring = await create_token(http, server.url, ttl=1)
    once = await create_token(http, server.url, uses=1)
    twice = await create_token(http, server.url, uses=2)
    revoked = await create_token(http, server.url)
    r = await http.post(
        f"{server.url}/api/v1/enrollment-tokens/{revoked['token_id']}/revoke", headers=OPERATOR, json={}
    )
    assert r.status_code == 200 and r.json()["status"] == "revoked"

    assert (await enroll_direct(http, server.url, once["token"], f"once-{t}")).status_code == 201
    assert_problem(
        await enroll_direct(http, server.url, once["token"], f"once2-{t}"), 401, "enrollment-token-used-up"
    )
    assert_problem(
        await enroll_direct(http, server.url, revoked["token"], f"rev-{t}"), 401, "enrollment-token-revoked"
    )
    forged = twice["token"][:-4] + ("AAAA" if not twice["token"].endswith("AAAA") else "BBBB")
    assert_problem(
        await enroll_direct(http, server.url, forged, f"forged-{t}"), 401, "enrollment-token-invalid"
    )
    assert_problem(
        await enroll_direct(http, server.url, "nonsense", f"x-{t}"), 401, "enrollment-token-invalid"
    )

    # Uses are counted atomically: five agents racing for a two-use token, two win.
    racing = await asyncio.gather(
        *(enroll_direct(http, server.url, twice["token"], f"race{i}-{t}") for i in range(5))
    )
    assert sorted(r.status_code for r in racing) == [201, 201, 401, 401, 401]

    await asyncio.sleep(max(0.0, parse_moment(expiring["expires_at"]) - time.time() + 0.2))
    assert_problem(
        await enroll_direct(http, server.url, expiring["token"], f"exp-{t}"), 401, "enrollment-token-expired"
    )
    # The agent's command line says so in one line, and keeps no credential.
    agent = AgentProcess(tmp_path, f"exp-cli-{t}")
    done = await agent.enroll(server.url, expiring["token"])
    assert done.returncode == 2 and "expired" in done.stderr, done.stderr
    assert not (agent.state_dir / "agent-credential.json").exists()

    # Token routes are operator routes.
    assert_problem(await http.post(server.url + "/api/v1/enrollment-tokens", json={}), 401)
    assert_problem(
        await http.get(server.url + "/api/v1/enrollment-tokens", headers={"Authorization": "Bearer nope"}),
        401,
    )
    listed = await http.get(server.url + "/api/v1/enrollment-tokens", headers=OPERATOR)
    by_id = {x["token_id"]: x for x in listed.json()["items"]}
    assert (
        by_id[once["token_id"]]["status"] == "used_up" and by_id[revoked["token_id"]]["status"] == "revoked"
    )
    assert by_id[expiring["token_id"]]["status"] == "expired"
    assert all(x["token"] not in listed.text for x in (once, twice, revoked, expiring))


async def test_no_secret_appears_in_any_log(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    token = (await create_token(http, server.url))["token"]
    agent = AgentProcess(tmp_path, f"secret-{tag()}")
    enrolled = await agent.enroll(server.url, token, "--log-level", "DEBUG")
    assert enrolled.returncode == 0, enrolled.stderr
    credential = agent.credential()
    done = await asyncio.to_thread(
        subprocess.run,
        agent.command("run", "--once", "--server", server.url, "--log-level", "DEBUG"),
        env=agent.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    r = await http.post(
        f"{server.url}/api/v1/agent-credentials/{credential['credential_id']}/revoke",
        headers=OPERATOR,
        json={},
    )
    assert r.status_code == 200
    stopped = await asyncio.to_thread(
        subprocess.run,
        agent.command("run", "--once", "--server", server.url, "--log-level", "DEBUG"),
        env=agent.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stopped.returncode == 78
    logs = {
        "server": server.log_text(),
        "enroll": enrolled.stdout + enrolled.stderr,
        "run": done.stdout + done.stderr,
        "stopped": stopped.stdout + stopped.stderr,
    }
    assert '"agent.report_sent"' in logs["run"] and "agent.publishing_stopped" in logs["stopped"]
    assert_no_secrets(logs, [token, credential["credential"], OPERATOR_TOKEN])


async def test_rebuild_reproduces_credentials_and_tokens_row_for_row(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    from projections.inventory import ALL_PROJECTIONS
    from projections.rebuild import rebuild

    key = f"rebuild-{tag()}"
    token = (await create_token(http, server.url, uses=2))["token"]
    first = (await enroll_direct(http, server.url, token, key)).json()
    again = (await enroll_direct(http, server.url, token, key)).json()  # re-enrollment supersedes
    assert again["superseded_credentials"] == [first["credential_id"]]
    assert (await post_report(http, server.url, again["credential"], report_body(key, 1))).status_code == 200
    assert_problem(
        await post_report(http, server.url, first["credential"], report_body(key, 2)),
        401,
        "credential-revoked",
    )
    report = await rebuild(db, ALL_PROJECTIONS, verify=True)
    assert report.differences == []
    await rebuild(db, ALL_PROJECTIONS)  # swap in, while the server keeps serving
    r = await post_report(http, server.url, again["credential"], report_body(key, 2, mem_avail=5))
    assert r.status_code == 200 and r.json()["previous_sequence"] == 1, r.text
