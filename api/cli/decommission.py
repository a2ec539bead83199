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
Exit codes (`api.cli.main.EXIT_CODES`): 0 done;
3 refused because the node changed since the preview or active work blocks it; 4 the node is
decommissioned; 5 unknown node or lease; 2 anything else refused (one line on stderr says why).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from collections.abc import Callable
from typing import Any

from api.cli.common import add_node_argument


def _service(pool: Any) -> Any:
    from api.wiring import build_services

    return build_services(pool).decommission


def _print_json(value: Any) -> None:
    import msgspec

    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def _actor(args: argparse.Namespace) -> str:
    name = getattr(args, "actor", None)
    if not name:
        try:
            name = getpass.getuser()
        except (KeyError, OSError):
            name = "unknown"
    return f"cli:{name}"


def _run(args: argparse.Namespace, work: Callable[[Any], Any]) -> int:
    from api.cli.common import _config, _with_database, exit_code_of, node_ref, resolve_node
    from api.http.problems import problem_of
    from api.services.errors import DomainError

    async def wrapped(pool: Any) -> int:
        # What the operator typed (id, prefix, hostname, identity key) -> the node's id.
        args.node = await resolve_node(pool, node_ref(args))
        try:
            return int(await work(_service(pool)))
        except DomainError as exc:
            if getattr(args, "json", False):
                _print_json(problem_of(exc))
            print(f"modelforge-hw: {exc.detail}", file=sys.stderr)
            return exit_code_of(exc)

    return _with_database(_config(args), wrapped)


def _lease_line(x: Any) -> str:
    expires = x.expires_at.isoformat() if x.expires_at else "never"
    return f"{x.lease_id}  {x.status:8}  owner {x.owner}  expires {expires}  {x.reason}"


def cmd_lease_acquire(args: argparse.Namespace) -> int:
    async def work(service: Any) -> int:
        node_id = await service.resolve_node(args.node)
        lease = await service.acquire_lease(node_id, args.owner, args.reason, args.ttl, actor=_actor(args))
        if args.json:
            _print_json(lease)
        else:
            print(lease.lease_id)
            print(f"lease {lease.lease_id} on node {node_id}: active", file=sys.stderr)
        return 0

    return _run(args, work)


def cmd_lease_release(args: argparse.Namespace) -> int:
    async def work(service: Any) -> int:
        node_id = await service.resolve_node(args.node)
        lease = await service.release_lease(node_id, args.lease_id, args.reason, actor=_actor(args))
        if args.json:
            _print_json(lease)
        else:
            print(f"lease {lease.lease_id} on node {node_id}: released")
        return 0

    return _run(args, work)


def cmd_lease_list(args: argparse.Namespace) -> int:
    async def work(service: Any) -> int:
        node_id = await service.resolve_node(args.node)
        leases = await service.list_leases(node_id)
        if args.json:
            _print_json({"items": leases})
        else:
            if not leases:
                print(f"node {node_id} holds no work lease")
            for x in leases:
                print(_lease_line(x))
        return 0

    return _run(args, work)


def cmd_decommission_preview(args: argparse.Namespace) -> int:
    async def work(service: Any) -> int:
        node_id = await service.resolve_node(args.node)
        p = await service.preview(node_id)
        if args.json:
            _print_json(p)
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
        for a in d.accelerators:
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

    return _run(args, work)


def cmd_decommission_execute(args: argparse.Namespace) -> int:
    async def work(service: Any) -> int:
        node_id = await service.resolve_node(args.node)
        done = await service.execute(node_id, args.generation, args.digest, args.reason, actor=_actor(args))
        if args.json:
            _print_json(done)
        else:
            print(
                f"node {done.node_id}: decommissioned at {done.decommissioned_at.isoformat()} by "
                f"{done.actor}; {len(done.revoked_credentials)} credential(s) revoked, "
                f"{len(done.decommissioned_accelerators)} accelerator(s) decommissioned, "
                f"{len(done.cleared_telemetry)} telemetry row(s) cleared"
            )
        return 0

    return _run(args, work)


def register(sub: Any, common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `lease ...` and `decommission ...` to the `modelforge-hw` parser."""
    from api.cli.enrollment import parse_duration

    lease = sub.add_parser("lease", help="work leases: work that depends on a node blocks its decommission")
    lease_sub = lease.add_subparsers(dest="lease_command", required=True)
    p = lease_sub.add_parser("acquire", help="record work that depends on a node (prints the lease id)")
    common(p)
    add_node_argument(p, positional=True)
    p.add_argument("--owner", required=True, help="who holds the lease (a team, a job, a component)")
    p.add_argument("--reason", required=True, help="what the work is")
    p.add_argument(
        "--ttl", type=parse_duration, help="expire after 90s, 15m, 2h, 7d (default: until released)"
    )
    p.add_argument("--actor", help="who you are, for the audit log (default: your login name)")
    p.add_argument("--json", action="store_true", help="print the lease as JSON")
    p.set_defaults(func=cmd_lease_acquire)
    p = lease_sub.add_parser("release", help="release a work lease")
    common(p)
    add_node_argument(p, positional=True)
    p.add_argument("lease_id")
    p.add_argument("--reason", default="released", help="why (for the audit log)")
    p.add_argument("--actor", help="who you are, for the audit log (default: your login name)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lease_release)
    p = lease_sub.add_parser("list", help="a node's unreleased work leases (active or expired)")
    common(p)
    add_node_argument(p, positional=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_lease_list)

    decom = sub.add_parser("decommission", help="retire a node for good (a tombstone; no revival)")
    decom_sub = decom.add_subparsers(dest="decommission_command", required=True)
    p = decom_sub.add_parser(
        "preview", help="generation, dependencies, blockers and digest of a node's decommission"
    )
    common(p)
    add_node_argument(p, positional=True)
    p.add_argument("--json", action="store_true", help="print the preview as JSON")
    p.set_defaults(func=cmd_decommission_preview)
    p = decom_sub.add_parser("execute", help="decommission a node as previewed (irreversible)")
    common(p)
    add_node_argument(p, positional=True)
    p.add_argument("--generation", type=int, required=True, help="the preview's generation")
    p.add_argument("--digest", required=True, help="the preview's digest")
    p.add_argument("--reason", required=True, help="why the node is retired (kept in the tombstone)")
    p.add_argument("--actor", help="who you are, for the audit log (default: your login name)")
    p.add_argument("--json", action="store_true", help="print the result (or the refusal) as JSON")
    p.set_defaults(func=cmd_decommission_execute)
