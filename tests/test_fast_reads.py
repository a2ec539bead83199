"""The fast path of the hot reads (api/http/fast_reads.py) answers exactly what the route answers.

Each request is sent twice: with the admin token, which the fast path may answer, and with a
viewer token, which it never does (a viewer's scope is looked up by the route's guard), so the
second answer is always the route's own. Status, headers and bytes must be the same, and the
server's /metrics must show that the fast path answered exactly the plain cases."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.services.scopes import OperatorTokens


async def fast_reads(api) -> int:  # type: ignore[no-untyped-def]
    text = (await api.client.get("/metrics", headers=api.auth)).text
    found = re.search(r"^modelforge_fast_reads_total (\d+)", text, re.MULTILINE)
    assert found, "the fast path's counter is on /metrics"
    return int(found.group(1))


@pytest.fixture
async def twin(make_api):  # type: ignore[no-untyped-def]
    api = make_api()
    await api.refresh()
    api.viewer = {
        "Authorization": f"Bearer {(await OperatorTokens(api.pool).create(ttl_seconds=3600)).token}"
    }
    api.node_id = (await api.get("/api/v1/hardware/nodes")).json()["items"][0]["id"]
    return api


async def same_answer(api, path: str, extra: dict[str, str] | None = None) -> tuple[int, bool]:  # type: ignore[no-untyped-def]
    """Send `path` as admin then as viewer; assert equal answers; (status, whether it went fast)."""
    before = await fast_reads(api)
    fast = await api.client.get(path, headers={**api.auth, **(extra or {})})
    went_fast = await fast_reads(api) == before + 1
    plain = await api.client.get(path, headers={**api.viewer, **(extra or {})})
    assert (plain.status_code, dict(plain.headers), plain.content) == (
        fast.status_code,
        dict(fast.headers),
        fast.content,
    ), path
    assert await fast_reads(api) == before + went_fast, "a viewer's read never takes the fast path"
    return fast.status_code, went_fast


async def test_a_node_read_answers_as_the_route_does_with_and_without_if_none_match(twin) -> None:  # type: ignore[no-untyped-def]
    path = f"/api/v1/hardware/nodes/{twin.node_id}"
    assert await same_answer(twin, path) == (200, True)
    etag = (await twin.client.get(path, headers=twin.auth)).headers["etag"]
    for header, expected in (
        (etag, 304),
        (f"W/{etag}", 304),
        (f'"other", {etag}', 304),
        ("*", 304),
        ('"other"', 200),
    ):
        assert await same_answer(twin, path, {"If-None-Match": header}) == (expected, True), header
    # What the route keeps for itself: a missing node, the audit's as_of, a query it refuses.
    assert await same_answer(twin, "/api/v1/hardware/nodes/no-such-node") == (404, False)
    assert await same_answer(twin, f"{path}?as_of=2026-01-01T00:00:00Z") == (404, False)
    assert await same_answer(twin, f"{path}?bogus=1") == (400, False)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", (200, True)),
        ("?limit=1", (200, True)),
        ("?limit=1000", (200, True)),
        ("?status=active&health=healthy", (200, True)),
        ("?status=missing", (200, True)),
        ("?model=NVIDIA%20H200", (200, True)),
        ("?model=NVIDIA+H200", (200, True)),
        ("?node_id=", (200, True)),  # a blank node id: no such node, an empty page
        ("?limit=", (400, False)),
        ("?node_id={node}", (200, True)),
        ("?node_id=no-such-node", (200, True)),
        ("?limit=0", (400, False)),
        ("?limit=1001", (400, False)),
        ("?limit=abc", (400, False)),
        ("?limit=05", (400, False)),  # Litestar's integers have no leading zero
        ("?limit=%C2%B2", (400, False)),  # a digit to str.isdigit, not a number
        ("?status=bogus", (400, False)),
        ("?health=sick", (400, False)),
        ("?cursor=not-a-cursor", (400, False)),
        ("?colour=green", (400, False)),
        ("?limit=1&limit=2", (200, False)),  # repeated: the route decides which counts
        ("?as_of=2026-01-01T00:00:00Z", (200, False)),
    ],
)
async def test_a_page_answers_as_the_route_does(twin, query: str, expected: tuple[int, bool]) -> None:  # type: ignore[no-untyped-def]
    path = "/api/v1/hardware/accelerators" + query.replace("{node}", twin.node_id)
    assert await same_answer(twin, path) == expected


async def test_pages_walked_by_cursor_answer_as_the_route_does(twin) -> None:  # type: ignore[no-untyped-def]
    cursor, seen = None, []
    while True:
        path = "/api/v1/hardware/accelerators?limit=1" + (f"&cursor={cursor}" if cursor else "")
        assert await same_answer(twin, path) == (200, True)
        page = (await twin.client.get(path, headers=twin.auth)).json()
        seen += [a["uuid"] for a in page["items"]]
        if not (cursor := page["next_cursor"]):
            break
    assert len(seen) == len(set(seen)) == 2


async def test_a_change_committed_before_a_fast_read_is_in_it(twin) -> None:  # type: ignore[no-untyped-def]
    path = f"/api/v1/hardware/nodes/{twin.node_id}"
    before = (await twin.client.get(path, headers=twin.auth)).json()
    twin.scenario.gpus.pop()  # a GPU leaves the host
    await twin.refresh()
    status, went_fast = await same_answer(twin, path)
    after = (await twin.client.get(path, headers=twin.auth)).json()
    assert (status, went_fast) == (200, True)
    assert after != before
    page = (await twin.client.get("/api/v1/hardware/accelerators?status=missing", headers=twin.auth)).json()
    assert len(page["items"]) == 1, "the page kept before the change is not served after it"


async def test_without_the_admin_token_the_route_answers_401(twin) -> None:  # type: ignore[no-untyped-def]
    before = await fast_reads(twin)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="}):
        for path in (f"/api/v1/hardware/nodes/{twin.node_id}", "/api/v1/hardware/accelerators"):
            r = await twin.client.get(path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.headers["content-type"].startswith("application/problem+json")
    assert await fast_reads(twin) == before


# A query string's parts: values its name takes, values that nearly pass (each name's own), other
# refused values, and names the route does not take.
_VALID = {
    "node_id": ["{node}", "no-such-node", ""],
    "status": ["active", "missing", "decommissioned"],
    "health": ["healthy", "degraded", "failed"],
    "model": ["NVIDIA H200", "NVIDIA H100"],
    "cursor": ["{cursor}"],
    "limit": ["1", "2", "100", "1000"],
    "as_of": ["2026-01-01T00:00:00Z"],
    "colour": ["green"],
}
_NEARLY = {
    "status": ["Active", "active ", "healthy"],
    "health": ["Healthy", "missing"],
    "cursor": ["not-a-cursor", "{cursor}="],
    "limit": ["05", "010", "0100", "00", "0", "1001", "-1", " 1", "+1", "1e2", "²", "1_0"],
}
_REFUSED = ["bogus", "", "é", "a&b", "a=b"]
_NAMES = st.sampled_from([*[n for n in _VALID if n not in ("as_of", "colour")] * 3, "as_of", "colour"])
_QUOTES = st.sampled_from([quote_plus, quote, lambda v: v])
_QUERIES = st.lists(
    _NAMES.flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.one_of(st.sampled_from(_VALID[n]), st.sampled_from(_NEARLY.get(n, _REFUSED) + _REFUSED)),
            _QUOTES,
        )
    ),
    max_size=3,
)


async def test_any_query_of_a_page_answers_as_the_route_does(twin) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    cursor = (await twin.client.get("/api/v1/hardware/accelerators?limit=1", headers=twin.auth)).json()[
        "next_cursor"
    ]
    went: list[bool] = []

    @settings(
        # In-process requests, ~0.1 s an example: more of them than the suite's other properties.
        max_examples=3 * int(os.environ.get("MF_PROPERTY_EXAMPLES", "30")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(query=_QUERIES)
    def prop(query: list[tuple[str, str, Callable[[str], str]]]) -> None:
        # hypothesis drives a sync function; each example runs on the test's loop from a thread.
        parts = [
            f"{n}={q(v.replace('{node}', twin.node_id).replace('{cursor}', cursor))}" for n, v, q in query
        ]
        path = "/api/v1/hardware/accelerators" + ("?" + "&".join(parts) if parts else "")
        _status, fast = asyncio.run_coroutine_threadsafe(same_answer(twin, path), loop).result()
        went.append(fast)

    await asyncio.to_thread(prop)
    assert any(went) and not all(went), "the examples took both paths"


async def test_every_single_parameter_answers_as_the_route_does(twin) -> None:  # type: ignore[no-untyped-def]
    """Each name with each of its values, its near misses and the refused ones, quoted each way
    (the property above combines them, but rarely draws a given near miss)."""
    cursor = (await twin.client.get("/api/v1/hardware/accelerators?limit=1", headers=twin.auth)).json()[
        "next_cursor"
    ]
    paths = sorted(
        {
            f"/api/v1/hardware/accelerators?{name}="
            + quoted(value.replace("{node}", twin.node_id).replace("{cursor}", cursor))
            for name, values in _VALID.items()
            for value in values + _NEARLY.get(name, []) + _REFUSED
            for quoted in (quote_plus, quote, lambda v: v)
        }
    )
    went = [(await same_answer(twin, path))[1] for path in paths]
    assert len(paths) > 100 and any(went) and not all(went)
