"""Hostile input against the real app (in-process, real PostgreSQL): every hostile request that a server
route can reject gets a 4xx application/problem+json, nothing is written, and nothing is
logged as an unexpected error. Also: revocation on every authentication, readiness vs liveness."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import structlog

from api.wiring import Services
from domain.node import node_id_for
from tests.agent_support import report_body

OP = "op-token-hostile"
KEY = "hostile-node-1"


class Target:
    def __init__(self, client: httpx.AsyncClient, pool: asyncpg.Pool, services: Services) -> None:
        self.client = client
        self.pool = pool
        self.services = services
        self.credential = ""
        self.other_credential = ""
        self.token = ""
        self.node_id = node_id_for(KEY)
        self.sequence = 0

    async def events(self) -> int:
        async with self.pool.acquire() as conn:
            return int(await conn.fetchval("SELECT count(*) FROM events"))

    def headers(self, who: str) -> dict[str, str]:
        secret = {"op": OP, "node": self.credential, "enroll": self.token, "none": ""}[who]
        h = {"Content-Type": "application/json"}
        if secret:
            h["Authorization"] = f"Bearer {secret}"
        return h

    async def enroll(self, key: str) -> str:
        token = (await self.services.enrollment.create_token(600, 1)).token
        r = await self.client.post(
            "/api/v1/agent/enroll",
            json={"identity_key": key, "identity_source": "configured", "hostname": "h"},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 201, r.text
        return str(r.json()["credential"])


@pytest.fixture
async def target(pool: asyncpg.Pool, tmp_path: Path) -> AsyncIterator[Target]:
    from api.config import ServerConfig
    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.reads.repository import HardwareRepository
    from api.wiring import Services, build_service
    from runtime.secrets import digest

    service = build_service(pool, ServerConfig(state_dir=tmp_path / "server", node_id="server-host"))
    services = Services(service, HardwareRepository(pool))
    context = AppContext(
        pool=pool,
        service=service,
        repository=services.repository,
        admin_token_hash=digest(OP),
        services=services,
    )
    app = create_app(context)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        t = Target(client, pool, services)
        t.credential = await t.enroll(KEY)
        t.other_credential = await t.enroll("hostile-node-2")
        t.token = str((await services.enrollment.create_token(600, 5)).token)
        r = await client.post("/api/v1/agent/reports", content=report_body(KEY, 1), headers=t.headers("node"))
        assert r.status_code == 200, r.text
        yield t


def report(mutate: Any, sequence: int = 2) -> bytes:
    """A valid report of KEY, changed by `mutate` (on its JSON tree), encoded again."""
    tree = json.loads(report_body(KEY, sequence))
    mutate(tree)
    return json.dumps(tree).encode()


def _set(path: str, value: Any) -> Any:
    def mutate(tree: Any) -> None:
        *parents, last = path.split(".")
        node = tree
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value

    return mutate


def nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


NUL = "\u0000"
LATE = "9999-12-31T23:59:59-23:59"
EARLY = "0001-01-01T00:00:00+23:59"
NODE = "{node}"  # replaced by the enrolled node's id

# (name, method, path, caller, body, expected status)
CASES: list[tuple[str, str, str, str, bytes | None, int]] = [
    # 1. reports the database cannot store
    (
        "report NUL hostname",
        "POST",
        "/agent/reports",
        "node",
        report(_set("observation.host.hostname", "a" + NUL)),
        400,
    ),
    (
        "report NUL os.name",
        "POST",
        "/agent/reports",
        "node",
        report(_set("observation.host.os.name.value", NUL)),
        400,
    ),
    (
        "report NUL gpu uuid",
        "POST",
        "/agent/reports",
        "node",
        report(_set("observation.nvml.accelerators.0.uuid", "GPU-" + NUL)),
        400,
    ),
    (
        "report NUL mount",
        "POST",
        "/agent/reports",
        "node",
        report(_set("observation.host.storage.0.mount", "/" + NUL)),
        400,
    ),
    (
        "report observed_at past year 9999",
        "POST",
        "/agent/reports",
        "node",
        report(_set("observed_at", LATE)),
        400,
    ),
    (
        "report observed_at before year 1",
        "POST",
        "/agent/reports",
        "node",
        report(_set("observed_at", EARLY)),
        400,
    ),
    (
        "report raw NUL byte",
        "POST",
        "/agent/reports",
        "node",
        report_body(KEY, 2).replace(b'"h', b'"\x00', 1),
        400,
    ),
    ("report nested 2000 deep", "POST", "/agent/reports", "node", nested(2000), 400),
    ("report sequence past int64", "POST", "/agent/reports", "node", report(_set("sequence", 2**63)), 400),
    # 3. operator routes: NUL in path and query parameters
    ("events type NUL", "GET", "/hardware/events?type=%00", "op", None, 400),
    ("events node_id NUL", "GET", "/hardware/events?node_id=a%00b", "op", None, 400),
    ("events accelerator_uuid NUL", "GET", "/hardware/events?accelerator_uuid=%00", "op", None, 400),
    ("events cursor NUL", "GET", "/hardware/events?cursor=%00", "op", None, 400),
    ("node id NUL", "GET", "/hardware/nodes/%00", "op", None, 400),
    ("nodes cursor NUL", "GET", "/hardware/nodes?cursor=%00", "op", None, 400),
    ("accelerators node_id NUL", "GET", "/hardware/accelerators?node_id=%00", "op", None, 400),
    ("accelerator id NUL", "GET", "/hardware/accelerators/x%00", "op", None, 400),
    ("credentials node_id NUL", "GET", "/agent-credentials?node_id=%00", "op", None, 400),
    ("streams node_id NUL", "GET", "/agent-streams?node_id=%00", "op", None, 400),
    ("leases node id NUL", "GET", "/hardware/nodes/%00/leases", "op", None, 400),
    ("revoke token id NUL", "POST", "/enrollment-tokens/%00/revoke", "op", None, 400),
    ("revoke credential id NUL", "POST", "/agent-credentials/%00/revoke", "op", None, 400),
    ("preview node id NUL", "POST", "/hardware/nodes/%00/decommission/preview", "op", None, 400),
    # 3. operator routes: NUL in body strings
    (
        "lease owner NUL",
        "POST",
        f"/hardware/nodes/{NODE}/leases",
        "op",
        json.dumps({"owner": NUL, "reason": "r"}).encode(),
        400,
    ),
    (
        "lease reason NUL",
        "POST",
        f"/hardware/nodes/{NODE}/leases",
        "op",
        json.dumps({"owner": "o", "reason": "a" + NUL}).encode(),
        400,
    ),
    (
        "token description NUL",
        "POST",
        "/enrollment-tokens",
        "op",
        json.dumps({"ttl_seconds": 60, "uses": 1, "description": NUL}).encode(),
        400,
    ),
    (
        "revoke reason NUL",
        "POST",
        "/enrollment-tokens/0/revoke",
        "op",
        json.dumps({"reason": NUL}).encode(),
        400,
    ),
    (
        "decommission reason NUL",
        "POST",
        f"/hardware/nodes/{NODE}/decommission",
        "op",
        json.dumps({"generation": 1, "digest": "d", "reason": NUL}).encode(),
        400,
    ),
    (
        "enroll hostname NUL",
        "POST",
        "/agent/enroll",
        "enroll",
        json.dumps({"identity_key": "k9", "identity_source": "configured", "hostname": NUL}).encode(),
        400,
    ),
    (
        "enroll identity_key NUL",
        "POST",
        "/agent/enroll",
        "enroll",
        json.dumps({"identity_key": "k" + NUL, "identity_source": "configured", "hostname": "h"}).encode(),
        400,
    ),
    # 3. operator routes: dates out of range
    ("nodes as_of past 9999", "GET", "/hardware/nodes?as_of=" + LATE, "op", None, 400),
    (
        "node as_of before year 1",
        "GET",
        f"/hardware/nodes/{NODE}?as_of=" + EARLY.replace("+", "%2B"),
        "op",
        None,
        400,
    ),
    ("accelerators as_of past 9999", "GET", "/hardware/accelerators?as_of=" + LATE, "op", None, 400),
    (
        "events since before year 1",
        "GET",
        "/hardware/events?since=" + EARLY.replace("+", "%2B"),
        "op",
        None,
        400,
    ),
    ("events until past 9999", "GET", "/hardware/events?until=" + LATE, "op", None, 400),
    (
        "decommission generation past int64",
        "POST",
        f"/hardware/nodes/{NODE}/decommission",
        "op",
        json.dumps({"generation": 2**63, "digest": "d", "reason": "r"}).encode(),
        400,
    ),
    # 3. depth and token order: no token, a deep body -> 401 before any parsing
    ("enroll no token, nested 2000 deep", "POST", "/agent/enroll", "none", nested(2000), 401),
    ("report no token, nested 2000 deep", "POST", "/agent/reports", "none", nested(2000), 401),
    ("token create, no token, nested 2000 deep", "POST", "/enrollment-tokens", "none", nested(2000), 401),
    ("enroll nested 2000 deep", "POST", "/agent/enroll", "enroll", nested(2000), 400),
    ("lease nested 2000 deep", "POST", f"/hardware/nodes/{NODE}/leases", "op", nested(2000), 400),
    ("token create nested 65 deep", "POST", "/enrollment-tokens", "op", nested(65), 400),
]


async def test_hostile_input_is_refused_with_a_problem_and_changes_nothing(target: Target) -> None:
    """The whole table on one database (a database per case costs seconds each); every case that
    does not hold is named in the failure."""
    failures: list[str] = []
    for name, method, path, who, body, status in CASES:
        before = await target.events()
        with structlog.testing.capture_logs() as logs:
            r = await target.client.request(
                method,
                "/api/v1" + path.replace(NODE, target.node_id),
                content=body,
                headers=target.headers(who),
            )
        problem = (
            r.json() if r.headers.get("content-type", "").startswith("application/problem+json") else None
        )
        errors = [e["event"] for e in logs if e["log_level"] in ("error", "critical") or "exc_info" in e]
        if r.status_code != status or problem is None:
            failures.append(f"{name}: {r.status_code} {r.headers.get('content-type')} {r.text[:200]}")
        elif not (problem["status"] == status and problem["type"] and problem["title"] and problem["detail"]):
            failures.append(f"{name}: incomplete problem {problem}")
        elif await target.events() != before:
            failures.append(f"{name}: events were written")
        elif errors:
            failures.append(f"{name}: logged {errors}")
    assert not failures, "\n".join(failures)


async def test_a_valid_report_still_passes_the_guards(target: Target) -> None:
    """The checks refuse what they should and nothing else: an escaped backslash before u0000 is
    text, 64 levels of nesting are allowed, a report with strings full of escapes is accepted."""
    from api.http.guards import check_body

    check_body(b'{"a":"\\\\u0000"}')
    check_body(nested(64))
    body = report(_set("observation.host.hostname", 'quo"te\\back\\\\slash'))
    r = await target.client.post("/api/v1/agent/reports", content=body, headers=target.headers("node"))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "accepted"
    node = await target.client.get(f"/api/v1/hardware/nodes/{target.node_id}", headers=target.headers("op"))
    assert node.json()["hostname"] == 'quo"te\\back\\\\slash'


async def test_a_revoked_credential_gets_401_even_once_it_was_used(target: Target) -> None:
    """A credential used (and so remembered as verified) and then revoked: 401 for any report,
    including one for another node (403 credential-node-mismatch otherwise) and a malformed one
    (400 otherwise)."""
    listed = await target.services.credentials.list_credentials(target.node_id)
    await target.services.credentials.revoke_credential(listed[0].credential_id, "test")
    before = await target.events()
    for body in (report_body(KEY, 2), report_body("hostile-node-2", 1), b'{"protocol": 1,'):
        r = await target.client.post("/api/v1/agent/reports", content=body, headers=target.headers("node"))
        assert r.status_code == 401, r.text
        assert r.json()["type"].endswith("/credential-revoked")
    assert await target.events() == before
    # The other node's own credential is untouched.
    r = await target.client.post(
        "/api/v1/agent/reports",
        content=report_body("hostile-node-2", 1),
        headers={"Authorization": f"Bearer {target.other_credential}", "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text


async def test_without_its_database_the_server_is_alive_but_not_ready(tmp_path: Path) -> None:
    """Nothing listens where the database should be: /health and every database route answer 503
    problem+json with Retry-After, liveness stays 200, and no traceback is logged."""
    from api.config import ServerConfig
    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.reads.repository import HardwareRepository
    from api.wiring import build_service
    from ledger.db import create_pool
    from runtime.secrets import digest
    from tests.agent_support import free_port

    pool = await create_pool(f"postgresql://postgres@127.0.0.1:{free_port()}/none", min_size=0, max_size=2)
    try:
        service = build_service(pool, ServerConfig(state_dir=tmp_path / "s", node_id="n"))
        context = AppContext(
            pool=pool, service=service, repository=HardwareRepository(pool), admin_token_hash=digest(OP)
        )
        app = create_app(context)
        auth = {"Authorization": f"Bearer {OP}"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            with structlog.testing.capture_logs() as logs:
                live = await client.get("/api/v1/health/live")
                health = await client.get("/api/v1/health")
                answers = [
                    await client.get("/api/v1/hardware/nodes", headers=auth),
                    await client.get("/api/v1/hardware/events", headers=auth),
                    await client.post(
                        "/api/v1/enrollment-tokens", json={"ttl_seconds": 60, "uses": 1}, headers=auth
                    ),
                    await client.post(
                        "/api/v1/agent/reports",
                        content=report_body(KEY, 1),
                        headers={"Authorization": "Bearer mfc_" + "0" * 32 + "_secret"},
                    ),
                ]
        assert live.status_code == 200 and live.json() == {"status": "alive"}
        assert health.status_code == 503, health.text
        assert health.json()["database"] == "unavailable"
        for r in answers:
            assert r.status_code == 503, (r.request.url, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert int(r.headers["retry-after"]) > 0
            assert r.json()["type"].endswith("/database-unavailable")
        assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
    finally:
        await pool.close()
