"""The web console in process: auth by cookie, each page's content, filters, as-of, the live
feed's cursor and the number of queries behind the fleet overview (real PostgreSQL, fake NVML)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from urllib.parse import parse_qs, urlsplit

import asyncpg
import httpx
import pytest

from api.http.app import create_app
from api.http.console.routes import COOKIE
from api.http.context import AppContext
from api.services.reads.repository import HardwareRepository
from ledger.db import init_connection
from runtime.secrets import digest
from tests.console_support import (
    CHART_HOST,
    FAILED_GPU,
    MISSING_GPU,
    NO_FAN_GPU,
    OFFLINE,
    ONLINE,
    STALE,
    ZERO_FAN_GPU,
    caught_up,
    node_id,
    report,
    seed_chart_history,
    seed_fleet,
)

TOKEN = "console-test-token-1"


class Console:
    def __init__(self, client: httpx.AsyncClient, queries: list[str], pool: asyncpg.Pool) -> None:
        self.client = client
        self.queries = queries
        self.pool = pool

    async def login(self) -> None:
        r = await self.client.post("/console/login", data={"token": TOKEN, "next": "/console/"})
        assert r.status_code == 303, r.text
        self.client.cookies.set(COOKIE, TOKEN)

    async def page(self, path: str, status: int = 200) -> str:
        r = await self.client.get(path)
        assert r.status_code == status, (path, r.status_code, r.text[:2000])
        assert r.headers["content-type"].startswith("text/html")
        return r.text


@pytest.fixture
async def console(database_dsn: str) -> AsyncIterator[Console]:
    queries: list[str] = []

    async def init(conn: asyncpg.Connection) -> None:
        await init_connection(conn)
        # Counted: what the page asks; not asyncpg's own reset when a connection goes back to the pool.
        conn.add_query_logger(
            lambda record: None if "RESET ALL" in record.query else queries.append(record.query)
        )

    pool = await asyncpg.create_pool(database_dsn, min_size=1, max_size=4, init=init)
    assert pool is not None
    from api.services.inventory import HardwareInventoryService
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    context = AppContext(
        pool=pool,
        service=HardwareInventoryService(EventStore(pool, ALL_PROJECTIONS)),
        repository=HardwareRepository(pool),
        admin_token_hash=digest(TOKEN),
        local_refresh_enabled=False,
    )
    app = create_app(context)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield Console(client, queries, pool)
    await pool.close()


def rows_of(html: str, table_id: str) -> list[str]:
    body = html.split(f'id="{table_id}"', 1)[1].split("</table>", 1)[0]
    return re.findall(r"<tr[ >].*?</tr>", body, flags=re.S)


def cell(html: str, metric: str, gpu: str) -> str:
    m = re.search(
        rf'<td class="fact [^"]*" data-state="([a-z_]+)" data-metric="{metric}" data-gpu="{gpu}">(.*?)</td>',
        html,
        flags=re.S,
    )
    assert m, f"no {metric} cell for {gpu}"
    return f"{m.group(1)}|{re.sub('<[^>]+>', '', m.group(2))}"


async def test_pages_need_the_cookie_and_the_login_never_puts_the_token_in_a_url(console: Console) -> None:
    r = await console.client.get("/console/nodes/x?as_of=2026-01-01T00:00")
    assert r.status_code == 303
    assert urlsplit(r.headers["location"]).path == "/console/login"
    assert parse_qs(urlsplit(r.headers["location"]).query)["next"] == [
        "/console/nodes/x?as_of=2026-01-01T00:00"
    ]
    polled = await console.client.get("/console/events/feed", headers={"HX-Request": "true"})
    assert polled.status_code == 401 and polled.headers["hx-redirect"].startswith("/console/login")

    refused = await console.client.post("/console/login", data={"token": "wrong", "next": "/console/"})
    assert refused.status_code == 401 and "That token is not accepted." in refused.text
    assert "set-cookie" not in refused.headers

    ok = await console.client.post(
        "/console/login", data={"token": f" {TOKEN} ", "next": "https://evil.example/"}
    )
    assert ok.status_code == 303 and ok.headers["location"] == "/console"
    cookie = ok.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={TOKEN};")
    assert {"httponly", "samesite=strict", "path=/console"} <= {p.strip().lower() for p in cookie.split(";")}
    assert TOKEN not in ok.headers["location"]

    # A cookie holding anything but an accepted token is no login.
    console.client.cookies.set(COOKIE, "forged")
    assert (await console.client.get("/console/")).status_code == 303
    await console.login()
    page = await console.client.get("/console/")
    assert page.status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]
    out = await console.client.post("/console/logout")
    assert out.status_code == 303 and f'{COOKIE}=""' in out.headers["set-cookie"]


async def test_fleet_overview_counts_filters_and_pages(console: Console) -> None:
    await seed_fleet(console.pool)
    await console.login()
    html = await console.page("/console/")
    assert re.search(r'data-count="total">3<', html)
    for state, n in (("online", 1), ("stale", 1), ("offline", 1), ("local", 0)):
        assert re.search(rf'data-count="{state}">{n}<', html), state
    rows = rows_of(html, "fleet")
    assert [re.search(r">([\w-]+)</a></th>", r).group(1) for r in rows[1:]] == [OFFLINE, ONLINE, STALE]  # type: ignore[union-attr]
    online = next(r for r in rows if ONLINE in r)
    assert "NVIDIA H200" in online and "1 missing" in online and ">2 <" in online.replace("\n", "")

    stale = await console.page("/console/?liveness=stale")
    assert len(rows_of(stale, "fleet")) == 2 and STALE in stale and ONLINE not in rows_of(stale, "fleet")[1]
    by_host = rows_of(await console.page("/console/?q=GPU-"), "fleet")
    assert len(by_host) == 3 and OFFLINE not in "".join(by_host)
    prefix = node_id(OFFLINE)[:6]
    by_id = rows_of(await console.page(f"/console/?q={prefix}"), "fleet")
    assert len(by_id) == 2 and OFFLINE in by_id[1]
    assert "No node matches." in await console.page("/console/?q=%25")  # a literal %, not a wildcard

    # The SQL that filters and counts by liveness agrees with the rule each row is judged by.
    for state in ("online", "stale", "offline", "local"):
        shown = re.findall(
            r'class="state liveness-([a-z]+)"', await console.page(f"/console/?liveness={state}")
        )
        assert shown == [state] * int(re.search(rf'data-count="{state}">(\d+)<', html).group(1))  # type: ignore[union-attr]

    bad = await console.page("/console/?liveness=sideways", status=400)
    assert "liveness must be one of online, stale, offline, local" in bad
    assert "is not a date and time" in await console.page("/console/?as_of=yesterday", status=400)


async def test_a_decommissioned_node_is_counted_apart_not_among_the_offline(console: Console) -> None:
    await seed_fleet(console.pool)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    node = f"/api/v1/hardware/nodes/{node_id(OFFLINE)}/decommission"
    p = (await console.client.post(f"{node}/preview", headers=bearer)).json()
    done = await console.client.post(
        node,
        headers=bearer,
        json={"generation": p["generation"], "digest": p["digest"], "reason": "retired", "actor": "alice"},
    )
    assert done.status_code == 200, done.text
    await console.login()
    await asyncio.sleep(1.1)  # a moment as of which the decommission is done, in whole seconds
    as_of = f"as_of={datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%S')}"
    # from the read models, and folded from the log as of a moment (two readings of one rule)
    for now in ("", as_of):
        html = await console.page(f"/console/?{now}")
        assert re.search(r'data-count="total">3<', html)
        for state, n in (("online", 1), ("stale", 1), ("offline", 0)):
            assert re.search(rf'data-count="{state}">{n}<', html), (now, state)
        assert 'data-count="decommissioned"><a href="/console/?status=decommissioned">1</a><' in html
        offline = await console.page(f"/console/?liveness=offline&{now}")
        assert OFFLINE not in "".join(rows_of(offline, "fleet")), now
        retired = rows_of(await console.page(f"/console/?status=decommissioned&{now}"), "fleet")
        assert len(retired) == 2 and OFFLINE in retired[1], now


async def test_fleet_overview_pages_with_a_cursor(console: Console, monkeypatch: pytest.MonkeyPatch) -> None:
    import api.http.console.routes as routes

    monkeypatch.setattr(routes, "PAGE_SIZE", 2)
    await seed_fleet(console.pool)
    await console.login()
    first = await console.page("/console/")
    assert len(rows_of(first, "fleet")) == 3
    next_url = re.search(r'<a href="([^"]+)" rel="next">', first).group(1).replace("&amp;", "&")  # type: ignore[union-attr]
    second = await console.page(next_url)
    assert len(rows_of(second, "fleet")) == 2 and STALE in second and 'rel="next"' not in second


async def test_filtered_fleet_pages_cross_their_boundaries(
    console: Console, monkeypatch: pytest.MonkeyPatch
) -> None:
    import api.http.console.routes as routes
    from api.services.inventory import HardwareInventoryService
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS
    from tests.builders import gpu

    await seed_fleet(console.pool)
    service = HardwareInventoryService(EventStore(console.pool, ALL_PROJECTIONS))
    for i in range(4):  # more online nodes, on both sides of the seeded ones by hostname
        await report(service, f"{'a' if i % 2 else 'z'}-online-{i}", [gpu(200 + i)])
    await console.login()

    async def walk(query: str) -> list[str]:
        hosts: list[str] = []
        url: str | None = "/console/?" + query
        while url is not None:
            html = await console.page(url)
            hosts += [re.search(r">([\w-]+)</a></th>", r).group(1) for r in rows_of(html, "fleet")[1:]]  # type: ignore[union-attr]
            found = re.search(r'<a href="([^"]+)" rel="next">', html)
            url = found.group(1).replace("&amp;", "&") if found else None
        return hosts

    for query in ("liveness=online", "q=a-", "health=healthy", "liveness=online&q=z-", "status=active"):
        monkeypatch.setattr(routes, "PAGE_SIZE", 50)
        whole = await walk(query)
        assert whole, query
        for size in (1, 2):
            monkeypatch.setattr(routes, "PAGE_SIZE", size)
            # Every matching node once, in the page's order, whatever the page size.
            assert await walk(query) == whole, (query, size)


async def test_the_overview_runs_the_same_four_queries_whatever_the_fleet_size(console: Console) -> None:
    await seed_fleet(console.pool)
    await console.login()
    console.queries.clear()
    await console.page("/console/")
    small = len(console.queries)

    from api.services.inventory import HardwareInventoryService
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS
    from tests.builders import gpu

    service = HardwareInventoryService(EventStore(console.pool, ALL_PROJECTIONS))
    for i in range(30):
        await report(service, f"bulk-{i:03d}", [gpu(100 + i)])
    console.queries.clear()
    html = await console.page("/console/")
    assert len(rows_of(html, "fleet")) == 34
    # The page and the counts by state; the GPU health by model and the failing GPUs.
    assert small == len(console.queries) == 4, console.queries


async def test_node_page_tells_unsupported_unavailable_and_zero_apart(console: Console) -> None:
    before_changes = await seed_fleet(console.pool)
    await console.login()
    html = await console.page(f"/console/nodes/{node_id(ONLINE)}")
    assert cell(html, "fan_speed_percent", ZERO_FAN_GPU) == "known|0 %"
    assert '<th scope="row" title="fan_speed_percent">Fan speed</th>' in html
    assert cell(html, "fan_speed_percent", NO_FAN_GPU).startswith("unsupported|not supported")
    assert cell(html, "power_watts", NO_FAN_GPU) == "unavailable|unavailable: NVML: NoPermission"
    missing = next(r for r in rows_of(html, "gpus") if MISSING_GPU in r)
    assert 'data-status="missing"' in missing and ">missing</span> since " in missing
    assert "6.8.0-45-generic -&gt; 6.8.0-50-generic" in html
    assert "ACCELERATOR_MISSING" in html and "NODE_DISCOVERED" in html
    assert "last changed " in html

    stamp = before_changes.strftime("%Y-%m-%dT%H:%M:%S.%f")
    past = await console.page(f"/console/nodes/{node_id(ONLINE)}?as_of={stamp}")
    assert "Showing the inventory as of" in past
    assert 'data-status="missing"' not in past and "6.8.0-50-generic" not in past
    assert "ACCELERATOR_MISSING" not in past
    assert "no node" in await console.page(
        f"/console/nodes/{node_id(ONLINE)}?as_of=2000-01-01T00:00", status=404
    )
    assert "no node nope" in await console.page("/console/nodes/nope", status=404)


async def test_gpu_page_events_feed_and_decommission_preview(console: Console) -> None:
    await seed_fleet(console.pool)
    await console.login()
    async with console.pool.acquire() as conn:
        acc_id = await conn.fetchval(
            "SELECT accelerator_id FROM hw_accelerators WHERE uuid = $1", MISSING_GPU
        )
    gpu_html = await console.page(f"/console/gpus/{acc_id}")
    assert 'id="gpu-status">missing<' in gpu_html
    assert "ACCELERATOR_DISCOVERED" in gpu_html and "ACCELERATOR_MISSING" in gpu_html
    assert "NVIDIA A100-SXM4-40GB" in gpu_html

    events = await console.page("/console/events?class=lifecycle")
    listed = re.findall(r'data-position="(\d+)"', events)
    assert listed and "ACCELERATOR_MISSING" in events and "NODE_TELEMETRY_OBSERVED" not in events
    feed = re.search(r'id="event-feed" hx-get="([^"]+)"', events).group(1).replace("&amp;", "&")  # type: ignore[union-attr]
    assert (await console.page(feed)).count("data-position") == 0

    from api.services.inventory import HardwareInventoryService
    from ledger.store import EventStore
    from projections.inventory import ALL_PROJECTIONS

    await report(HardwareInventoryService(EventStore(console.pool, ALL_PROJECTIONS)), "late-node", [])
    await caught_up(console.pool)
    new = await console.page(feed)
    assert re.findall(r'data-position="\d+"', new) and "NODE_DISCOVERED" in new
    assert all(int(p) > int(listed[-1]) for p in re.findall(r'data-position="(\d+)"', new))
    again = re.search(r'hx-get="([^"]+)"', new).group(1).replace("&amp;", "&")  # type: ignore[union-attr]
    assert (await console.page(again)).count("data-position") == 0
    assert "STALE" not in (await console.page(f"/console/events?node={node_id(ONLINE)}"))

    preview = await console.page(f"/console/nodes/{node_id(ONLINE)}/decommission")
    assert 'id="can-execute"' in preview and "yes" in preview and MISSING_GPU in preview


async def test_gpu_page_as_of_shows_the_gpu_as_it_was(console: Console) -> None:
    before_changes = await seed_fleet(console.pool)
    await console.login()
    async with console.pool.acquire() as conn:
        acc_id = await conn.fetchval(
            "SELECT accelerator_id FROM hw_accelerators WHERE uuid = $1", MISSING_GPU
        )
    assert 'id="gpu-status">missing<' in await console.page(f"/console/gpus/{acc_id}")
    stamp = before_changes.strftime("%Y-%m-%dT%H:%M:%S")
    past = await console.page(f"/console/gpus/{acc_id}?as_of={stamp}")
    assert "Showing the inventory as of" in past
    assert 'id="gpu-status">active<' in past and "ACCELERATOR_MISSING" not in past
    gone = await console.page(f"/console/gpus/{acc_id}?as_of=2000-01-01T00:00", status=404)
    assert "was not known as of" in gone
    assert "no GPU nope" in await console.page("/console/gpus/nope?as_of=2000-01-01T00:00", status=404)
    fleet = await console.page(f"/console/?as_of={stamp}&liveness=online")
    assert [re.search(r">([\w-]+)</a></th>", r).group(1) for r in rows_of(fleet, "fleet")[1:]] == [ONLINE]  # type: ignore[union-attr]


def text_of(fragment: str) -> str:
    return re.sub(r"\s+", " ", re.sub("<[^>]+>", "", fragment)).strip()


async def accelerator_id(console: Console, gpu_uuid: str) -> str:
    async with console.pool.acquire() as conn:
        found: str = await conn.fetchval(
            "SELECT accelerator_id FROM hw_accelerators WHERE uuid = $1", gpu_uuid
        )
    return found


async def test_node_and_fleet_pages_show_each_gpus_health(console: Console) -> None:
    await seed_fleet(console.pool)
    await console.login()
    html = await console.page(f"/console/nodes/{node_id(ONLINE)}")
    gpus = {re.search(r'data-gpu="([^"]+)"', r).group(1): r for r in rows_of(html, "gpus")[1:]}  # type: ignore[union-attr]
    health = {u: re.search(r'<tr [^>]*data-health="([a-z]+)"', r).group(1) for u, r in gpus.items()}  # type: ignore[union-attr]
    assert health == {ZERO_FAN_GPU: "healthy", NO_FAN_GPU: "degraded", MISSING_GPU: "healthy"}
    degraded = text_of(gpus[NO_FAN_GPU])
    assert "degraded reset gpu" in degraded and "row_remap_pending, xid_63" in degraded
    assert re.search(r'id="node-health"[^>]*>GPUs degraded<', html)
    assert text_of(html.split('id="node-gpu-health">', 1)[1].split("</dd>", 1)[0]) == (
        "2 healthy, 1 degraded, 0 failed"
    )
    # The timeline tells the verdict's change and the XID in words.
    assert "health: healthy -&gt; degraded, action reset_gpu" in html
    assert "XID 63: ECC page retirement or row remapping recorded" in html

    fleet = {
        r.split("</a></th>")[0].rsplit(">", 1)[-1]: text_of(r)
        for r in rows_of(await console.page("/console/"), "fleet")[1:]
    }
    assert "1 degraded" in fleet[ONLINE] and "failed" not in fleet[ONLINE]
    assert "1 failed" in fleet[STALE] and "degraded" not in fleet[STALE]
    assert "failed" not in fleet[OFFLINE] and "degraded" not in fleet[OFFLINE]
    # The GPU health overview: by model and verdict (the worst models first), then the GPUs that
    # need someone, failed first, each linked to its page.
    page = await console.page("/console/")
    by_model = [text_of(r) for r in rows_of(page, "gpu-health-by-model")[1:]]
    assert by_model == ["NVIDIA H200 1 1 1", "NVIDIA A100-SXM4-40GB 1 0 0"], by_model
    failing = rows_of(page, "gpu-health-failing")[1:]
    assert [re.search(r'data-gpu="([^"]+)"', r).group(1) for r in failing] == [FAILED_GPU, NO_FAN_GPU]  # type: ignore[union-attr]
    assert "service" in text_of(failing[0]) and STALE in failing[0] and "ecc_uncorrected" in failing[0]
    assert f'href="/console/gpus/{await accelerator_id(console, FAILED_GPU)}"' in failing[0]
    assert "GPUs that need someone: 2<" in page
    failed = rows_of(await console.page("/console/?health=failed"), "fleet")[1:]
    assert len(failed) == 1 and STALE in failed[0]
    healthy = rows_of(await console.page("/console/?health=healthy"), "fleet")[1:]
    assert len(healthy) == 1 and OFFLINE in healthy[0], "a node without GPUs is healthy"
    assert "health must be one of healthy, degraded, failed" in await console.page(
        "/console/?health=sick", status=400
    )


async def test_gpu_page_shows_verdict_action_reasons_xids_and_signals(console: Console) -> None:
    await seed_fleet(console.pool)
    await console.login()
    html = await console.page(f"/console/gpus/{await accelerator_id(console, NO_FAN_GPU)}")
    assert 'id="gpu-health">degraded<' in html
    assert "recommended action: <strong>reset gpu</strong>" in html
    reasons = re.findall(r'<li data-code="([a-z_0-9]+)" data-status="([a-z]+)">', html)
    assert reasons == [("row_remap_pending", "degraded"), ("xid_63", "degraded")]
    assert "row remapping pending: reset the GPU" in html
    xids = rows_of(html, "gpu-xids")[1:]
    assert len(xids) == 1, "the resent XID is recorded once"
    assert 'data-xid="63"' in xids[0] and "ECC page retirement or row remapping recorded" in xids[0]
    # Signals: a fact each, a known yes, a known 0 and an unsupported page retirement told apart.
    assert cell(html, "remapped_rows.pending", NO_FAN_GPU) == "known|yes"
    assert cell(html, "remapped_rows.uncorrectable", NO_FAN_GPU) == "known|1"
    assert cell(html, "ecc_errors.uncorrected_volatile", NO_FAN_GPU) == "known|0"
    assert cell(html, "retired_pages.single_bit", NO_FAN_GPU).startswith("unsupported|not supported")
    assert cell(html, "clock_event_reasons.hw_thermal_slowdown", NO_FAN_GPU) == "known|no"
    # Labels for people; the API name stays the label's tooltip, and no raw name stands as a label.
    for name, label in [
        ("ecc_errors.uncorrected_volatile", "ECC: uncorrected (volatile)"),
        ("clock_event_reasons.hw_thermal_slowdown", "Clock event: HW thermal slowdown"),
        ("fan_speed_percent", "Fan speed"),
        ("temperature_celsius", "Temperature"),
    ]:
        assert f'<th scope="row" title="{name}">{label}</th>' in html
    assert not re.findall(r'<th scope="row"[^>]*>[a-z]+[._][a-z_.]+</th>', html)
    assert not re.findall(r"<dt[^>]*>[a-z]+_[a-z_]+</dt>", html)

    failed = await console.page(f"/console/gpus/{await accelerator_id(console, FAILED_GPU)}")
    assert 'id="gpu-health">failed<' in failed and "recommended action: <strong>service</strong>" in failed
    assert re.findall(r'<li data-code="([a-z_0-9]+)"', failed) == ["ecc_uncorrected"]
    assert cell(failed, "ecc_errors.uncorrected_volatile", FAILED_GPU) == "known|2"
    assert '<p id="gpu-xids">No XID recorded.</p>' in failed

    healthy = await console.page(f"/console/gpus/{await accelerator_id(console, ZERO_FAN_GPU)}")
    assert 'id="gpu-health">healthy<' in healthy and "recommended action: <strong>none</strong>" in healthy
    assert "No rule fires on its known signals." in healthy
    # The missing A100's agent sent no signals, and a missing GPU has no current sample anyway.
    missing = await console.page(f"/console/gpus/{await accelerator_id(console, MISSING_GPU)}")
    assert 'id="gpu-health">healthy<' in missing and 'id="gpu-signals"' in missing
    assert (
        "No current health signals: the GPU is missing." in missing and 'gpu-signals"><caption' not in missing
    )


async def test_assets_are_served_here_and_pages_load_nothing_from_elsewhere(console: Console) -> None:
    await seed_fleet(console.pool)
    await console.login()
    js = await console.client.get("/console/static/htmx.min.js")
    assert js.status_code == 200 and "htmx" in js.text[:200]
    for path in ("/console/", f"/console/nodes/{node_id(ONLINE)}", "/console/events", "/console/login"):
        html = await console.page(path)
        external = re.findall(r'(?:src|href|action)="(?!/)([^"#?][^"]*)"', html)
        assert external == [], (path, external)
        assert all(
            re.search(rf'<label for="{i}"', html) for i in re.findall(r'<(?:input|select) id="([^"]+)"', html)
        )


async def test_gpu_and_node_pages_chart_the_window_with_gaps_as_gaps(console: Console) -> None:
    """The chart history of console_support: the 1 h chart (30 s buckets) draws two runs of about
    40 buckets each, the ten silent minutes as a gap, the power as not supported, and metrics
    never reported as such."""
    acc_id = await seed_chart_history(console.pool)
    await console.login()

    html = await console.page(f"/console/gpus/{acc_id}")
    assert 'data-window="1h"' in html
    temperature = html.split('data-chart="temperature_celsius"', 1)[1].split("</svg>", 1)[0]
    runs = [int(n) for n in re.findall(r'<polyline class="line" data-points="(\d+)"', temperature)]
    assert len(runs) == 2, runs  # the ten silent minutes are a gap
    assert 75 <= sum(runs) <= 82, runs  # 40 minutes of 30 s buckets, each drawn once
    assert re.search(r'data-chart="power_watts">Power draw: not supported<', html)
    assert re.search(r'data-chart="clock_sm_mhz">SM clock \(MHz\): no known value in this window<', html)

    wider = await console.page(f"/console/gpus/{acc_id}?window=6h")
    assert 'data-window="6h"' in wider and '<strong aria-current="true">6h</strong>' in wider
    assert "window must be one of 1h, 6h, 24h" in await console.page(
        f"/console/gpus/{acc_id}?window=7d", status=400
    )
    node = await console.page(f"/console/nodes/{node_id(CHART_HOST)}")
    host = node.split('data-chart="memory_available_bytes"', 1)[1].split("</svg>", 1)[0]
    assert len(re.findall(r'<polyline class="line"', host)) == 2


async def test_an_event_off_a_node_stream_names_its_stream_and_links_to_no_node_page(
    console: Console,
) -> None:
    """An enrollment token's events are on the token's stream: the event list says `token ...`,
    not a node called `enrollme` whose link answers 404; a node's events link to its page."""
    await seed_fleet(console.pool)
    await console.login()
    r = await console.client.post(
        "/api/v1/enrollment-tokens", json={}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert r.status_code == 201, r.text
    token_id = r.json()["token_id"]
    events = await console.page("/console/events?class=lifecycle")
    rows = re.findall(r'<tr data-position="\d+" data-event-type="([A-Z_]+)">(.*?)</tr>', events, re.S)
    token_rows = [html for kind, html in rows if kind == "ENROLLMENT_TOKEN_CREATED"]
    assert len(token_rows) == 1
    assert f">token {token_id[:8]}</code>" in token_rows[0]
    assert "/console/nodes/" not in token_rows[0]
    node_rows = [html for kind, html in rows if kind == "NODE_DISCOVERED"]
    assert node_rows and all(
        re.search(r'<a href="/console/nodes/([^"]+)"><code title="\1">', html) for html in node_rows
    )
    for link in {m for html in node_rows for m in re.findall(r'href="(/console/nodes/[^"]+)"', html)}:
        await console.page(link)  # every link the list makes answers 200
