"""`modelforge-hw lease ...` and `modelforge-hw decommission ...`: work leases and permanent node
decommission from the server host, straight against the database (as `token` and `rebuild` are).
The same operations are operator routes of the HTTP API (api/http/decommission.py);
docs/operations/RUNBOOK_NODE_DECOMMISSION.md is the on-call procedure.

    modelforge-hw lease acquire NODE --owner O --reason R [--ttl 2h] [--json]
    modelforge-hw lease release NODE LEASE_ID [--reason TEXT]
    modelforge-hw lease list NODE [--json]
    modelforge-hw decommission preview NODE [--json]
    modelforge-hw decommission execute NODE --generation G --digest D --reason R [--json]

NODE (or `--node NODE`) is a node id, an id prefix, a hostname or the node's identity key.
Exit codes (`api.cli.errors.EXIT_CODES`): 0 done; 3 refused because the node changed since the
preview or active work blocks it; 4 the node is decommissioned; 5 unknown node or lease; 2 anything
else refused (one line on stderr says why).
"""

from __future__ import annotations

import getpass
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from api.cli.common import (
    DatabaseUrl,
    LogLevel,
    NodeArgument,
    NodeOption,
    StateDir,
    json_flag,
    required_node,
    resolve_node,
    server_config,
    with_database,
)
from api.cli.errors import exit_code_of, say
from api.cli.moments import duration_option
from api.cli.rendering import print_json
from api.services.wording import gpu_ordered

lease_app = typer.Typer(
    no_args_is_help=True, help="work leases: work that depends on a node blocks its decommission"
)
decommission_app = typer.Typer(no_args_is_help=True, help="retire a node for good (a tombstone; no revival)")

Actor = Annotated[
    str | None, typer.Option("--actor", help="who you are, for the audit log (default: your login name)")
]


def _actor(name: str | None) -> str:
    if not name:
        try:
            name = getpass.getuser()
        except (KeyError, OSError):
            name = "unknown"
    return f"cli:{name}"


def _run(
    node: str,
    database_url: str | None,
    state_dir: Path | None,
    log_level: str | None,
    as_json: bool,
    work: Callable[[Any, str], Awaitable[int]],
) -> int:
    """`work(service, node_id)` against the database; a refusal is one line (and, with `--json`,
    the problem document on stdout) and the exit code of its kind."""
    from api.http.problems import problem_of
    from api.services.errors import DomainError
    from api.wiring import build_services

    config = server_config(database_url=database_url, state_dir=state_dir, log_level=log_level)

    async def wrapped(pool: Any) -> int:
        # What the operator typed (id, prefix, hostname, identity key) -> the node's id.
        ref = await resolve_node(pool, node)
        assert ref is not None
        service = build_services(pool).decommission
        try:
            return await work(service, await service.resolve_node(ref))
        except DomainError as exc:
            if as_json:
                print_json(problem_of(exc))
            say(exc.detail)
            return exit_code_of(exc)

    return with_database(config, wrapped)


def _lease_line(x: Any) -> str:
    expires = x.expires_at.isoformat() if x.expires_at else "never"
    return f"{x.lease_id}  {x.status:8}  owner {x.owner}  expires {expires}  {x.reason}"


@lease_app.command("acquire")
def lease_acquire(
    owner: Annotated[
        str,
        typer.Option("--owner", help="who holds the lease (a team, a job, a component)", show_default=False),
    ],
    reason: Annotated[str, typer.Option("--reason", help="what the work is", show_default=False)],
    node_ref: NodeArgument = None,
    node: NodeOption = None,
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    ttl: Annotated[
        float | None,
        duration_option("--ttl", "expire after 90s, 15m, 2h, 7d (default: until released)"),
    ] = None,
    actor: Actor = None,
    as_json: Annotated[bool, json_flag("print the lease as JSON")] = False,
) -> int:
    """record work that depends on a node (prints the lease id)"""

    async def work(service: Any, node_id: str) -> int:
        lease = await service.acquire_lease(node_id, owner, reason, ttl, actor=_actor(actor))
        if as_json:
            print_json(lease)
        else:
            print(lease.lease_id)
            print(f"lease {lease.lease_id} on node {node_id}: active", file=sys.stderr)
        return 0

    return _run(required_node(node_ref, node), database_url, state_dir, log_level, as_json, work)


