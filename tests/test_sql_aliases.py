"""No select-list alias may shadow the column it was cast from.

`tx_id::text AS tx_id` made PostgreSQL bind `ORDER BY tx_id` to the text alias, so the log sorted
'100000' before '99999' and the cursor repeated and skipped events. The rule (docs/architecture.md):
an expression of another type gets a name of its own. This scans every SQL string and file in the
repository for a cast aliased to its own column's name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `col::type AS col`, `t.col::type AS col`, `(col)::type AS col`, `CAST(col AS type) AS col`.
SHADOWING_CAST = re.compile(
    r"(?:\b(?:\w+\.)?(\w+)\)?(?:::\w+(?:\[\])?)+|CAST\(\s*(?:\w+\.)?(\w+)\s+AS\s+\w+\s*\))\s+AS\s+(\w+)\b",
    re.IGNORECASE,
)


def shadowing_casts(text: str) -> list[str]:
    found = []
    for m in SHADOWING_CAST.finditer(text):
        column = m.group(1) or m.group(2)
        if column and column.lower() == m.group(3).lower():
            found.append(m.group(0))
    return found


def test_the_scanner_finds_the_trap_that_broke_the_log() -> None:
    assert shadowing_casts("SELECT tx_id::text AS tx_id FROM events ORDER BY tx_id")
    assert shadowing_casts("SELECT e.data::text AS data FROM events e")
    assert shadowing_casts("SELECT CAST(tx_id AS text) AS tx_id FROM events")
    assert not shadowing_casts("SELECT events.data::text AS data_json, tx_id FROM events")


def test_no_query_in_the_repository_aliases_a_cast_to_its_own_column() -> None:
    offenders: list[str] = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("node_modules", "__pycache__")]
        for name in files:
            path = Path(folder) / name
            if path.suffix not in (".py", ".sql") or path == Path(__file__).resolve() or path.is_symlink():
                continue
            for hit in shadowing_casts(path.read_text(encoding="utf-8", errors="replace")):
                offenders.append(f"{path.relative_to(ROOT)}: {hit}")
    assert offenders == []
