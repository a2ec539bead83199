"""The read-only operator scope: a viewer token reads metrics, the inventory
and the audit log, and gets 403 problem+json on every write; the matrix is every route the app
has, so a new route cannot slip past it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import asyncpg
import pytest

from api.http.app import create_app
from api.services.scopes import OperatorTokens, viewer_may

PARAM = re.compile(r"\{[^}]+\}")
# Routes with their own authentication (none, the agent's node credential, or the console's login
# cookie, tested below), or the OpenAPI document: not operator routes.
NOT_OPERATOR = re.compile(r"^(/api/v1/health|/api/v1/agent/(enroll|reports)|/schema|/console)")


def operator_routes() -> list[tuple[str, str]]:
    out = []
    for route in create_app().routes:
        if NOT_OPERATOR.match(route.path):
            continue
        for method in sorted(getattr(route, "methods", set()) - {"OPTIONS", "HEAD"}):
            out.append((method, route.path))
    return out


async def event_count(pool: asyncpg.Pool) -> int:
    async with pool.acquire() as conn:
        n: int = await conn.fetchval("SELECT count(*) FROM events")
    return n


def test_the_matrix_covers_reads_and_writes() -> None:
    routes = operator_routes()
    reads = [r for r in routes if viewer_may(*r)]
    writes = [r for r in routes if not viewer_may(*r)]
    assert ("GET", "/metrics") in reads and ("GET", "/api/v1/hardware/nodes") in reads
    assert ("GET", "/api/v1/hardware/events") in reads and ("GET", "/api/v1/sd/prometheus") in reads
    for must_refuse in (
        ("POST", "/api/v1/hardware/refresh"),
        ("POST", "/api/v1/enrollment-tokens"),
        ("GET", "/api/v1/enrollment-tokens"),
        ("GET", "/api/v1/agent-credentials"),
    ):
        assert must_refuse in writes, must_refuse
    assert any("lease" in p and m == "POST" for m, p in writes)
    assert any("decommission" in p for _, p in writes)


async def test_viewer_reads_everything_it_may_and_is_refused_every_write(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    await api.refresh()
    node_id = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]["id"]
    created = await OperatorTokens(api.pool).create(ttl_seconds=3600, description="grafana")
    viewer = {"Authorization": f"Bearer {created.token}"}
    before = await event_count(api.pool)
    checked = 0
    for method, template in operator_routes():
        path = PARAM.sub(node_id, template)
        r = await api.client.request(method, path, headers=viewer, json={})
        if viewer_may(method, template):
            assert r.status_code in (200, 404), (method, path, r.status_code, r.text)
        else:
            assert r.status_code == 403, (method, path, r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/problem+json")
            assert r.json()["type"].endswith("insufficient-scope"), r.text
        checked += 1
    assert checked >= 15
    assert await event_count(api.pool) == before, "nothing a viewer sent was written"
    # the reads answer what the operator sees
    assert (await api.client.get("/metrics", headers=viewer)).text.count("modelforge_build_info") >= 1
    nodes = (await api.client.get("/api/v1/hardware/nodes", headers=viewer)).json()["items"]
    assert [n["id"] for n in nodes] == [node_id]


async def test_revoked_expired_and_forged_viewer_tokens_are_401(make_api) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    tokens = OperatorTokens(api.pool)
    live = await tokens.create(ttl_seconds=None)
    revoked = await tokens.create(ttl_seconds=None)
    expired = await tokens.create(ttl_seconds=3600)
    async with api.pool.acquire() as conn:
        await conn.execute(
            "UPDATE operator_tokens SET expires_at = now() - interval '1 second' WHERE token_id = $1",
            expired.token_id,
        )
    await tokens.revoke(revoked.token_id)
    forged = live.token[:-4] + "AAAA"

    async def status(token: str) -> int:
        r = await api.client.get("/api/v1/hardware/nodes", headers={"Authorization": f"Bearer {token}"})
        return r.status_code

    assert await status(live.token) == 200
    assert [await status(t) for t in (revoked.token, expired.token, forged, "mfv_nothing")] == [401] * 4
    listed = {t.token_id: t.status for t in await tokens.list()}
    assert listed == {live.token_id: "active", revoked.token_id: "revoked", expired.token_id: "expired"}


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env["MODELFORGE_DATABASE_URL"] = dsn
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.usefixtures("pool")
async def test_cli_mints_lists_and_revokes_a_viewer_token(make_api, database_dsn: str) -> None:  # type: ignore[no-untyped-def]
    api = make_api()
    made = cli(database_dsn, "viewer-token", "create", "--ttl", "7d", "--description", "prometheus")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert token.startswith("mfv_") and "shown once" in made.stderr
    auth = {"Authorization": f"Bearer {token}"}
    assert (await api.client.get("/metrics", headers=auth)).status_code == 200
    assert (await api.client.post("/api/v1/hardware/refresh", headers=auth)).status_code == 403
    listed = cli(database_dsn, "viewer-token", "list")
    token_id = token.split("_")[1]
    assert listed.returncode == 0 and token_id in listed.stdout and "prometheus" in listed.stdout
    assert token not in listed.stdout, "the secret is never shown again"
    gone = cli(database_dsn, "viewer-token", "revoke", token_id)
    assert gone.returncode == 0 and "revoked" in gone.stdout
    assert (await api.client.get("/metrics", headers=auth)).status_code == 401
    missing = cli(database_dsn, "viewer-token", "revoke", "0" * 32)
    assert missing.returncode != 0 and "no viewer token" in (missing.stderr + missing.stdout)


async def test_a_viewer_token_signs_in_to_the_read_only_console(make_api) -> None:  # type: ignore[no-untyped-def]
    from api.http.console.routes import COOKIE

    api = make_api()
    await api.refresh()
    created = await OperatorTokens(api.pool).create(ttl_seconds=3600, description="on-call")
    login = await api.client.post("/console/login", data={"token": created.token, "next": "/console/"})
    assert login.status_code in (302, 303), login.text
    assert COOKIE in login.cookies or COOKIE in api.client.cookies
    api.client.cookies.set(COOKIE, created.token)
    page = await api.client.get("/console/")
    assert page.status_code == 200 and "Fleet" in page.text
    await OperatorTokens(api.pool).revoke(created.token_id)
    api.client.cookies.set(COOKIE, created.token)
    refused = await api.client.get("/console/")
    assert refused.status_code in (302, 303), "a revoked viewer token is signed out"
