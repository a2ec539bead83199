"""The console in a real browser: headless Chromium driven by Selenium against a real
`modelforge-hw serve` process whose own refreshes read the fake NVML, plus a small fleet
reconciled into the same database (tests/console_support.py).

Chromium and its driver are Debian packages; when they are missing the session installs them with
apt-get, and the tests FAIL (never skip) when that is impossible. Each page's screenshot is saved
into docs/console/ (shown by docs/console.md).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from api.http.console.routes import COOKIE
from ledger.db import create_pool
from tests import debian
from tests.agent_support import OPERATOR, OPERATOR_TOKEN, ROOT, ServerProcess, clean_env
from tests.console_support import (
    MISSING_GPU,
    NO_FAN_GPU,
    ONLINE,
    STALE,
    ZERO_FAN_GPU,
    node_id,
    seed_chart_history,
    seed_fleet,
)

SHOTS = ROOT / "docs" / "console"


def _find_chromium() -> tuple[str | None, str | None]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if driver is None and Path("/usr/lib/chromium/chromedriver").exists():
        driver = "/usr/lib/chromium/chromedriver"
    return browser, driver


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    browser, driver = _find_chromium()
    if browser is None or driver is None:
        why = debian.install("chromium", "chromium-driver")
        browser, driver = _find_chromium()
        if browser is None or driver is None:
            pytest.fail(f"Chromium and chromedriver are needed and cannot be installed: {why or 'not found'}")
    return browser, driver


@pytest.fixture
def browser(chromium: tuple[str, str]) -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = chromium[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=chromium[1]))
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


class FakeNvmlServer(ServerProcess):
    """`modelforge-hw serve` with the fake NVML (tests/agent_wrapper.py): its own host is a
    compute node with two H200-like GPUs, refreshed at start and on POST /hardware/refresh."""

    def start(self) -> FakeNvmlServer:
        env = clean_env(
            MODELFORGE_DATABASE_URL=self.dsn,
            MODELFORGE_ADMIN_TOKEN=OPERATOR_TOKEN,
            MODELFORGE_STATE_DIR=str(self.workdir / "server-state"),
            MODELFORGE_NODE_ID="console-server-host",
            MF_TEST_GPUS="2",
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.agent_wrapper",
                "serve",
                "--port",
                str(self.port),
                "--startup-refresh",
            ],
            env=env,
            cwd=ROOT,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self


@pytest.fixture
async def server(database_dsn: str, tmp_path: Path) -> object:
    proc = FakeNvmlServer(database_dsn, tmp_path).start()
    try:
        await proc.wait_healthy(60)
        await startup_refresh_done(proc.url)
        yield proc
    finally:
        proc.stop()


async def startup_refresh_done(url: str, within: float = 30.0) -> None:
    """The server answers before its startup refresh has recorded its own host: wait for that."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            r = await client.get(url + "/api/v1/hardware/nodes", headers=OPERATOR)
            if r.status_code == 200 and r.json()["items"]:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the server's startup refresh recorded nothing within {within}s")


def wait_for(driver: WebDriver, css: str, timeout: float = 15.0) -> None:
    WebDriverWait(driver, timeout).until(lambda d: d.find_elements(By.CSS_SELECTOR, css))


