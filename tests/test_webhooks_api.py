"""Webhook subscriptions over the HTTP API: created, listed, deleted as audited events; bad
input refused with 400 problem+json naming the field, nothing stored; the secret never shown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from api.config import ServerConfig
from api.http.app import create_app
from api.http.context import AppContext
from api.services.reads.cursors import encode_id_cursor
from api.wiring import build_services
from runtime.secrets import digest
from tests.conftest import OPERATOR_TOKEN
from tests.webhook_support import SECRET, Receiver

AUTH = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


def make_client(pool: asyncpg.Pool, tmp_path: Path, *, allow_private: bool) -> httpx.AsyncClient:
    config = ServerConfig(
        state_dir=tmp_path / "state", node_id="webhook-test", webhook_allow_private=allow_private
    )
    services = build_services(pool, config)
    context = AppContext(
        pool=pool,
        service=services.inventory,
        repository=services.repository,
        admin_token_hash=digest(OPERATOR_TOKEN),
        services=services,
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(context)), base_url="http://test")


@pytest.fixture
async def client(pool: asyncpg.Pool, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with make_client(pool, tmp_path, allow_private=True) as c:
        yield c


@pytest.fixture
def receiver() -> Any:
    r = Receiver().start()
    yield r
    r.stop()


async def webhook_events(pool: asyncpg.Pool) -> list[dict[str, Any]]:
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT event_type, data::text AS data_json FROM events WHERE stream_id = 'webhooks' ORDER BY global_position"
        )
    return [{"type": r["event_type"], "data": r["data_json"]} for r in rows]


async def test_a_subscription_is_created_listed_and_deleted_as_audited_events(
    client: httpx.AsyncClient, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    refreshed = await client.post("/api/v1/hardware/refresh", headers=AUTH)
    node = refreshed.json()["node_id"]
    r = await client.post(
        "/api/v1/webhooks",
        headers=AUTH,
        json={"url": receiver.url, "secret": SECRET, "event_types": ["ACCELERATOR_MISSING"], "node_id": node},
    )
    assert r.status_code == 201, r.text
    body = r.json()
    sid = body["subscription_id"]
    assert sid.startswith("wh_")
    assert (
        body["state"] == "active"
        and body["event_types"] == ["ACCELERATOR_MISSING"]
        and body["node_id"] == node
    )
    assert "secret" not in r.text and SECRET not in r.text

    listed = (await client.get("/api/v1/webhooks", headers=AUTH)).json()["items"]
    assert [w["subscription_id"] for w in listed] == [sid]
    assert (await client.get(f"/api/v1/webhooks/{sid}", headers=AUTH)).json()["url"] == receiver.url

    events = await webhook_events(pool)
    assert [e["type"] for e in events] == ["WEBHOOK_SUBSCRIBED"]
    assert sid in events[0]["data"] and SECRET not in events[0]["data"]
    assert f'"destination":"http://127.0.0.1:{receiver.port}"' in events[0]["data"].replace(" ", "")
    assert receiver.url not in events[0]["data"], "the URL may hold a receiver's token: not in the log"
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT convert_from(secret, 'UTF8') FROM webhook_secrets") == SECRET

    r = await client.delete(f"/api/v1/webhooks/{sid}", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "deleted"
    assert (await client.get("/api/v1/webhooks", headers=AUTH)).json()["items"] == []
    assert (await client.delete(f"/api/v1/webhooks/{sid}", headers=AUTH)).status_code == 404
    assert (await client.get("/api/v1/webhooks/wh_nope", headers=AUTH)).status_code == 404
    assert [e["type"] for e in await webhook_events(pool)] == ["WEBHOOK_SUBSCRIBED", "WEBHOOK_UNSUBSCRIBED"]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM webhook_secrets") == 0


async def test_a_resume_is_an_audited_event_and_clears_the_retry_state(
    client: httpx.AsyncClient, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    sid = (
        await client.post("/api/v1/webhooks", headers=AUTH, json={"url": receiver.url, "secret": SECRET})
    ).json()["subscription_id"]
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE webhook_subscriptions SET state = 'failing', attempts = 9, failing_since = now(), "
            "next_attempt_at = now() + interval '1 hour'"
        )
    r = await client.post(f"/api/v1/webhooks/{sid}/resume", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "active" and r.json()["attempts"] == 0 and r.json()["next_attempt_at"] is None
    assert [e["type"] for e in await webhook_events(pool)] == ["WEBHOOK_SUBSCRIBED", "WEBHOOK_RESUMED"]
    assert (await client.get(f"/api/v1/webhooks/{sid}/deliveries", headers=AUTH)).json() == {
        "items": [],
        "next_cursor": None,
    }


async def test_metrics_show_each_subscription_and_its_state(
    client: httpx.AsyncClient, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    sids = [
        (
            await client.post("/api/v1/webhooks", headers=AUTH, json={"url": receiver.url, "secret": SECRET})
        ).json()["subscription_id"]
        for _ in range(2)
    ]
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE webhook_subscriptions SET state = 'failing', attempts = 8, delivered = 41, rejected = 2, "
            "retried = 9, last_delivered_at = now() WHERE subscription_id = $1",
            sids[0],
        )
    text = (await client.get("/metrics", headers=AUTH)).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("modelforge_webhook")
    }
    assert samples[("modelforge_webhook_subscriptions", (("state", "failing"),))] == 1
    assert samples[("modelforge_webhook_subscriptions", (("state", "active"),))] == 1
    assert samples[("modelforge_webhook_state", (("state", "failing"), ("subscription_id", sids[0])))] == 1
    assert samples[("modelforge_webhook_state", (("state", "active"), ("subscription_id", sids[1])))] == 1
    key = ("modelforge_webhook_deliveries_total", (("outcome", "delivered"), ("subscription_id", sids[0])))
    assert samples[key] == 41
    assert samples[("modelforge_webhook_failed_attempts", (("subscription_id", sids[0]),))] == 8
    assert (
        "modelforge_webhook_last_delivered_timestamp_seconds",
        (("subscription_id", sids[1]),),
    ) not in samples
    assert receiver.url not in text


BAD = [
    ({"url": "ftp://127.0.0.1/x"}, "url"),
    ({"url": "file:///etc/passwd"}, "url"),
    ({"url": "http://user:pw@127.0.0.1:{port}/hook"}, "url"),
    ({"url": "http://127.0.0.1:{port}/hook#frag"}, "url"),
    ({"url": "http://no-such-host.invalid/hook"}, "url"),
    ({"url": "http://127.0.0.1:{closed}/hook"}, "url"),
    ({"secret": "short-secret"}, "secret"),
    ({"secret": "whsec_c2hvcnQ="}, "secret"),
    ({"secret": "whsec_not base64!"}, "secret"),
    ({"event_types": ["NO_SUCH_EVENT"]}, "event_types"),
    # a hostname or identity key is not a node's id: such a subscription would never deliver
    ({"node_id": "gpu-host-a"}, "node_id"),
]


async def test_bad_input_is_refused_naming_the_field_and_nothing_is_stored(
    client: httpx.AsyncClient, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    for change, field in BAD:
        body: dict[str, Any] = {"url": receiver.url, "secret": SECRET} | change
        body["url"] = body["url"].format(port=receiver.port, closed=closed)
        r = await client.post("/api/v1/webhooks", headers=AUTH, json=body)
        assert r.status_code == 400, (change, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
        problem = r.json()
        assert problem["field"] == field and problem["detail"].startswith(field), problem
    r = await client.post(
        "/api/v1/webhooks", headers=AUTH, json={"url": receiver.url, "secret": SECRET, "x": 1}
    )
    assert r.status_code == 400
    r = await client.post(
        "/api/v1/webhooks",
        headers=AUTH,
        json={"url": receiver.url, "secret": SECRET, "event_classes": ["bogus"]},
    )
    assert r.status_code == 400 and "event_classes" in r.text
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM webhook_subscriptions") == 0
        assert await conn.fetchval("SELECT count(*) FROM webhook_secrets") == 0
    assert await webhook_events(pool) == []


async def test_loopback_destinations_are_refused_unless_allowed(
    pool: asyncpg.Pool, tmp_path: Path, receiver: Receiver
) -> None:
    async with make_client(pool, tmp_path, allow_private=False) as strict:
        for url in (
            receiver.url,
            f"http://localhost:{receiver.port}/",
            "http://169.254.169.254/latest",
            "http://[::1]/",
        ):
            r = await strict.post("/api/v1/webhooks", headers=AUTH, json={"url": url, "secret": SECRET})
            assert r.status_code == 400, (url, r.text)
            assert r.json()["field"] == "url"
            assert "MODELFORGE_WEBHOOK_ALLOW_PRIVATE" in r.json()["detail"] or "resolve" in r.json()["detail"]
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM webhook_subscriptions") == 0


async def test_a_viewer_token_may_not_touch_webhooks(client: httpx.AsyncClient, pool: asyncpg.Pool) -> None:
    from api.services.scopes import OperatorTokens

    viewer = await OperatorTokens(pool).create(ttl_seconds=None)
    headers = {"Authorization": f"Bearer {viewer.token}"}
    assert (await client.get("/api/v1/webhooks", headers=headers)).status_code == 403
    r = await client.post("/api/v1/webhooks", headers=headers, json={"url": "http://x/", "secret": SECRET})
    assert r.status_code == 403
    await asyncio.sleep(0)


async def test_the_console_lists_subscriptions_with_their_state_and_origin_only(
    client: httpx.AsyncClient, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    from api.http.console.routes import COOKIE

    url = receiver.url + "/T0123/receiver-token-in-the-path"
    sid = (await client.post("/api/v1/webhooks", headers=AUTH, json={"url": url, "secret": SECRET})).json()[
        "subscription_id"
    ]
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE webhook_subscriptions SET state = 'failing', failing_since = now(), last_error = 'HTTP 503'"
        )
    client.cookies.set(COOKIE, OPERATOR_TOKEN)
    page = await client.get("/console/webhooks")
    assert page.status_code == 200, page.text
    (row,) = [r for r in page.text.split("<tr") if f'data-subscription="{sid}"' in r]
    assert "failing" in row and "HTTP 503" in row and f"http://127.0.0.1:{receiver.port}" in row
    assert "receiver-token-in-the-path" not in page.text
    assert 'href="/console/webhooks"' in (await client.get("/console/")).text


async def test_deliveries_are_paged_newest_first_across_page_boundaries(
    client: httpx.AsyncClient, pool: asyncpg.Pool, receiver: Receiver
) -> None:
    sids = [
        (
            await client.post("/api/v1/webhooks", headers=AUTH, json={"url": receiver.url, "secret": SECRET})
        ).json()["subscription_id"]
        for _ in range(2)
    ]
    # Seven attempts of the first subscription, three of the second's between them.
    async with pool.acquire() as conn:
        for i in range(10):
            await conn.execute(
                "INSERT INTO webhook_deliveries (subscription_id, global_position, event_type, attempt, "
                "outcome, status_code, duration_ms) VALUES ($1, $2, 'ACCELERATOR_MISSING', 1, 'delivered', 200, 1.5)",
                sids[1] if i % 3 == 2 else sids[0],
                i + 1,
            )
        newest_first = [
            r["delivery_id"]
            for r in await conn.fetch(
                "SELECT delivery_id FROM webhook_deliveries WHERE subscription_id = $1 ORDER BY delivery_id DESC",
                sids[0],
            )
        ]
    assert len(newest_first) == 7
    url = f"/api/v1/webhooks/{sids[0]}/deliveries"

    async def every_page(limit: int) -> tuple[list[int], list[int]]:
        seen: list[int] = []
        sizes: list[int] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": limit} | ({"cursor": cursor} if cursor else {})
            r = await client.get(url, params=params, headers=AUTH)
            assert r.status_code == 200, r.text
            seen += [d["delivery_id"] for d in r.json()["items"]]
            sizes.append(len(r.json()["items"]))
            cursor = r.json()["next_cursor"]
            if cursor is None:
                return seen, sizes

    # Pages cut inside the attempts, one at a time, a page that ends exactly at the oldest (no empty
    # page after it) and one larger than them all: each attempt once, newest first.
    for limit, sizes in ((3, [3, 3, 1]), (1, [1] * 7), (7, [7]), (500, [7])):
        assert await every_page(limit) == (newest_first, sizes), limit

    first = (await client.get(url, params={"limit": 3}, headers=AUTH)).json()["next_cursor"]
    for bad in (first + "x", "not-a-cursor"):
        r = await client.get(url, params={"cursor": bad}, headers=AUTH)
        assert r.status_code == 400 and r.json()["type"].endswith("/invalid-cursor"), r.text
    other = await client.get(f"/api/v1/webhooks/{sids[1]}/deliveries", params={"cursor": first}, headers=AUTH)
    assert other.status_code == 400 and other.json()["type"].endswith("/invalid-cursor"), "another's cursor"
    another_list = await client.get(url, params={"cursor": encode_id_cursor(sids[0])}, headers=AUTH)
    assert another_list.status_code == 400, "a cursor of another list"
