"""`modelforge-hw health policy show|apply` and `health backtest` as real commands against a real
server process (operator token over HTTP): a bad policy file is one clear line, exit 2, and
changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

from domain.health_policy import DEFAULT_POLICY, DEFAULT_POLICY_TEXT, load_policy
from tests.agent_support import ServerProcess
from tests.test_cli_operator import env_for, fleet, hw_async  # noqa: F401  # the fixture
from tests.test_health_policy import XID_13_THRICE


async def test_policy_show_apply_and_backtest(
    fleet: tuple[ServerProcess, dict[str, str]],  # noqa: F811
    tmp_path: Path,
) -> None:
    server, _ids = fleet
    env = env_for(server)
    shown = await hw_async("health", "policy", "show", env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"# policy default  sha256 {DEFAULT_POLICY.digest}\n")
    assert "shipped default" in shown.stdout and DEFAULT_POLICY_TEXT in shown.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text(XID_13_THRICE.replace('window = "1h"', 'window = "-1h"'))
    refused = await hw_async("health", "policy", "apply", str(bad), env=env)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "line 19: xid[1].window: '-1h' is not a duration" in refused.stderr
    unchanged = json.loads((await hw_async("health", "policy", "show", "-o", "json", env=env)).stdout)
    assert unchanged["digest"] == DEFAULT_POLICY.digest and unchanged["since_position"] is None

    strict = tmp_path / "strict.toml"
    strict.write_text(XID_13_THRICE)
    applied = await hw_async(
        "health", "policy", "apply", str(strict), "--actor", "ana", "-o", "json", env=env
    )
    assert applied.returncode == 0, applied.stderr
    body = json.loads(applied.stdout)
    assert (body["name"], body["digest"], body["actor"]) == (
        "strict",
        load_policy(XID_13_THRICE).digest,
        "operator:cli:ana",
    )
    assert isinstance(body["since_position"], int)

    default = tmp_path / "default.toml"
    default.write_text(DEFAULT_POLICY_TEXT)
    table = await hw_async("health", "backtest", "--policy", str(default), "--since", "30d", env=env)
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith(f"backtest {DEFAULT_POLICY.digest[:12]} against {body['digest'][:12]}")
    backtest = await hw_async("health", "backtest", "--policy", str(default), "-o", "json", env=env)
    assert backtest.returncode == 0, backtest.stderr
    as_json = json.loads(backtest.stdout)
    assert as_json["summary"]["gpus"] == 3 and as_json["next_cursor"] is None
    missing = await hw_async("health", "backtest", "--policy", str(tmp_path / "nope.toml"), env=env)
    assert missing.returncode == 2 and "cannot read the policy file" in missing.stderr
