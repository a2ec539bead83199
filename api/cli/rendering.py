"""What the commands print: terminal-sized tables, JSON and YAML documents, progress lines on a
terminal's stderr, and the few value formats the tables share."""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class Output(enum.StrEnum):
    """`-o` of the commands over HTTP."""

    table = "table"
    wide = "wide"
    json = "json"
    yaml = "yaml"


def print_json(value: Any) -> None:
    """One JSON document on one line (the database commands' `--json`, a followed event)."""
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def plain(value: Any) -> Any:
    return msgspec.to_builtins(value)


def emit(value: Any, output: Output) -> bool:
    """`value` as an indented JSON document or as YAML when `output` asks for one; whether it
    printed it (the table formats are each command's own)."""
    if output is Output.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(value).decode(), indent=2) + "\n")
    elif output is Output.yaml:
        sys.stdout.write(yaml_text(value))
    else:
        return False
    return True


def listing(
    items: Sequence[T],
    *,
    as_json: bool,
    none: str,
    header: list[str],
    row: Callable[[T], list[str]],
    ids: tuple[int, ...] = (0,),
) -> None:
    """A database command's list: the items as one JSON document (`--json`), the line `none`
    when there are none, or a table of one `row` each."""
    if as_json:
        print_json(items)
    elif not items:
        print(none)
    else:
        table(header, [row(x) for x in items], ids=ids)


def yaml_text(value: Any) -> str:
    import yaml

    return str(yaml.safe_dump(plain(value), sort_keys=False, allow_unicode=True))


def short(value: object, width: int = 80) -> str:
    """`value` as JSON, cut to `width` with an ellipsis."""
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= width else text[: width - 1] + "…"


def when(moment: datetime | None) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if moment else ""


def driver(version: str | None, cuda_version: str | None) -> str:
    """The driver's version with the CUDA version it supports; `-` for a host without one."""
    if not version:
        return "-"
    return f"{version} (CUDA {cuda_version})" if cuda_version else version


def gib(size: int | None) -> str:
    return f"{size / 2**30:.1f} GiB" if size else ""


def nothing(what: str) -> None:
    sys.stdout.write(f"no {what}\n")


def progress_printer() -> Callable[[int, int, float], None] | None:
    """Events done out of all, on a terminal's stderr (None when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, rate: float) -> None:
        sys.stderr.write(f"\r  {done}/{total} events  {rate:,.0f} events/s   ")
        sys.stderr.flush()

    return show


def erase_progress() -> None:
    """Clear the progress line a command drew on a terminal, so only results stay on screen."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def fit_widths(natural: list[int], fixed: set[int], available: int, *, least: int = 3) -> list[int]:
    """Column widths that fit `available`: the `fixed` columns keep their natural width; the widest
    of the others are cut first, down to one common cap (never below `least`)."""
    free = [i for i in range(len(natural)) if i not in fixed]
    budget = available - sum(natural[i] for i in fixed)
    if sum(natural[i] for i in free) <= budget or not free:
        return list(natural)
    cap = max((natural[i] for i in free), default=least)
    while cap > least and sum(min(natural[i], cap) for i in free) > budget:
        cap -= 1
    return [natural[i] if i in fixed else min(natural[i], cap) for i in range(len(natural))]


def table(
    header: list[str], rows: list[list[str]], *, ids: tuple[int, ...] = (0,), wrap: tuple[int, ...] = ()
) -> None:
    """A table as wide as the terminal (or $COLUMNS). Identifier columns (`ids`) are never cut, so
    they can be copied; `wrap` columns fold onto more lines; the others are cut, widest first, and
    end in an ellipsis. Piped or redirected (and no $COLUMNS), every column is whole, as kubectl
    prints it: what reads the output, not a guessed width, decides what to cut."""
    from rich.console import Console
    from rich.table import Table

    # Cells are data, never markup: a PCI bus id `00000000:AB:00.0` holds the emoji code `:AB:`, and a
    # reason may hold `[...]`, which rich would otherwise render as an emoji or a style.
    console = Console(soft_wrap=False, highlight=False, markup=False, emoji=False)
    natural = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    gaps = 2 * (len(header) - 1)  # the padding rich puts between columns
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(
            soft_wrap=False, highlight=False, markup=False, emoji=False, width=sum(natural) + gaps
        )
        wrap = ()
    widths = fit_widths(natural, set(ids) | set(wrap), console.width - gaps)
    if wrap:
        # A folding column takes what the others leave.
        rest = console.width - gaps - sum(w for i, w in enumerate(widths) if i not in wrap)
        for i in wrap:
            widths[i] = max(10, min(natural[i], rest // len(wrap)))
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for i, h in enumerate(header):
        if i in wrap:
            t.add_column(h, width=widths[i], overflow="fold")
        else:
            t.add_column(h, width=widths[i], no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*r)
    console.print(t)
