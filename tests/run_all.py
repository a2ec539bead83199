"""The whole test suite, as the README's test command and `.ci/run` run it.

Runs the habits of docs/architecture.md ("Checks") so nobody has to remember them: formatting,
lint, strict typing of every package, the layering contracts, then pytest (real PostgreSQL: the server at
MODELFORGE_TEST_DATABASE_URL when set, else an embedded one the test session starts itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

STEPS: list[tuple[str, list[str]]] = [
    ("ruff format --check", [str(BIN / "ruff"), "format", "--check", "--quiet", "."]),
    ("ruff check", [str(BIN / "ruff"), "check", "--quiet", "."]),
    ("mypy (strict: every package)", [sys.executable, "-m", "mypy"]),
    ("import-linter contracts", [str(BIN / "lint-imports"), "--no-cache"]),
    ("pytest", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]),
]
# Tests that start servers of their own (PostgreSQL clusters for replication and failover, `serve`
# processes with agents, Prometheus, Chromium) spend much of their time waiting on timeouts,
# promotions and other processes, and the rest of the suite leaves one of two cores mostly idle:
# the whole suite runs them in a pytest of their own beside the rest, which keeps it under 15 minutes.
BESIDE = [
    "tests/test_auto_failover.py",
    "tests/test_failover.py",
    "tests/test_ha_deploy.py",
    "tests/test_read_standby.py",
    "tests/agent_acceptance",
    "tests/test_console_browser.py",
    "tests/test_prometheus_discovery.py",
    "tests/test_webhook_serve.py",
]


def pytest_beside_the_rest(command: list[str]) -> int:
    """`command` without the BESIDE files, and a pytest of those files at the same time; the
    second's output is printed after the first's, so neither interleaves."""
    with tempfile.TemporaryFile(mode="w+") as beside_output:
        beside = subprocess.Popen([*command, *BESIDE], stdout=beside_output, stderr=subprocess.STDOUT)
        try:
            rest = subprocess.call([*command, "--durations=15", *(f"--ignore={path}" for path in BESIDE)])
        finally:
            beside_code = beside.wait()
        beside_output.seek(0)
        print(f"--- pytest {' '.join(BESIDE)} (run beside the rest):", flush=True)
        print(beside_output.read(), flush=True)
    return rest or beside_code


def main() -> int:
    os.chdir(ROOT)
    where = os.environ.get("MODELFORGE_TEST_DATABASE_URL") or "an embedded PostgreSQL (pgserver)"
    print(f"tests run against {where}", flush=True)
    for name, command in STEPS:
        started = time.monotonic()
        print(f"==> {name}", flush=True)
        whole_suite = name == "pytest" and not sys.argv[1:]
        code = pytest_beside_the_rest(command) if whole_suite else subprocess.call(command)
        print(
            f"<== {name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {time.monotonic() - started:.1f}s",
            flush=True,
        )
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