def shot(driver: WebDriver, name: str) -> None:
    """A full-page screenshot for docs/console.md (the viewport stretched to the page's height)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    metrics = {"width": 1280, "height": max(600, min(height, 3000)), "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)  # type: ignore[attr-defined]
    try:
        driver.save_screenshot(str(SHOTS / f"{name}.png"))
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})  # type: ignore[attr-defined]


def login(driver: WebDriver, base: str, token: str = OPERATOR_TOKEN) -> None:
    driver.get(base + "/console/")
    wait_for(driver, "#token")
    assert "/console/login" in driver.current_url
    field = driver.find_element(By.ID, "token")
    field.send_keys(token)
    field.send_keys(Keys.ENTER)
    wait_for(driver, "#fleet, #login-error")


def rows(driver: WebDriver, table: str) -> list[str]:
    return [r.text for r in driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")]


async def test_every_page_in_a_browser(server: ServerProcess, browser: WebDriver, database_dsn: str) -> None:
    pool = await create_pool(database_dsn)
    try:
        before_changes = await seed_fleet(pool)
        chart_gpu = await seed_chart_history(pool)
        async with pool.acquire() as conn:
            missing_id = await conn.fetchval(
                "SELECT accelerator_id FROM hw_accelerators WHERE uuid = $1", MISSING_GPU
            )
            degraded_id = await conn.fetchval(
                "SELECT accelerator_id FROM hw_accelerators WHERE uuid = $1", NO_FAN_GPU
            )
    finally:
        await pool.close()
    base = server.url  # type: ignore[attr-defined]

    # The login form: a wrong token is refused on the page; the right one lands on the fleet.
    browser.get(base + "/console/login")
    shot(browser, "login")
    login(browser, base, "not-a-token")
    assert browser.find_element(By.ID, "login-error").text == "That token is not accepted."
    login(browser, base)
    assert OPERATOR_TOKEN not in browser.current_url
    cookie = browser.get_cookie(COOKIE)
    assert cookie is not None and cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # page scripts cannot read it

    # Fleet: counts at the top, every node, then filters driven from the keyboard.
    counts = {
        e.get_attribute("data-count"): e.text for e in browser.find_elements(By.CSS_SELECTOR, "#counts dd")
    }
    assert counts["total"] == "5" and counts["local"] == "1" and counts["stale"] == "1"
    assert len(rows(browser, "fleet")) == 5
    online = next(r for r in rows(browser, "fleet") if r.startswith(ONLINE))
    assert "1 missing" in online and "NVIDIA H200" in online and "online" in online
    assert "1 degraded" in online
    assert "1 failed" in next(r for r in rows(browser, "fleet") if r.startswith(STALE))
    shot(browser, "fleet")
    search = browser.find_element(By.ID, "q")
    search.send_keys("gpu-", Keys.ENTER)
    WebDriverWait(browser, 10).until(lambda d: "q=gpu-" in d.current_url)
    assert [r.split()[0] for r in rows(browser, "fleet")] == [ONLINE, STALE]
    Select(browser.find_element(By.ID, "liveness")).select_by_visible_text("stale")
    browser.find_element(By.CSS_SELECTOR, ".filters button[type=submit]").send_keys(Keys.ENTER)
    WebDriverWait(browser, 10).until(lambda d: "liveness=stale" in d.current_url)
    assert [r.split()[0] for r in rows(browser, "fleet")] == [STALE]
    shot(browser, "fleet-filtered")

    # Node: a measured 0 % fan, an unsupported fan and an unavailable reading read differently.
    browser.get(base + "/console/")
    browser.find_element(By.LINK_TEXT, ONLINE).click()
    wait_for(browser, "#gpu-telemetry")
    zero = browser.find_element(
        By.CSS_SELECTOR, f'td[data-metric="fan_speed_percent"][data-gpu="{ZERO_FAN_GPU}"]'
    )
    none = browser.find_element(
        By.CSS_SELECTOR, f'td[data-metric="fan_speed_percent"][data-gpu="{NO_FAN_GPU}"]'
    )
    power = browser.find_element(By.CSS_SELECTOR, f'td[data-metric="power_watts"][data-gpu="{NO_FAN_GPU}"]')
    assert zero.text == "0 %"
    assert none.text.startswith("not supported") and "0" not in none.text
    assert power.text == "unavailable: NVML: NoPermission"
    assert zero.value_of_css_property("font-style") == "normal"
    assert none.value_of_css_property("font-style") == "italic"
    assert zero.value_of_css_property("background-image") != none.value_of_css_property("background-image")
    missing = browser.find_element(By.CSS_SELECTOR, f'#gpus tr[data-gpu="{MISSING_GPU}"]')
    assert "missing since" in missing.text
    degraded = browser.find_element(By.CSS_SELECTOR, f'#gpus tr[data-gpu="{NO_FAN_GPU}"]')
    assert "degraded reset gpu" in degraded.text and "row_remap_pending, xid_63" in degraded.text
    assert browser.find_element(By.ID, "node-health").text == "GPUs degraded"
    timeline = browser.find_element(By.CSS_SELECTOR, "ol.timeline").text
    assert "6.8.0-45-generic -> 6.8.0-50-generic" in timeline and "ACCELERATOR_MISSING" in timeline
    shot(browser, "node")

    # As of a moment before the changes: the A100 was present and the kernel older.
    as_of = browser.find_element(By.ID, "as-of")
    browser.execute_script(
        "arguments[0].value = arguments[1]", as_of, before_changes.strftime("%Y-%m-%dT%H:%M:%S")
    )
    browser.find_element(By.CSS_SELECTOR, ".as-of button").send_keys(Keys.ENTER)
    wait_for(browser, "#as-of-banner")
    past = browser.find_element(By.CSS_SELECTOR, f'#gpus tr[data-gpu="{MISSING_GPU}"]')
    assert past.get_attribute("data-status") == "active"
    assert "ACCELERATOR_MISSING" not in browser.find_element(By.CSS_SELECTOR, "ol.timeline").text
    shot(browser, "node-as-of")

    # GPU: the missing one shows as missing, with its own history.
    browser.get(f"{base}/console/gpus/{missing_id}")
    wait_for(browser, "#gpu-status")
    assert browser.find_element(By.ID, "gpu-status").text == "missing"
    assert "ACCELERATOR_MISSING" in browser.find_element(By.CSS_SELECTOR, "ol.timeline").text
    shot(browser, "gpu")

    # GPU health: the verdict, the action, each reason, the XID and the signals as facts.
    browser.get(f"{base}/console/gpus/{degraded_id}")
    wait_for(browser, "#gpu-health")
    assert browser.find_element(By.ID, "gpu-health").text == "degraded"
    assert browser.find_element(By.ID, "gpu-action").text == "recommended action: reset gpu"
    codes = [
        e.get_attribute("data-code") for e in browser.find_elements(By.CSS_SELECTOR, "#health-reasons li")
    ]
    assert codes == ["row_remap_pending", "xid_63"]
    (xid,) = browser.find_elements(By.CSS_SELECTOR, "#gpu-xids tbody tr")
    assert xid.get_attribute("data-xid") == "63" and "row remapping recorded" in xid.text
    pending = browser.find_element(By.CSS_SELECTOR, '#gpu-signals td[data-metric="remapped_rows.pending"]')
    retired = browser.find_element(By.CSS_SELECTOR, '#gpu-signals td[data-metric="retired_pages.single_bit"]')
    assert pending.text == "yes" and pending.value_of_css_property("font-style") == "normal"
    assert (
        retired.text.startswith("not supported") and retired.value_of_css_property("font-style") == "italic"
    )
    shot(browser, "gpu-health")

    # Charts: the seeded hour drawn by Chromium as two lines with the silence between them.
    browser.get(f"{base}/console/gpus/{chart_gpu}")
    wait_for(browser, "#charts")
    lines = browser.find_elements(By.CSS_SELECTOR, 'svg[data-chart="temperature_celsius"] polyline.line')
    assert len(lines) == 2
    assert 75 <= sum(int(e.get_attribute("data-points") or 0) for e in lines) <= 82
    boxes = [
        browser.execute_script("const b = arguments[0].getBBox(); return [b.x, b.x + b.width];", e)
        for e in lines
    ]
    (_, first_end), (second_start, _) = sorted(boxes)
    chart_width = browser.execute_script(
        "return document.querySelector('svg[data-chart=temperature_celsius]').viewBox.baseVal.width"
    )
    # Ten minutes of an hour: about a sixth of the plot lies between the two lines, drawn as nothing.
    assert second_start - first_end > chart_width / 10, boxes
    power = browser.find_element(By.CSS_SELECTOR, 'p[data-chart="power_watts"]')
    assert power.text == "Power draw: not supported"
    # the axis' numbers carry no unit: the caption does
    caption = browser.find_element(By.CSS_SELECTOR, 'figure[data-metric="temperature_celsius"] figcaption')
    assert caption.text == "Temperature (°C)"
    shot(browser, "gpu-charts")

    # Decommission preview (read-only).
    browser.get(f"{base}/console/nodes/{node_id(ONLINE)}/decommission")
    wait_for(browser, "#can-execute")
    assert browser.find_element(By.ID, "can-execute").text == "yes"
    shot(browser, "decommission")


async def test_events_page_follows_a_refresh_without_a_reload(
    server: ServerProcess, browser: WebDriver
) -> None:
    base = server.url  # type: ignore[attr-defined]
    login(browser, base)
    browser.get(base + "/console/events")
    wait_for(browser, "#event-feed")
    positions = [
        int(p.get_attribute("data-position") or 0)
        for p in browser.find_elements(By.CSS_SELECTOR, "#event-rows tr")
    ]
    assert positions, "the server's startup refresh should be listed"
    browser.execute_script("window.__notReloaded = true")

    async with httpx.AsyncClient() as client:
        r = await client.post(base + "/api/v1/hardware/refresh", headers=OPERATOR, timeout=30)
    assert r.status_code == 200, r.text
    expected = len(r.json()["events"])
    assert expected > 0

    def grown(d: WebDriver) -> bool:
        return len(d.find_elements(By.CSS_SELECTOR, "#event-rows tr")) >= len(positions) + expected

    # Up to the gap-safe read's horizon, which other work on the PostgreSQL server can hold back.
    WebDriverWait(browser, 120).until(grown)
    assert browser.execute_script("return window.__notReloaded === true")
    after = [
        int(p.get_attribute("data-position") or 0)
        for p in browser.find_elements(By.CSS_SELECTOR, "#event-rows tr")
    ]
    assert after[: len(positions)] == positions and len(after) == len(positions) + expected
    assert len(set(after)) == len(after), "an event was shown twice"
    types = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#event-rows tr th")][len(positions) :]
    assert "NODE_TELEMETRY_OBSERVED" in types
    shot(browser, "events")
