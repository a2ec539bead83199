"""`modelforge-hw health policy show|apply` and `health backtest`: the GPU health policy over the
HTTP API (docs/health-policy.md). Applying and backtesting need the operator token.

    modelforge-hw health policy show [-o table|json|yaml]
    modelforge-hw health policy apply FILE [--actor NAME]
    modelforge-hw health backtest --policy FILE [--since 30d] [-o table|json]
"""

from __future__ import annotations

import getpass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import typer

from api.cli.errors import CliError
from api.cli.moments import duration_option
from api.cli.remote import Api, Server, Token, TokenFile, connect
from api.cli.rendering import Output, emit, table, when

if TYPE_CHECKING:
    from api.services.health_policy import BacktestBody, PolicyBody

health_app = typer.Typer(
    no_args_is_help=True, help="GPU health: the policy in force, applying and backtesting one"
)
policy_app = typer.Typer(
    no_args_is_help=True, help="the GPU health policy: show the one in force, apply another"
)
health_app.add_typer(policy_app, name="policy")

OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table, json or yaml.")]
PolicyFile = Annotated[Path, typer.Argument(help="the policy document (TOML)", show_default=False)]

# A backtest of a large fleet's month reads every health event of the log: give it time.
BACKTEST_READ_SECONDS = 300.0


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read the policy file {path}: {exc}") from exc


def _policy(api: Api) -> PolicyBody:
    from api.services.health_policy import PolicyBody

    return msgspec.json.decode(api.get("/hardware/health/policy"), type=PolicyBody)


def _show(found: PolicyBody, output: Output) -> None:
    if emit(found, output):
        return
    since = (
        "shipped default (never applied)"
        if found.since_position is None
        else (f"position {found.since_position}, {when(found.applied_at)}, by {found.actor or 'unknown'}")
    )
    print(f"# policy {found.name}  sha256 {found.digest}")
    print(f"# in force since {since}")
    print(found.policy, end="" if found.policy.endswith("\n") else "\n")


@policy_app.command("show")
def policy_show(
    server: Server, token: Token = None, token_file: TokenFile = None, output: OutputOpt = Output.table
) -> None:
    """the policy in force: its name, digest, since which position, and its text"""
    _show(_policy(connect(server, token, token_file)), output)


@policy_app.command("apply")
def policy_apply(
    file: PolicyFile,
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    actor: Annotated[str | None, typer.Option("--actor", help="who you are, for the audit log")] = None,
    output: OutputOpt = Output.table,
) -> None:
    """put a policy in force from FILE (validated first: a bad one changes nothing)"""
    from api.services.health_policy import ApplyRequest, PolicyBody

    api = connect(server, token, token_file)
    name = actor or getpass.getuser()
    body = api.post("/hardware/health/policy", ApplyRequest(policy=_read(file), actor=f"cli:{name}"))
    _show(msgspec.json.decode(body, type=PolicyBody), output)


def _moment(value: Any) -> str:
    return "never" if value is None else when(value)


def _backtest_table(result: BacktestBody, items: list[Any]) -> None:
    s = result.summary
    print(
        f"backtest {result.candidate[:12]} against {result.in_force[:12]} (in force), "
        f"{when(result.since)} .. {when(result.until)}: {result.events} health events, {s.gpus} GPUs"
    )
    print(
        f"differing {s.differing}; drained earlier {s.drained_earlier}, later {s.drained_later}; "
        f"serviced earlier {s.serviced_earlier}, later {s.serviced_later}; verdict changes "
        f"{s.changes_in_force} in force, {s.changes_candidate} candidate ({result.elapsed_seconds:.1f} s)"
    )
    if result.unobservable:
        print(
            f"not backtestable (no policy in force watched their condition): {', '.join(result.unobservable)}"
        )
    if not items:
        return
    rows = [
        [
            d.uuid,
            d.node_id[:8],
            when(d.first_difference_at),
            _moment(d.drained_in_force_at),
            _moment(d.drained_candidate_at),
            _moment(d.serviced_in_force_at),
            _moment(d.serviced_candidate_at),
        ]
        for d in items
    ]
    table(["UUID", "NODE", "FIRST DIFFERENCE", "DRAINED NOW", "DRAINED", "SERVICED NOW", "SERVICED"], rows)


@health_app.command("backtest")
def health_backtest(
    policy: Annotated[Path, typer.Option("--policy", help="the candidate policy (TOML)", show_default=False)],
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    since: Annotated[
        float | None,
        duration_option("--since", "the window: 1h .. 400d back from now (default 30d)"),
    ] = None,
    output: OutputOpt = Output.table,
) -> None:
    """fold the log with a candidate policy: GPUs whose verdict would differ (writes nothing)"""
    from api.services.health_policy import BacktestBody, BacktestRequest

    api = connect(server, token, token_file)
    text = _read(policy)
    items: list[Any] = []
    cursor: str | None = None
    while True:
        window = int(since if since is not None else 30 * 86400)
        request = BacktestRequest(policy=text, since_seconds=window, cursor=cursor, limit=1000)
        page = msgspec.json.decode(
            api.post("/hardware/health/backtest", request, timeout=BACKTEST_READ_SECONDS), type=BacktestBody
        )
        items += page.items
        cursor = page.next_cursor
        if cursor is None:
            break
    result = msgspec.structs.replace(page, items=items, next_cursor=None)
    if emit(result, output):
        return
    _backtest_table(result, items)
