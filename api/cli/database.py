"""The commands that keep the ledger on the server host, straight against the database:
`migrate`, `refresh`, `rebuild [--verify]`, `verify` and `retention run`."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from api.cli.common import (
    CollectorTimeout,
    DatabaseUrl,
    LogLevel,
    NodeId,
    RetentionHours,
    StateDir,
    json_flag,
    server_config,
    with_database,
)
from api.cli.errors import CliError, say
from api.cli.rendering import erase_progress, print_json, progress_printer


def migrate(database_url: DatabaseUrl = None, state_dir: StateDir = None, log_level: LogLevel = None) -> int:
    """bring the database schema to this release (idempotent)"""
    config = server_config(database_url=database_url, state_dir=state_dir, log_level=log_level)
    if sys.stderr.isatty():
        where = "the embedded PostgreSQL" if not config.database_url else "MODELFORGE_DATABASE_URL"
        sys.stderr.write(f"  migrating {where}: schema.sql, then numbered steps not yet applied...\n")

    async def work(pool: Any) -> int:
        async with pool.acquire() as conn:
            version = await conn.fetchval("SELECT max(version) FROM schema_version")
        print(f"schema is at version {version}")
        return 0

    return with_database(config, work)


def refresh(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    node_id: NodeId = None,
    collector_timeout: CollectorTimeout = None,
    as_json: Annotated[bool, json_flag("print the run as JSON")] = False,
) -> int:
    """refresh the local host's inventory into the ledger"""
    config = server_config(
        database_url=database_url,
        state_dir=state_dir,
        log_level=log_level,
        node_id=node_id,
        collector_timeout=collector_timeout,
    )

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
        if as_json or not sys.stdout.isatty():
            print_json(outcome)
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

    return with_database(config, work)


def rebuild(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="rebuild into shadows and compare with the live read models; exit 1 on any difference",
        ),
    ] = False,
    as_json: Annotated[bool, json_flag("print the report as JSON")] = False,
) -> int:
    """rebuild every projection from the log"""
    config = server_config(database_url=database_url, state_dir=state_dir, log_level=log_level)

    async def work(pool: Any) -> int:
        from ledger.reading import UndecodableEvent
        from projections.inventory import ALL_PROJECTIONS
        from projections.rebuild import rebuild as rebuild_projections

        try:
            report = await rebuild_projections(
                pool, ALL_PROJECTIONS, verify=verify, progress=progress_printer()
            )
        except UndecodableEvent as exc:
            erase_progress()
            say(f"rebuild refused, nothing was swapped: {exc}")
            return 1
        erase_progress()
        if as_json:
            print_json(report)
        else:
            action = "verified" if verify else "rebuilt and swapped in"
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

    return with_database(config, work)


def verify(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    as_json: Annotated[bool, json_flag()] = False,
) -> int:
    """walk every stream's hash chain and re-fold every projection"""
    config = server_config(database_url=database_url, state_dir=state_dir, log_level=log_level)

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
            report = await rebuild(pool, ALL_PROJECTIONS, verify=True, progress=progress_printer())
        except UndecodableEvent as exc:
            refused = str(exc)
        erase_progress()
        if as_json:
            print_json(
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

    return with_database(config, work)


retention_app = typer.Typer(no_args_is_help=True, help="bounded telemetry")


@retention_app.command("run")
def retention_run(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    retention_hours: RetentionHours = None,
    as_json: Annotated[bool, json_flag()] = False,
) -> int:
    """prune observation events now, and seal the day segments whose day is over"""
    config = server_config(
        database_url=database_url, state_dir=state_dir, log_level=log_level, retention_hours=retention_hours
    )

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
        if as_json:
            print_json(report)
        else:
            print(
                f"pruned {report.deleted} observation events received before {report.cutoff.isoformat()} "
                f"({report.batches} batches); lifecycle events are never pruned"
            )
            if report.segments_sealed:
                print(
                    f"sealed the day segments of {', '.join(d.isoformat() for d in report.segments_sealed)}"
                )
        return 0

    return with_database(config, work)
