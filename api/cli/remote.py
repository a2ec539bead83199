"""The HTTP API as the commands over it (`node`, `gpu`, `events`, `webhook`) and the operator's
`health` commands use it: the server's URL (`MODELFORGE_SERVER`) and a token (`MODELFORGE_TOKEN`,
or a file named by `--token-file` / `MODELFORGE_TOKEN_FILE`), no database credentials, so they run
from any workstation.

A refusal is a `RemoteError` with its HTTP status; `api.cli.errors` turns it into the exit code
of its kind (404 -> 5, 409 -> 3, 410 -> 4, any other 2; the server unreachable 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol, TypeVar

import msgspec

from api.cli.errors import CliError, RemoteError, say
from runtime.options import variable_option

if TYPE_CHECKING:
    from api.services.reads.bodies import AcceleratorBody, NodeBody

# The change feed's hold per request: well under the server's limit, long enough to be cheap.
FOLLOW_WAIT_SECONDS = 30

T = TypeVar("T")


class Page(Protocol[T]):
    """A page of a list route: its items and the cursor of the next (None after the last)."""

    @property
    def items(self) -> list[T]: ...

    @property
    def next_cursor(self) -> str | None: ...


Server = Annotated[str, variable_option("server")]
Token = Annotated[str | None, variable_option("token")]
TokenFile = Annotated[Path | None, variable_option("token_file")]


class Api:
    def __init__(self, server: str, token: str) -> None:
        import httpx

        self.base = server.rstrip("/")
        self.client = httpx.Client(
            base_url=self.base + "/api/v1",
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json"},
            timeout=httpx.Timeout(10.0, read=FOLLOW_WAIT_SECONDS + 15.0),
        )

    def get(self, path: str, params: list[tuple[str, str]] | None = None) -> bytes:
        return self._send("GET", path, params=params)

    def post(self, path: str, body: object, *, timeout: float | None = None) -> bytes:
        """An operator request with a JSON body (`timeout`: for one the server may work on long)."""
        return self._send("POST", path, body=msgspec.json.encode(body), timeout=timeout)

    def send(self, method: str, path: str, *, body: bytes | None = None) -> bytes:
        """Any other operator request (a DELETE, a POST of bytes already encoded)."""
        return self._send(method, path, body=body)

    def _send(
        self,
        method: str,
        path: str,
        *,
        params: list[tuple[str, str]] | None = None,
        body: bytes | None = None,
        timeout: float | None = None,
    ) -> bytes:
        import httpx

        try:
            r = self.client.request(
                method,
                path,
                params=tuple(params or ()),
                content=body,
                headers={"Content-Type": "application/json"} if body is not None else None,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else httpx.Timeout(10.0, read=timeout),
            )
        except httpx.HTTPError as exc:
            raise RemoteError(
                0, f"cannot reach {self.base}: {exc} (check MODELFORGE_SERVER and that the server runs)"
            ) from exc
        if r.status_code >= 400:
            try:
                problem = msgspec.json.decode(r.content, type=dict[str, Any])
                text = str(problem.get("detail") or problem.get("title") or r.reason_phrase)
            except msgspec.DecodeError:
                text = r.reason_phrase
            hint = " (check MODELFORGE_TOKEN or --token-file)" if r.status_code in (401, 403) else ""
            raise RemoteError(r.status_code, f"HTTP {r.status_code}: {text}{hint}")
        return r.content

    def every(self, path: str, filters: list[tuple[str, str]], page_type: type[Page[T]]) -> list[T]:
        """Every item of a list route with these filters, page after page."""
        items: list[T] = []
        cursor: str | None = None
        while True:
            params = [("limit", "500"), *filters] + ([("cursor", cursor)] if cursor else [])
            page = msgspec.json.decode(self.get(path, params), type=page_type)
            items += page.items
            if not page.next_cursor:
                return items
            cursor = page.next_cursor

    def nodes(self) -> list[NodeBody]:
        from api.services.reads.bodies import NodePage

        return self.every("/hardware/nodes", [], NodePage)

    def node(self, node_id: str) -> NodeBody:
        from api.services.reads.bodies import NodeBody

        return msgspec.json.decode(self.get(f"/hardware/nodes/{node_id}"), type=NodeBody)

    def accelerators(
        self, node_id: str | None = None, state: str | None = None, health: str | None = None
    ) -> list[AcceleratorBody]:
        from api.services.reads.bodies import AcceleratorPage

        filters = [("node_id", node_id), ("status", state), ("health", health)]
        return self.every("/hardware/accelerators", [(k, v) for k, v in filters if v], AcceleratorPage)


def connect(server: str, token: str | None, token_file: Path | None) -> Api:
    if token_file is not None:
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CliError(f"cannot read the token file {token_file}: {exc.strerror}") from exc
    if not token:
        raise CliError(
            "a token is required: MODELFORGE_TOKEN, --token, --token-file or MODELFORGE_TOKEN_FILE"
        )
    return Api(server, token)


def resolve_node(nodes: list[NodeBody], ref: str) -> NodeBody:
    """One node by its full id, its identity key (the name its agent was given, e.g.
    MODELFORGE_NODE_ID), an id prefix or its hostname, as the server-side commands take one;
    ambiguous refs name the candidates."""
    exact = [n for n in nodes if ref in (n.id, n.identity_key)]
    if exact:
        return exact[0]
    candidates = [n for n in nodes if n.id.startswith(ref.lower()) or n.hostname == ref]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise RemoteError(
            404, f"no node with the id or identity key {ref!r}, an id starting with it or that hostname"
        )
    listed = ", ".join(f"{n.id[:12]} ({n.hostname or 'no hostname'})" for n in candidates[:10])
    raise CliError(f"{ref!r} matches {len(candidates)} nodes: {listed}; give more of the id")


def resolve_gpu(gpus: list[AcceleratorBody], ref: str, *, one_row: bool = True) -> AcceleratorBody:
    """One GPU by its UUID, a UUID prefix (with or without `GPU-`), or an id prefix. A GPU moved
    to another node has a row on each: the one it is in now (present, seen last) stands for it.
    `one_row`: the caller shows that row alone (not every row of the UUID, as `gpu history`
    does), so a UUID active on several nodes is worth a warning."""
    low = ref.lower()
    exact = [g for g in gpus if g.id == ref or g.uuid.lower() == low]
    if exact:
        return _current(exact, one_row)
    candidates = [
        g
        for g in gpus
        if g.id.startswith(low)
        or g.uuid.lower().startswith(low)
        or g.uuid.lower().removeprefix("gpu-").startswith(low)
    ]
    if len({g.uuid for g in candidates}) == 1:
        return _current(candidates, one_row)
    if not candidates:
        raise RemoteError(404, f"no GPU with a UUID or id starting with {ref!r}")
    # One line per GPU, though a GPU moved between nodes has a row on each.
    distinct = list({g.uuid: g for g in candidates}.values())
    listed = ", ".join(f"{g.uuid} (index {g.index})" for g in distinct[:10])
    raise CliError(f"{ref!r} matches {len(distinct)} GPUs: {listed}; give more of the UUID")


def _current(rows: list[AcceleratorBody], one_row: bool) -> AcceleratorBody:
    """Of one GPU's rows (or one row by id), where it is now: present first, then seen last. A
    UUID present on several nodes at once is not a move but two identities for one host (a host
    enrolled again under a new node id, two agents on it) or cloned UUIDs: say so, and how to
    choose another row."""
    chosen = max(rows, key=lambda g: (g.status == "active", g.last_seen_at))
    active = [g for g in rows if g.status == "active"]
    if one_row and len(active) > 1:
        others = ", ".join(f"id {g.id[:8]} on node {g.node_id[:8]}" for g in active if g is not chosen)
        say(
            f"{chosen.uuid} is active on {len(active)} nodes; showing id {chosen.id[:8]} on node "
            f"{chosen.node_id[:8]} (seen last); the others: {others}. Give an id to choose one."
        )
    return chosen
