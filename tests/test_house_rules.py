"""The house a newcomer reads: every module docs/architecture.md names exists, no product file
(and no Python file of ours: benchmarks and tests too) holds more than one job's worth of lines,
code, benchmarks, tests and architecture docs say why rather than history, the release is named
once (the package metadata), and no await of the product or the benchmarks uses asyncio.wait_for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_PACKAGES = ("runtime", "ledger", "domain", "projections", "collectors", "agent", "api")
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 600


def _product_files(*suffixes: str) -> list[Path]:
    found: list[Path] = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in suffixes and path.is_file() and not path.is_symlink():
                if "__pycache__" not in path.parts:
                    found.append(path)
    return found


def _our_python_files() -> list[Path]:
    """Every .py file of the repository's own: not a virtual environment, cache or build output."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts[:-1]
        if any(
            p.startswith(".") or p in ("__pycache__", "build", "dist") or p.endswith(".egg-info")
            for p in parts
        ):
            continue
        found.append(path)
    return found


def test_every_path_the_architecture_names_exists() -> None:
    text = ARCHITECTURE.read_text()
    missing = []
    for match in re.finditer(
        r"`((?:runtime|ledger|domain|projections|collectors|agent|api|bench|tests|deploy)/[\w./-]*)`", text
    ):
        if not (ROOT / match.group(1)).exists():
            missing.append(match.group(1))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    # The longest prefix that is a module or package; the rest must be a name defined in it.
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if not base.is_dir() else base / "__init__.py"
        if module.exists():
            rest = parts[cut:]
            if not rest:
                return True
            return (
                re.search(rf"^\s*(?:class|def|async def)?\s*{re.escape(rest[0])}\b", module.read_text(), re.M)
                is not None
            )
    return False


def test_every_module_the_architecture_names_exists() -> None:
    text = ARCHITECTURE.read_text()
    missing = []
    for match in re.finditer(
        r"`((?:runtime|ledger|domain|projections|collectors|agent|api)(?:\.\w+)+)", text
    ):
        if not _module_exists(match.group(1)):
            missing.append(match.group(1))
    assert not missing, f"docs/architecture.md names modules or names that do not exist: {missing}"


@pytest.mark.parametrize("path", _product_files(".py", ".sql"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_product_file_holds_more_than_one_jobs_worth_of_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by job"


def test_no_python_file_of_ours_holds_more_than_one_jobs_worth_of_lines() -> None:
    files = _our_python_files()
    assert any(p.parts[-2] == "bench" for p in files) and any(p.parts[-2] == "tests" for p in files)
    too_long = []
    for path in files:
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not too_long, f"over {MAX_LINES} lines, split each by job:\n" + "\n".join(too_long)


HISTORY = re.compile(
    r"\bissues?\s+#?\d+|\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh"
    r"|twelfth|thirteenth|fourteenth|fifteenth|\d+(?:st|nd|rd|th))\s+steps?\b",
    re.IGNORECASE,
)


def _history_sources() -> list[Path]:
    tests_and_benches = sorted(
        p
        for folder in ("tests", "bench")
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    )
    return [*_product_files(".py", ".sql", ".j2"), *tests_and_benches, ROOT / "schema.sql", ARCHITECTURE]


def test_code_tests_and_the_architecture_say_why_not_history() -> None:
    found = []
    for path in _history_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line) and "upstream" not in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "history belongs in commits and docs/performance.md:\n" + "\n".join(found)


def test_the_release_is_named_once_in_the_package_metadata() -> None:
    literal = re.compile(r"^\s*\w*VERSION\w*\s*(?::\s*str\s*)?=\s*['\"]\d+\.\d+\.\d+['\"]", re.M)
    found = [str(p.relative_to(ROOT)) for p in _product_files(".py") if literal.search(p.read_text())]
    assert not found, f"release constants besides pyproject.toml's version: {found}"


def test_no_product_code_bounds_an_await_with_wait_for() -> None:
    """On Python 3.11 `asyncio.wait_for` loses a cancellation that arrives as the awaited thing
    completes (the task then runs on, and a shutdown waiting on it waits for ever);
    `async with asyncio.timeout(...)` does not."""
    files = [*_product_files(".py"), *sorted((ROOT / "bench").rglob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "wait_for(" in line and not line.lstrip().startswith("#")
    ]
    assert not found, "use `async with asyncio.timeout(...)` instead of asyncio.wait_for:\n" + "\n".join(
        found
    )
