"""The read side's statements (api/services/reads/statement.py): fixed fragments whose named slots
become numbered parameters, so no value ever becomes SQL text; and no read builds SQL from an
f-string."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.services.reads import accelerators, discovery, fleet, nodes
from api.services.reads.statement import Query, Statement, slots_of

ROOT = Path(__file__).resolve().parent.parent


def test_slots_are_numbered_in_order_of_first_appearance_and_shared() -> None:
    statement = (
        Query("SELECT * FROM t WHERE a > {after}")
        .add(" AND b = {b} AND c BETWEEN {after} AND {limit}")
        .add(" LIMIT {limit}")
        .build()
    )
    assert statement.sql == "SELECT * FROM t WHERE a > $1 AND b = $2 AND c BETWEEN $1 AND $3 LIMIT $3"
    assert statement.slots == ("after", "b", "limit")
    assert statement.args({"limit": 5, "after": "x", "b": None, "unused": 1}) == ["x", None, 5]
    with pytest.raises(KeyError, match="limit"):
        statement.args({"after": "x", "b": 1})


def test_conditions_stand_together_in_one_where_clause() -> None:
    q = Query("SELECT 1 FROM t").where("a = {a}").where("b = {b}").add(" ORDER BY a")
    assert q.build().sql == "SELECT 1 FROM t WHERE a = $1 AND b = $2 ORDER BY a"
    with pytest.raises(ValueError, match="WHERE"):
        q.where("c = {c}")
    assert Query("SELECT 1").build() == Statement("SELECT 1", ())


def test_literal_braces_are_sql_and_a_slot_is_only_a_name() -> None:
    assert Query("SELECT '{{}}'::int[] WHERE x = {x}").build().sql == "SELECT '{}'::int[] WHERE x = $1"
    for bad in ("{}", "{0}", "{x!r}", "{x:>3}", "{x.y}", "{x[0]}"):
        with pytest.raises(ValueError):
            slots_of(f"SELECT {bad}")


@given(values=st.lists(st.text(), min_size=3, max_size=3))
def test_values_never_reach_the_text(values: list[str]) -> None:
    statement = Query("SELECT {a}, {b}").where("c = {c}").build()
    assert statement.sql == "SELECT $1, $2 WHERE c = $3"
    assert statement.args(dict(zip("abc", values, strict=True))) == values


@pytest.mark.parametrize(
    ("shape", "arity"),
    [(nodes._page, 4), (accelerators._page, 4), (fleet._page, 6), (discovery._statement, 2)],
    ids=["nodes", "accelerators", "fleet", "discovery"],
)
def test_every_shape_of_every_filtered_read_numbers_its_parameters_densely(shape: object, arity: int) -> None:
    for flags in itertools.product((False, True), repeat=arity):
        statement: Statement = shape(*flags)  # type: ignore[operator]
        numbers = {int(n) for n in re.findall(r"\$(\d+)", statement.sql)}
        assert numbers == set(range(1, len(statement.slots) + 1)), (flags, statement.sql)
        assert "{" not in statement.sql.replace("'{}'", ""), statement.sql
        assert statement.sql.count(" WHERE ") >= 1


# Every module of the read side but the builder, the one place that writes a parameter's number.
READ_SIDE = [
    *sorted(p for p in (ROOT / "api" / "services" / "reads").glob("*.py") if p.name != "statement.py"),
    *sorted((ROOT / "api" / "services" / "metrics").glob("*.py")),
    ROOT / "api" / "services" / "audit.py",
]
SQL_WORDS = re.compile(r"\b(SELECT|WHERE|AND|FROM|ORDER BY|LIMIT|JOIN)\b")


@pytest.mark.parametrize("path", READ_SIDE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_read_builds_sql_from_an_f_string(path: Path) -> None:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)
            )
            # SQL words, or a parameter number made in the string (`= ${len(args)}`).
            numbered = any(
                isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.endswith("$")
                for v in node.values
            )
            if SQL_WORDS.search(text) or numbered:
                found.append(f"line {node.lineno}: {text[:80]}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "format":
            found.append(f"line {node.lineno}: str.format")
    assert not found, found
