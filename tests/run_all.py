"""The whole test suite, as the README's test command and `.ci/run` run it.

Runs the habits of docs/architecture.md ("Checks") so nobody has to remember them: formatting,
lint, strict typing of every package, the layering contracts, then pytest (real PostgreSQL: the server at
MODELFORGE_TEST_DATABASE_URL when set, else an embedded one the test session starts itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def main() -> int:
    os.chdir(ROOT)
    where = os.environ.get("MODELFORGE_TEST_DATABASE_URL") or "an embedded PostgreSQL (pgserver)"
    print(f"tests run against {where}", flush=True)
    for name, command in STEPS:
        started = time.monotonic()
        print(f"==> {name}", flush=True)
        code = subprocess.call(command)
        print(
            f"<== {name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {time.monotonic() - started:.1f}s",
            flush=True,
        )
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