@lease_app.command("release")
def lease_release(
    node_ref: NodeArgument = None,
    lease_id: Annotated[str | None, typer.Argument(metavar="LEASE_ID", show_default=False)] = None,
    node: NodeOption = None,
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    reason: Annotated[str, typer.Option("--reason", help="why (for the audit log)")] = "released",
    actor: Actor = None,
    as_json: Annotated[bool, json_flag()] = False,
) -> int:
    """release a work lease"""
    if lease_id is None and node is not None:
        # `lease release --node NODE LEASE_ID`: the one word is the lease.
        node_ref, lease_id = None, node_ref
    if lease_id is None:
        raise typer.BadParameter("name the lease to release", param_hint="'LEASE_ID'")
    released = lease_id

    async def work(service: Any, node_id: str) -> int:
        lease = await service.release_lease(node_id, released, reason, actor=_actor(actor))
        if as_json:
            print_json(lease)
        else:
            print(f"lease {lease.lease_id} on node {node_id}: released")
        return 0

    return _run(required_node(node_ref, node), database_url, state_dir, log_level, as_json, work)


@lease_app.command("list")
def lease_list(
    node_ref: NodeArgument = None,
    node: NodeOption = None,
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    as_json: Annotated[bool, json_flag()] = False,
) -> int:
    """a node's unreleased work leases (active or expired)"""

    async def work(service: Any, node_id: str) -> int:
        leases = await service.list_leases(node_id)
        if as_json:
            print_json({"items": leases})
        else:
            if not leases:
                print(f"node {node_id} holds no work lease")
            for x in leases:
                print(_lease_line(x))
        return 0

    return _run(required_node(node_ref, node), database_url, state_dir, log_level, as_json, work)


@decommission_app.command("preview")
def decommission_preview(
    node_ref: NodeArgument = None,
    node: NodeOption = None,
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    as_json: Annotated[bool, json_flag("print the preview as JSON")] = False,
) -> int:
    """generation, dependencies, blockers and digest of a node's decommission"""

    async def work(service: Any, node_id: str) -> int:
        p = await service.preview(node_id)
        if as_json:
            print_json(p)
            return 0
        d = p.dependencies
        print(f"node        {p.node_id}  ({p.hostname or '-'}, identity {p.identity_key})")
        print(f"status      {p.status}")
        print(f"generation  {p.generation}")
        print(f"digest      {p.digest}")
        print(f"leases      {len(d.leases)} active")
        for x in d.leases:
            print(f"  {_lease_line(x)}")
        print(f"credentials {len(d.credentials)} active (revoked by the decommission)")
        for c in d.credentials:
            print(f"  {c.credential_id}  {c.hostname}  issued {c.issued_at.isoformat()}")
        print(f"accelerators {len(d.accelerators)} (marked decommissioned)")
        for a in gpu_ordered(d.accelerators):
            print(f"  {a.uuid}  index {a.index}  {a.name or '-'}  {a.status}")
        print(f"telemetry   {len(d.telemetry)} current rows (cleared)")
        if p.blockers:
            print(f"BLOCKED by {len(p.blockers)} active work lease(s):")
            for b in p.blockers:
                print(f"  {b.detail}")
            print(f"release them (modelforge-hw lease release {p.node_id} LEASE_ID), then preview again")
            return 3  # EXIT_CODES[Conflict]: something blocks it
        print(
            "execute with: modelforge-hw decommission execute "
            f"{p.node_id} --generation {p.generation} --digest {p.digest} --reason '...'"
        )
        return 0

    return _run(required_node(node_ref, node), database_url, state_dir, log_level, as_json, work)


@decommission_app.command("execute")
def decommission_execute(
    generation: Annotated[
        int, typer.Option("--generation", help="the preview's generation", show_default=False)
    ],
    digest: Annotated[str, typer.Option("--digest", help="the preview's digest", show_default=False)],
    reason: Annotated[
        str,
        typer.Option("--reason", help="why the node is retired (kept in the tombstone)", show_default=False),
    ],
    node_ref: NodeArgument = None,
    node: NodeOption = None,
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    actor: Actor = None,
    as_json: Annotated[bool, json_flag("print the result (or the refusal) as JSON")] = False,
) -> int:
    """decommission a node as previewed (irreversible)"""

    async def work(service: Any, node_id: str) -> int:
        done = await service.execute(node_id, generation, digest, reason, actor=_actor(actor))
        if as_json:
            print_json(done)
        else:
            print(
                f"node {done.node_id}: decommissioned at {done.decommissioned_at.isoformat()} by "
                f"{done.actor}; {len(done.revoked_credentials)} credential(s) revoked, "
                f"{len(done.decommissioned_accelerators)} accelerator(s) decommissioned, "
                f"{len(done.cleared_telemetry)} telemetry row(s) cleared"
            )
        return 0

    return _run(required_node(node_ref, node), database_url, state_dir, log_level, as_json, work)
