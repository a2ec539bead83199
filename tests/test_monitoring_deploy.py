"""deploy/prometheus and deploy/grafana: checked by promtool, and kept in step with the metrics
catalog (api/services/metrics/catalog.py), so a renamed metric cannot leave a silent alert or an empty panel.
The service discovery job reads the server's http_sd route with the viewer token and keeps the
health label.

promtool (and prometheus) come from Debian's `prometheus` package; when it is missing this installs
it with apt-get, and FAILS (never skips) when it cannot.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from api.services.metrics.catalog import METRICS
from tests import debian

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
DASHBOARD = ROOT / "deploy" / "grafana" / "modelforge-hardware.json"
METRIC_NAME = re.compile(r"\bmodelforge_[a-z0-9_]+\b")
ALERTS = (
    "ModelForgeNodeStale",
    "ModelForgeNodeOffline",
    "ModelForgeGpuMissing",
    "ModelForgeInventoryDegraded",
    "ModelForgeGpuFailed",
)


def prometheus_tool(name: str) -> str:
    """`promtool` or `prometheus`, installed with apt-get when missing; the calling test fails
    when it cannot be."""
    return debian.require(name, "prometheus")


def promtool_path() -> str:
    return prometheus_tool("promtool")


@pytest.fixture(scope="session")
def promtool() -> str:
    return promtool_path()


@pytest.fixture
def prometheus_dir(tmp_path: Path) -> Path:
    """The shipped files, with the token file an operator puts beside them."""
    target = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS, target)
    (target / "modelforge-viewer-token").write_text("mfv_placeholder\n", encoding="utf-8")
    return target


def promtool_run(promtool: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_scrape_config(promtool: str, prometheus_dir: Path) -> None:
    done = promtool_run(promtool, prometheus_dir, "check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout


def discovery_job(config: dict) -> dict:  # type: ignore[type-arg]
    jobs = [j for j in config["scrape_configs"] if "http_sd_configs" in j]
    assert len(jobs) == 1, "one service discovery job"
    return jobs[0]  # type: ignore[no-any-return]


def test_the_discovery_job_reads_the_sd_route_with_the_viewer_token_and_keeps_health(
    promtool: str, prometheus_dir: Path
) -> None:
    config = yaml.safe_load((prometheus_dir / "prometheus.yml").read_text(encoding="utf-8"))
    job = discovery_job(config)
    (sd,) = job["http_sd_configs"]
    assert "/api/v1/sd/prometheus" in sd["url"]
    assert sd["authorization"] == {"type": "Bearer", "credentials_file": "modelforge-viewer-token"}
    kept = {r["target_label"]: r["source_labels"] for r in job["relabel_configs"]}
    assert kept["health"] == ["__meta_modelforge_health"]
    assert kept["node_id"] == ["__meta_modelforge_node_id"]
    # promtool checks the job itself: without its URL the configuration is refused.
    del sd["url"]
    (prometheus_dir / "broken.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    done = promtool_run(promtool, prometheus_dir, "check", "config", "broken.yml")
    assert done.returncode != 0 and "url" in (done.stdout + done.stderr).lower(), done.stdout + done.stderr


def test_promtool_checks_the_alert_rules(promtool: str, prometheus_dir: Path) -> None:
    done = promtool_run(promtool, prometheus_dir, "check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_every_alert(promtool: str, prometheus_dir: Path) -> None:
    done = promtool_run(promtool, prometheus_dir, "test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    tests = (PROMETHEUS / "alerts_test.yml").read_text(encoding="utf-8")
    rules = (PROMETHEUS / "alerts.yml").read_text(encoding="utf-8")
    for alert in re.findall(r"- alert: (\w+)", rules):
        assert f"alertname: {alert}" in tests, f"{alert} has no promtool unit test"
    assert set(ALERTS) <= set(re.findall(r"- alert: (\w+)", rules))


def test_a_broken_rule_is_caught(promtool: str, prometheus_dir: Path) -> None:
    rules = prometheus_dir / "alerts.yml"
    rules.write_text(rules.read_text(encoding="utf-8").replace("== 1", "== =", 1), encoding="utf-8")
    done = promtool_run(promtool, prometheus_dir, "check", "rules", "alerts.yml")
    assert done.returncode != 0


def test_rules_and_dashboard_use_only_exported_metrics() -> None:
    exported = {m.name for m in METRICS}
    rules = (PROMETHEUS / "alerts.yml").read_text(encoding="utf-8")
    assert set(METRIC_NAME.findall(rules)) <= exported, set(METRIC_NAME.findall(rules)) - exported
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    for expr in exprs:
        used = set(METRIC_NAME.findall(expr))
        assert used and used <= exported, (expr, used - exported)
    assert dashboard["uid"] and dashboard["title"]
