"""The fast path of the agent's report (api/http/fast_report.py) answers exactly what the route answers.

Each request is sent twice on the same state: with its body in one piece and a Content-Length,
which the fast path may answer, and as a chunked stream without one, which it never does, so the
second answer is always the route's own. Status, headers and bytes must be the same (the server's
clock is held still, so the acknowledgements' `received_at` agree), and the fast path must have
answered exactly the plain cases."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from api.http import fast_report
from api.wiring import Services
from domain.node import node_id_for
from tests.agent_support import report_body

OP = "op-token-fast-report"
KEYS = ("fast-report-node-1", "fast-report-node-2")
NOW = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)


class Twin:
    def __init__(self, client: httpx.AsyncClient, services: Services) -> None:
        self.client = client
        self.services = services
        self.credentials: dict[str, str] = {}
        self.fast = 0  # requests the fast path took

    def headers(self, key: str, **extra: str) -> dict[str, str]:
        return {
            "Authorization": f"Bearer {self.credentials[key]}",
            "Content-Type": "application/json",
            **extra,
        }

    async def post(
        self, body: bytes, headers: dict[str, str], *, chunked: bool, query: str = ""
    ) -> httpx.Response:
        async def pieces() -> AsyncIterator[bytes]:
            yield body[: len(body) // 2]
            yield body[len(body) // 2 :]

        content: Any = pieces() if chunked else body
        return await self.client.post(f"/api/v1/agent/reports{query}", content=content, headers=headers)

    async def answers(
        self, body: bytes, headers: dict[str, str], query: str = ""
    ) -> tuple[httpx.Response, httpx.Response, bool]:
        """The fast path's answer, then the route's to the same request on the same state, and
        whether the fast path answered the first."""
        before = self.fast
        fast = await self.post(body, headers, chunked=False, query=query)
        went_fast = self.fast == before + 1
        plain = await self.post(body, headers, chunked=True, query=query)
        assert self.fast == before + went_fast, "a chunked body never takes the fast path"
        return fast, plain, went_fast


def same(fast: httpx.Response, plain: httpx.Response) -> None:
    assert (fast.status_code, dict(fast.headers), fast.content) == (
        plain.status_code,
        dict(plain.headers),
        plain.content,
    )


@pytest.fixture
async def twin(pool: asyncpg.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Twin]:
    from api.config import ServerConfig
    from api.http.app import create_app
    from api.http.context import AppContext
    from api.services.reads.repository import HardwareRepository
    from api.wiring import Services, build_service
    from runtime.secrets import digest

    service = build_service(pool, ServerConfig(state_dir=tmp_path / "server", node_id="server-host"))
    services = Services(service, HardwareRepository(pool))
    services.reports.clock = lambda: NOW
    context = AppContext(
        pool=pool,
        service=service,
        repository=services.repository,
        admin_token_hash=digest(OP),
        services=services,
    )
    app = create_app(context)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        twin = Twin(client, services)
        plain = fast_report._plain

        def counted(*args: Any) -> Any:
            taken = plain(*args)
            twin.fast += taken is not None
            return taken

        monkeypatch.setattr(fast_report, "_plain", counted)
        for key in KEYS:
            token = (await services.enrollment.create_token(600, 1)).token
            r = await client.post(
                "/api/v1/agent/enroll",
                json={"identity_key": key, "identity_source": "configured", "hostname": "h"},
                headers={"Authorization": f"Bearer {token}"},
            )
            assert r.status_code == 201, r.text
            twin.credentials[key] = str(r.json()["credential"])
        yield twin


async def test_an_accepted_report_is_acknowledged_as_the_route_does(twin: Twin) -> None:
    # Two nodes at the same point: the first's report goes fast, the second's to the route.
    first, second = KEYS
    for sequence, stream in ((1, "inventory"), (2, "telemetry"), (3, "telemetry")):
        fast = await twin.post(
            report_body(first, sequence, stream=stream), twin.headers(first), chunked=False
        )
        plain = await twin.post(
            report_body(second, sequence, stream=stream), twin.headers(second), chunked=True
        )
        assert fast.status_code == 200, fast.text
        assert json.loads(fast.content)["status"] == "accepted"
        other = plain.content.replace(node_id_for(second).encode(), node_id_for(first).encode())
        assert (fast.status_code, dict(fast.headers), fast.content) == (
            plain.status_code,
            dict(plain.headers),
            other,
        )
    assert twin.fast == 3


def _mutated(key: str, sequence: int, change: Callable[[dict[str, Any]], None]) -> bytes:
    tree = json.loads(report_body(key, sequence))
    change(tree)
    return json.dumps(tree).encode()


async def test_refusals_and_replays_are_answered_as_the_route_does(twin: Twin) -> None:
    key, other = KEYS
    accepted = await twin.post(report_body(key, 1, stream="inventory"), twin.headers(key), chunked=False)
    assert accepted.status_code == 200, accepted.text
    await twin.post(report_body(key, 5), twin.headers(key), chunked=False)
    cases: list[tuple[str, bytes, dict[str, str], int]] = [
        ("an unchanged retry: duplicate", report_body(key, 5), twin.headers(key), 200),
        ("a changed retry: conflict", report_body(key, 5, mem_avail=7), twin.headers(key), 409),
        ("no credential", report_body(key, 6), {"Authorization": "Bearer mfc_nope.nope"}, 401),
        ("another node's credential", report_body(key, 6), twin.headers(other), 403),
        ("malformed JSON", b'{"protocol": 1', twin.headers(key), 400),
        (
            "a NUL in a string",
            report_body(key, 6).replace(b'"gpu-host-1"', b'"gpu\\u0000host"'),
            twin.headers(key),
            400,
        ),
        (
            "a raw NUL byte",
            report_body(key, 6).replace(b'"gpu-host-1"', b'"gpu\x00host"'),
            twin.headers(key),
            400,
        ),
        (
            "nested deeper than the guard allows",
            report_body(key, 6).replace(b'"collectors":[', b'"collectors":[' + b"[" * 70 + b"]" * 70 + b","),
            twin.headers(key),
            400,
        ),
        ("outside the contract", _mutated(key, 6, lambda t: t.update(sequence=0)), twin.headers(key), 400),
        ("unknown protocol", _mutated(key, 6, lambda t: t.update(protocol=99)), twin.headers(key), 400),
        (
            "a malformed send time",
            report_body(key, 5),
            twin.headers(key, **{"Modelforge-Agent-Sent-At": "yesterday"}),
            200,
        ),
    ]
    for name, body, headers, status in cases:
        fast, plain, went_fast = await twin.answers(body, headers)
        assert fast.status_code == status, (name, fast.text)
        assert went_fast, name
        same(fast, plain)
        if name in ("a NUL in a string", "a raw NUL byte"):
            assert fast.json()["type"].endswith("nul-character"), (name, fast.text)
        if name == "nested deeper than the guard allows":
            assert fast.json()["type"].endswith("nesting-too-deep"), fast.text
        if status >= 400:
            assert fast.headers["content-type"] == "application/problem+json", name


async def test_what_the_fast_path_leaves_to_the_route(twin: Twin) -> None:
    key = KEYS[0]
    body = report_body(key, 1, stream="inventory")
    # A query string: the route refuses unknown parameters.
    fast, plain, went_fast = await twin.answers(body, twin.headers(key), query="?x=1")
    assert (fast.status_code, went_fast) == (400, False)
    same(fast, plain)
    # No credential header at all.
    fast, plain, went_fast = await twin.answers(body, {"Content-Type": "application/json"})
    assert (fast.status_code, went_fast) == (401, False)
    same(fast, plain)
    # A body over the limit, announced: 413 problem+json.
    big = b" " * (1024 * 1024 + 1)
    r = await twin.post(big, twin.headers(key), chunked=False)
    assert r.status_code == 413 and r.headers["content-type"] == "application/problem+json"
    assert twin.fast == 0
