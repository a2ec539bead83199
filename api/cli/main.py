"""`modelforge-hw`: the operator's command line.

Exit 0 on success; non-zero with one line saying what went wrong and what to do next.
Human tables on a TTY, JSON with `--json` (or when stdout is not a TTY, where it says so).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from api.cli.common import (
    CliError,
    _config,
    _with_database,
    add_node_argument,
    add_setting,
    erase_progress,
    exit_code_of,
    parse_moment,
    resolve_node,
    table,
)
from api.services.errors import DomainError
from runtime.logs import configure_logging
from runtime.settings import SettingError, from_env

VERSION = "0.1.0"
OPERATOR_COMMANDS = ("node", "gpu", "events")


def _print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


# --- commands ----------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from api.http.server import serve

    return serve(_config(args))


def cmd_migrate(args: argparse.Namespace) -> int:
    config = _config(args)
    if sys.stderr.isatty():
        where = "the embedded PostgreSQL" if not config.database_url else "MODELFORGE_DATABASE_URL"
        sys.stderr.write(f"  migrating {where}: schema.sql, then numbered steps not yet applied...\n")

    async def work(pool: Any) -> int:
        async with pool.acquire() as conn:
            version = await conn.fetchval("SELECT max(version) FROM schema_version")
        print(f"schema is at version {version}")
        return 0

    return _with_database(config, work)


def cmd_refresh(args: argparse.Namespace) -> int:
    config = _config(args)

    async def work(pool: Any) -> int:
        from api.services.errors import NodeIsDecommissioned
        from api.wiring import build_service

        try:
            outcome = await build_service(pool, config).refresh()
        except NodeIsDecommissioned as exc:
            raise CliError(
                f"{exc.detail}; a decommissioned identity cannot come back: re-provision this host under a "
                "new identity (docs/operations/RUNBOOK_NODE_DECOMMISSION.md)"
            ) from exc
        if args.json or not sys.stdout.isatty():
            _print_json(outcome)
        else:
            print(
                f"node {outcome.node_id}: {outcome.outcome}, inventory {outcome.inventory_status}"
                f" ({outcome.duration_seconds:.2f}s)"
            )
            for reason in outcome.reasons:
                print(f"  reason: {reason}")
            for e in outcome.events:
                if e.event_class == "lifecycle":
                    print(f"  #{e.global_position} v{e.stream_version} {e.event_type}")
            print(f"  {sum(1 for e in outcome.events if e.event_class == 'observation')} observation events")
        return 0 if outcome.outcome == "succeeded" else 3

    return _with_database(config, work)


def _progress_printer() -> Callable[[int, int, float], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, rate: float) -> None:
        sys.stderr.write(f"\r  {done}/{total} events  {rate:,.0f} events/s   ")
        sys.stderr.flush()

    return show


def cmd_rebuild(args: argparse.Namespace) -> int:
    config = _config(args)

    async def work(pool: Any) -> int:
        from ledger.reading import UndecodableEvent
        from projections.inventory import ALL_PROJECTIONS
        from projections.rebuild import rebuild

        try:
            report = await rebuild(pool, ALL_PROJECTIONS, verify=args.verify, progress=_progress_printer())
        except UndecodableEvent as exc:
            erase_progress()
            print(f"modelforge-hw: rebuild refused, nothing was swapped: {exc}", file=sys.stderr)
            return 1
        erase_progress()
        if args.json:
            _print_json(report)
        else:
            action = "verified" if args.verify else "rebuilt and swapped in"
            print(
                f"{report.events} events in {report.streams} streams {action} in {report.seconds:.2f}s "
                f"({report.events_per_second:,.0f} events/s)"
            )
            for d in report.differences:
                print(
                    f"DIFFERENCE in {d.table}: {d.only_live_count} rows only live, "
                    f"{d.only_rebuilt_count} rows only in the rebuild"
                )
                for r in d.only_live:
                    print(f"  live:    {r}")
                for r in d.only_rebuilt:
                    print(f"  rebuilt: {r}")
        if report.differences:
            print(
                "read models differ from the log; run `modelforge-hw rebuild` to replace them",
                file=sys.stderr,
            )
            return 1
        return 0

    return _with_database(config, work)


def _moment(text: str | None) -> datetime | None:
    """An ISO 8601 time (without an offset: UTC, the ledger's clock) or a duration ago (`1h`)."""
    return None if text is None else parse_moment(text, datetime.now(UTC))


def _table(rows: list[list[str]], header: list[str], ids: tuple[int, ...] = (0,)) -> None:
    """Printed to the terminal's width (api.cli.common.table); `ids` are never cut."""
    table(header, rows, ids=ids)


def _short(value: object, width: int = 80) -> str:
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= width else text[: width - 1] + "…"


def _page_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 1000, not {text!r}")
    return value


def cmd_replay(args: argparse.Namespace) -> int:
    config = _config(args)
    fmt = args.format or ("table" if sys.stdout.isatty() else "jsonl")
    as_of = _moment(args.as_of)

    async def work(pool: Any) -> int:
        from api.services.repository import AuditRepository, HardwareRepository

        args.node = await resolve_node(pool, args.node)
        hardware = HardwareRepository(pool)
        if as_of is not None:
            audit = AuditRepository(pool, hardware)
            # One fold of the log serves both tables.
            nodes, accs, position = await audit.inventory_as_of(as_of, node_id=args.node)
            if fmt == "jsonl":
                for node in nodes:
                    _print_json({"kind": "node", "as_of": as_of, "position": position, "node": node})
                for acc in accs:
                    _print_json(
                        {"kind": "accelerator", "as_of": as_of, "position": position, "accelerator": acc}
                    )
            else:
                print(f"inventory as of {as_of.isoformat()} (folded to global position {position})")
                _table(
                    [
                        [
                            n.id,
                            n.hostname or "",
                            n.status,
                            n.inventory_status,
                            n.driver_version or "",
                            (n.fingerprint or "")[:16],
                        ]
                        for n in nodes
                    ],
                    ["NODE", "HOSTNAME", "STATUS", "INVENTORY", "DRIVER", "FINGERPRINT"],
                )
                print()
                _table(
                    [
                        [a.node_id[:8], str(a.index), a.uuid, a.name or "", a.pci_bus_id or "", a.status]
                        for a in accs
                    ],
                    ["NODE", "INDEX", "UUID", "NAME", "PCI", "STATUS"],
                    ids=(0, 2),
                )
            return 0
        cursor: str | None = None
        rows: list[list[str]] = []
        printed = 0
        caught_up = False
        while True:
            page = await hardware.list_events(
                node_id=args.node,
                types=args.type or None,
                event_class=args.event_class,
                accelerator_uuid=args.accelerator,
                since=_moment(args.since),
                until=_moment(args.until),
                cursor=cursor,
                limit=min(args.page_size, args.limit - printed),
                # Following: once caught up, hold each read until an event commits.
                wait_seconds=30 if caught_up else 0,
            )
            cursor = page.next_cursor
            for e in page.items:
                row = [
                    str(e.global_position),
                    str(e.stream_version),
                    e.event_type,
                    e.metadata.observed_at.isoformat() if e.metadata and e.metadata.observed_at else "",
                    e.metadata.received_at.isoformat() if e.metadata else "",
                    e.recorded_at.isoformat() if e.recorded_at else "",
                    e.metadata.source if e.metadata else "",
                    _short(e.data)
                    if e.undecodable is None
                    else "UNDECODABLE " + _short(e.undecodable.stored_data),
                ]
                if fmt == "jsonl":
                    _print_json(e)
                elif args.follow:
                    print("  ".join(row), flush=True)  # a live stream cannot wait for the table
                else:
                    rows.append(row)
            if fmt == "jsonl" and args.follow:
                sys.stdout.flush()
            printed += len(page.items)
            if fmt == "table" and not args.follow and sys.stderr.isatty():
                sys.stderr.write(f"\r  {printed:,} events read   ")
                sys.stderr.flush()
            if printed >= args.limit:
                break
            if not page.has_more:
                if not args.follow:
                    break
                caught_up = True
        if fmt == "table" and not args.follow:
            erase_progress()
            _table(
                rows,
                ["POSITION", "VERSION", "TYPE", "OBSERVED", "RECEIVED", "RECORDED", "SOURCE", "DATA"],
                ids=(0, 1, 2),
            )
        return 0

    return _with_database(config, work)


def cmd_verify(args: argparse.Namespace) -> int:
    config = _config(args)

    async def work(pool: Any) -> int:
        from ledger.reading import UndecodableEvent
        from ledger.verify import find_undecodable, verify_chains
        from projections.inventory import ALL_PROJECTIONS
        from projections.rebuild import RebuildReport, rebuild

        async with pool.acquire() as conn:
            chains = await verify_chains(conn)
            undecodable = await find_undecodable(conn)
        # Every check runs to the end: an event the catalog refuses makes the re-fold impossible,
        # which is itself reported, beside the findings that name the events.
        report: RebuildReport | None = None
        refused: str | None = None
        try:
            report = await rebuild(pool, ALL_PROJECTIONS, verify=True, progress=_progress_printer())
        except UndecodableEvent as exc:
            refused = str(exc)
        erase_progress()
        if args.json:
            _print_json(
                {"chains": chains, "undecodable": undecodable, "projections": report, "refused": refused}
            )
        else:
            print(
                f"hash chains: {chains.streams} streams, {chains.lifecycle_events} lifecycle events, "
                f"{len(chains.breaks)} breaks"
            )
            for b in chains.breaks:
                where = (
                    f" version {b.stream_version} position {b.global_position}" if b.global_position else ""
                )
                print(f"BREAK stream {b.stream_id}{where}: {b.kind}: {b.detail}")
            print(f"event catalog: {len(undecodable)} events cannot be decoded")
            for u in undecodable:
                print(
                    f"UNDECODABLE stream {u.stream_id} version {u.stream_version} "
                    f"position {u.global_position}: {u.error}"
                )
            if report is not None:
                print(
                    f"projections: {report.events} events re-folded, {len(report.differences)} tables differ"
                )
                for d in report.differences:
                    print(
                        f"DIFFERENCE in {d.table}: {d.only_live_count} rows only live, "
                        f"{d.only_rebuilt_count} only in the rebuild"
                    )
            else:
                print(f"projections: not compared, the log cannot be re-folded: {refused}")
        if chains.breaks or undecodable or refused or (report is not None and report.differences):
            print("the ledger failed verification: see the lines above", file=sys.stderr)
            return 1
        return 0

    return _with_database(config, work)


def cmd_retention(args: argparse.Namespace) -> int:
    config = _config(args)

    async def work(pool: Any) -> int:
        from datetime import timedelta

        from ledger.retention import prune_observations

        def show(deleted: int, batches: int) -> None:
            sys.stderr.write(f"\r  {deleted:,} observation events pruned ({batches} batches)   ")
            sys.stderr.flush()

        report = await prune_observations(
            pool, keep=timedelta(hours=config.retention_hours), progress=show if sys.stderr.isatty() else None
        )
        erase_progress()
        if args.json:
            _print_json(report)
        else:
            print(
                f"pruned {report.deleted} observation events received before {report.cutoff.isoformat()} "
                f"({report.batches} batches); lifecycle events are never pruned"
            )
        return 0

    return _with_database(config, work)


# --- parser ------------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    for name in ("database_url", "state_dir", "log_level"):
        add_setting(p, name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelforge-hw", description="ModelForge hardware plane")
    parser.add_argument("--version", action="version", version=f"modelforge-hw {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the API server")
    _common(p)
    for name in (
        "host",
        "port",
        "node_id",
        "startup_refresh",
        "collector_timeout",
        "stale_after",
        "offline_after",
        "retention_hours",
        "retention_interval",
        "rendered_reads_mib",
        "state_cache_streams",
        "report_transactions",
    ):
        add_setting(p, name)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("migrate", help="bring the database schema to this release (idempotent)")
    _common(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("refresh", help="refresh the local host's inventory into the ledger")
    _common(p)
    add_setting(p, "node_id")
    add_setting(p, "collector_timeout")
    p.add_argument("--json", action="store_true", help="print the run as JSON")
    p.set_defaults(func=cmd_refresh)

    p = sub.add_parser("rebuild", help="rebuild every projection from the log")
    _common(p)
    p.add_argument(
        "--verify",
        action="store_true",
        help="rebuild into shadows and compare with the live read models; exit 1 on any difference",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_rebuild)
    p = sub.add_parser("replay", help="the audit log, or the inventory as of a moment")
    _common(p)
    add_node_argument(p, required=False)
    p.add_argument("--gpu", "--accelerator", dest="accelerator", help="GPU UUID")
    p.add_argument("--type", action="append", help="event type (repeatable)")
    p.add_argument("--class", dest="event_class", choices=["lifecycle", "observation"])
    p.add_argument("--since", help="recorded at or after: ISO 8601 time or a duration ago (30m, 1h, 2d)")
    p.add_argument("--until", help="recorded before: ISO 8601 time or a duration ago (30m, 1h, 2d)")
    p.add_argument("--limit", type=int, default=1_000_000, help="at most this many events")
    p.add_argument(
        "--page-size",
        type=_page_size,
        default=1000,
        help="events read per round trip (1-1000)",
    )
    p.add_argument("--format", choices=["table", "jsonl"], help="default: table on a TTY, else jsonl")
    p.add_argument(
        "--follow",
        action="store_true",
        help="after the log so far, keep printing events as they commit (the change feed)",
    )
    p.add_argument("--as-of", help="reconstruct the inventory as it stood at this time (ISO 8601)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("verify", help="walk every stream's hash chain and re-fold every projection")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("retention", help="bounded telemetry")
    retention = p.add_subparsers(dest="retention_command", required=True)
    p = retention.add_parser("run", help="prune observation events now")
    _common(p)
    add_setting(p, "retention_hours")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_retention)

    # Agent plane (issue 4): `token ...`, `credential ...` (operator) and `agent enroll|run`.
    from agent.cli import register as register_agent_commands
    from api.cli.enrollment import register as register_enrollment_commands

    register_enrollment_commands(sub, _common)
    register_agent_commands(sub)
    # Work leases and permanent decommission (issue 5): `lease ...`, `decommission ...`.
    from api.cli.decommission import register as register_decommission_commands

    register_decommission_commands(sub, _common)
    # Read-only operator tokens (issue 13): `viewer-token ...`.
    from api.cli.scopes import register as register_viewer_commands

    register_viewer_commands(sub, _common)
    # Listed here for `--help`; `main` hands these words to the Typer app before argparse parses.
    for name, summary in (
        ("node", "compute nodes over the HTTP API: list, show (MODELFORGE_SERVER, MODELFORGE_TOKEN)"),
        ("gpu", "GPUs over the HTTP API: list, show"),
        ("events", "the audit log over the HTTP API; --follow for the change feed"),
    ):
        sub.add_parser(name, help=summary, add_help=False)
    from api.cli.completion import register as register_completion

    register_completion(sub)
    return parser


def _log_json() -> bool | None:
    value = from_env("log_json")
    return None if value is None else bool(value)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in OPERATOR_COMMANDS:
        # The read commands over HTTP live on Typer (api.cli.operator); see its docstring.
        from api.cli.operator import run as run_operator

        try:
            configure_logging(level=str(from_env("log_level")), json=_log_json())
            return run_operator(words)
        except (CliError, SettingError) as exc:
            print(f"modelforge-hw: {exc}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    args.parser = parser
    try:
        configure_logging(
            level=getattr(args, "log_level", None) or str(from_env("log_level")), json=_log_json()
        )
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except (CliError, SettingError) as exc:
        print(f"modelforge-hw: {exc}", file=sys.stderr)
        return 2
    except DomainError as exc:
        print(f"modelforge-hw: {exc.detail}", file=sys.stderr)
        return exit_code_of(exc)
    except Exception as exc:
        from collectors.identity import IdentityError

        hint = ""
        if isinstance(exc, IdentityError):
            hint = ""
        elif isinstance(exc, OSError | ConnectionError):
            hint = " (is the database reachable? check MODELFORGE_DATABASE_URL)"
        print(f"modelforge-hw: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
