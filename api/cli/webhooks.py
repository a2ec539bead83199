"""`modelforge-hw webhook create|list|delete|resume|deliveries`: webhook subscriptions over the
HTTP API (docs/integrations.md, "Webhooks"). The secret is read from a file (or `-`, stdin), never
taken on the command line, where `ps` and shell history would show it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from api.cli.errors import CliError
from api.cli.gpus import OutputOpt
from api.cli.remote import Api, Server, Token, TokenFile, connect, resolve_node
from api.cli.rendering import Output, emit, nothing, short, table, when

if TYPE_CHECKING:
    from api.services.webhooks import DeliveryBody, WebhookBody

webhook_app = typer.Typer(
    no_args_is_help=True,
    help="webhook subscriptions over the HTTP API: create, list, delete, resume, deliveries",
)

SubscriptionId = Annotated[str, typer.Argument(help="The subscription's id (wh_...).", show_default=False)]


def _subscription(content: bytes) -> WebhookBody:
    from api.services.webhooks import WebhookBody

    return msgspec.json.decode(content, type=WebhookBody)


def _read_secret(path: Path) -> str:
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"cannot read the secret file {path}: {exc.strerror}") from exc
    secret = text.strip()
    if not secret:
        raise CliError(f"the secret file {path} is empty")
    return secret


def selection(w: WebhookBody) -> str:
    parts = [*w.event_types, *(f"class:{c}" for c in w.event_classes)]
    if w.node_id:
        parts.append(f"node:{w.node_id}")
    return ",".join(parts)


def _show(w: WebhookBody, output: Output) -> None:
    if emit(w, output):
        return
    table(
        ["FIELD", "VALUE"],
        [
            ["id", w.subscription_id],
            ["url", w.url],
            ["selects", selection(w)],
            ["state", w.state],
            ["delivered", str(w.delivered)],
            ["rejected", str(w.rejected)],
            ["retried", str(w.retried)],
            ["last error", w.last_error or "-"],
            ["created", when(w.created_at)],
        ],
        wrap=(1,),
    )


@webhook_app.command("create")
def webhook_create(
    url: Annotated[
        str, typer.Argument(help="Where deliveries are POSTed (http or https).", show_default=False)
    ],
    secret_file: Annotated[
        Path,
        typer.Option(
            "--secret-file",
            help="File holding the signing secret (16 bytes or more, or whsec_...); - for stdin.",
        ),
    ],
    server: Server,
    event_type: Annotated[
        list[str] | None, typer.Option("--type", help="An event type to deliver (repeatable).")
    ] = None,
    event_class: Annotated[
        list[str] | None, typer.Option("--class", help="lifecycle or observation (repeatable).")
    ] = None,
    node: Annotated[
        str | None,
        typer.Option("--node", help="Only this node's events: its id, identity key, id prefix or hostname."),
    ] = None,
    description: Annotated[str, typer.Option("--description", help="What the receiver is.")] = "",
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """Subscribe URL to the log's events (every lifecycle event unless --type/--class say otherwise)."""
    api = connect(server, token, token_file)
    body: dict[str, object] = {"url": url, "secret": _read_secret(secret_file), "description": description}
    if event_type:
        body["event_types"] = event_type
    if event_class:
        body["event_classes"] = event_class
    if node:
        body["node_id"] = resolve_node(api.nodes(), node).id
    _show(_subscription(api.send("POST", "/webhooks", body=msgspec.json.encode(body))), output)


def _all(api: Api) -> list[WebhookBody]:
    from api.services.webhooks import WebhookBody

    return msgspec.json.decode(api.get("/webhooks"), type=dict[str, list[WebhookBody]])["items"]


@webhook_app.command("list")
def webhook_list(
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """Every subscription with its state (active | failing) and delivery counts."""
    items = _all(connect(server, token, token_file))
    if emit(items, output):
        return
    if not items:
        nothing("webhook subscriptions")
        return
    header = ["ID", "STATE", "URL", "SELECTS", "DELIVERED", "REJECTED", "RETRIED", "LAST ERROR"]
    rows = [
        [
            w.subscription_id,
            w.state,
            w.url,
            selection(w),
            str(w.delivered),
            str(w.rejected),
            str(w.retried),
            short(w.last_error or "-", 40),
        ]
        for w in items
    ]
    if output is Output.wide:
        header += ["SINCE FAILING", "LAST DELIVERED", "NEXT ATTEMPT"]
        for r, w in zip(rows, items, strict=True):
            r += [when(w.failing_since), when(w.last_delivered_at), when(w.next_attempt_at)]
    table(header, rows)


@webhook_app.command("delete")
def webhook_delete(
    subscription: SubscriptionId,
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """Unsubscribe: nothing more is delivered; recorded in the log."""
    api = connect(server, token, token_file)
    _show(_subscription(api.send("DELETE", f"/webhooks/{subscription}")), output)


@webhook_app.command("resume")
def webhook_resume(
    subscription: SubscriptionId,
    server: Server,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """Deliver again now, from the subscription's cursor (a failing one's receiver is back)."""
    api = connect(server, token, token_file)
    _show(_subscription(api.send("POST", f"/webhooks/{subscription}/resume")), output)


# The route's largest page: the kept attempts in few requests.
DELIVERIES_PAGE = 500


def read_deliveries(api: Api, subscription: str, limit: int) -> list[DeliveryBody]:
    """The newest `limit` attempts, newest first, page after page."""
    from api.services.webhooks import DeliveryPage

    items: list[DeliveryBody] = []
    cursor: str | None = None
    while len(items) < limit:
        params = [("limit", str(min(DELIVERIES_PAGE, limit - len(items))))]
        params += [("cursor", cursor)] if cursor else []
        raw = api.get(f"/webhooks/{subscription}/deliveries", params)
        page = msgspec.json.decode(raw, type=DeliveryPage)
        items += page.items
        if not page.next_cursor:
            break
        cursor = page.next_cursor
    return items


@webhook_app.command("deliveries")
def webhook_deliveries(
    subscription: SubscriptionId,
    server: Server,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many, newest first.")] = 20,
    token: Token = None,
    token_file: TokenFile = None,
    output: OutputOpt = Output.table,
) -> None:
    """The newest delivery attempts: event, outcome, HTTP status, the receiver's answer."""
    api = connect(server, token, token_file)
    items = read_deliveries(api, subscription, limit)
    if emit(items, output):
        return
    if not items:
        nothing("delivery attempts yet")
        return
    table(
        ["AT", "POSITION", "TYPE", "ATTEMPT", "OUTCOME", "STATUS", "MS", "ANSWER"],
        [_delivery_row(d) for d in items],
    )


def _delivery_row(d: DeliveryBody) -> list[str]:
    return [
        when(d.attempted_at),
        str(d.global_position),
        d.event_type,
        str(d.attempt),
        d.outcome,
        str(d.status_code) if d.status_code is not None else "-",
        f"{d.duration_ms:.0f}",
        short(d.response_body or d.error or "", 60),
    ]
