"""The simulated agents of bench.ingest (and bench.replica): nodes of 8 GPUs (bench/fleet.py)
enrolled over HTTP as an operator and an agent would do it, their reports pre-built in the agent's
wire format, the load loops that send them (closed, open, and the in-process ceiling append of the
same events), and one checkout under that load (`Target`: its database, `serve` and agents)."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec

from bench import harness as h
from bench.fleet import node_key, node_observation
from bench.servers import OPERATOR_TOKEN, HttpConnection, Process, bearer, start_product_server

INVENTORY_EVERY = 30  # the agent's default (MODELFORGE_AGENT_INVENTORY_EVERY)
REPORTS = b"/api/v1/agent/reports"

# Placeholders encoded into each pre-built body, replaced per request.
_SENTINEL_AT = datetime(2000, 1, 1, tzinfo=UTC)
_SENTINEL_SEQ = 987_654_321_987_654
_AT = msgspec.json.encode(_SENTINEL_AT)
_SEQ = b'"sequence":' + str(_SENTINEL_SEQ).encode()
_TELEMETRY, _INVENTORY = b'"stream":"telemetry"', b'"stream":"inventory"'


def wire_report(i: int, node_id: str, rng: random.Random) -> bytes:
    """One report body of node `i` in the agent's wire format, with placeholders for the sequence
    and the times. The only use of the agent's protocol module: if it moves, change this."""
    from agent.protocol import PROTOCOL_VERSION, Report, encode_report
    from collectors.observations import CollectorRun

    obs = msgspec.structs.replace(
        node_observation(i, rng),
        observed_at=_SENTINEL_AT,
        collectors=[CollectorRun("system", True, 0.02), CollectorRun("nvml", True, 0.1)],
    )
    body = encode_report(
        Report(
            protocol=PROTOCOL_VERSION, node_id=node_id, identity_key=node_key(i), identity_source="configured",
            stream="telemetry", sequence=_SENTINEL_SEQ, observed_at=_SENTINEL_AT, observation=obs,
        )
    )  # fmt: skip
    assert body.count(_SEQ) == 1 and body.count(_TELEMETRY) == 1, "unexpected report encoding"
    return body


@dataclass
class Agent:
    index: int
    node_id: str
    headers: bytes
    templates: list[bytes]
    payloads: list[list[Any]] = field(default_factory=list)  # the events of each template (ceiling)
    reports: int = 0
    sequences: dict[str, int] = field(default_factory=lambda: {"inventory": 0, "telemetry": 0})
    version: int = 0  # the stream's version, for the ceiling's expected version
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def next_body(self, stream: str | None = None) -> bytes:
        self.reports += 1
        stream = stream or ("inventory" if self.reports % INVENTORY_EVERY == 0 else "telemetry")
        self.sequences[stream] += 1
        body = self.templates[self.reports % len(self.templates)]
        body = body.replace(_SEQ, b'"sequence":%d' % self.sequences[stream])
        body = body.replace(_AT, msgspec.json.encode(datetime.now(UTC)))
        return body.replace(_TELEMETRY, _INVENTORY) if stream == "inventory" else body

    async def send(self, conn: HttpConnection, stream: str | None = None) -> int:
        """One report; returns its events; raises unless accepted."""
        sent_at = b"Modelforge-Agent-Sent-At: %s\r\n" % datetime.now(UTC).isoformat().encode()
        status, resp = await conn.request(b"POST", REPORTS, self.headers + sent_at, self.next_body(stream))
        ack = msgspec.json.decode(resp) if status == 200 else {}
        if ack.get("status") != "accepted":
            raise RuntimeError(f"HTTP {status}: {resp[:300].decode(errors='replace')}")
        return int(ack["events"])


async def enroll(port: int, nodes: int, variants: int, connections: int) -> list[Agent]:
    """Every node enrolled over HTTP, as an operator and an agent would do it."""
    op = bearer(OPERATOR_TOKEN) + b"Content-Type: application/json\r\n"
    conns = [await HttpConnection.open(port) for _ in range(connections)]
    per = -(-nodes // connections)
    rng = random.Random(20261130)
    agents: list[Agent] = []

    async def worker(c: int) -> None:
        conn = conns[c]
        body = msgspec.json.encode({"ttl_seconds": 3600, "uses": per, "description": f"bench {c}"})
        status, resp = await conn.request(b"POST", b"/api/v1/enrollment-tokens", op, body)
        assert status == 201, resp[:300]
        token = msgspec.json.decode(resp)["token"]
        for i in range(c * per, min(nodes, (c + 1) * per)):
            req = {"identity_key": node_key(i), "identity_source": "configured", "hostname": f"gpu-{i:06d}"}
            status, resp = await conn.request(
                b"POST", b"/api/v1/agent/enroll",
                bearer(token) + b"Content-Type: application/json\r\n", msgspec.json.encode(req),
            )  # fmt: skip
            assert status == 201, resp[:300]
            made = msgspec.json.decode(resp)
            headers = bearer(made["credential"]) + b"Content-Type: application/json\r\n"
            templates = [wire_report(i, made["node_id"], rng) for _ in range(variants)]
            agents.append(Agent(i, made["node_id"], headers, templates))

    try:
        await asyncio.gather(*(worker(c) for c in range(connections)))
    finally:
        for conn in conns:
            conn.close()
    return sorted(agents, key=lambda a: a.index)


async def ceiling_payloads(pool: Any, agents: list[Agent]) -> None:
    """What `reconcile` makes of each pre-built observation against the node's folded state: the
    events the server appends for such a report."""
    from collectors.identity import NodeIdentity
    from domain.reconcile import reconcile
    from projections.inventory import INVENTORY

    rng = random.Random(7)
    async with pool.acquire() as conn:
        for a in agents:
            state = await INVENTORY.load_state(conn, a.node_id)
            for _ in a.templates:
                obs = node_observation(a.index, rng)
                a.payloads.append(reconcile(obs, state, NodeIdentity(node_key(a.index), "configured")))


async def read_versions(pool: Any, agents: list[Agent]) -> None:
    """The streams' versions, for the ceiling's expected versions (the http tiers move them)."""
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT stream_id, version FROM streams WHERE stream_id = ANY($1)",
                                [a.node_id for a in agents])  # fmt: skip
    versions = {r["stream_id"]: r["version"] for r in rows}
    for a in agents:
        a.version = versions[a.node_id]


class Load:
    """The load generators of one run: each connection (or task) owns its own nodes, so a node
    never has two reports in flight."""

    def __init__(self, agents: list[Agent]) -> None:
        self.agents = agents

    async def http(self, name: str, ports: Sequence[int], connections: int, seconds: float) -> h.Sample:
        conns = [await HttpConnection.open(ports[c % len(ports)]) for c in range(connections)]
        groups = [self.agents[c::connections] for c in range(connections)]

        async def step(w: int, k: int) -> int:
            return await groups[w][k % len(groups[w])].send(conns[w])

        try:
            return await h.closed_loop(name, connections, seconds, step)
        finally:
            for c in conns:
                c.close()

    async def ceiling(self, store: Any, tasks: int, seconds: float) -> h.Sample:
        from ledger.events import EventMetadata, NewEvent

        groups = [self.agents[c::tasks] for c in range(tasks)]

        async def step(w: int, k: int) -> int:
            a = groups[w][k % len(groups[w])]
            now = datetime.now(UTC)
            meta = EventMetadata(
                received_at=now, source="agent", observed_at=now - timedelta(milliseconds=2),
                agent_stream="telemetry", agent_sequence=k + 1, agent_sent_at=now, agent_report_sha256="0" * 64,
            )  # fmt: skip
            events = [NewEvent(payload=p, metadata=meta) for p in a.payloads[k % len(a.payloads)]]
            a.version = (await store.append(a.node_id, a.version, events)).stream_version
            return len(events)

        return await h.closed_loop("ceiling: EventStore.append in-process", tasks, seconds, step)

    async def open(self, port: int, rate: float, seconds: float, max_in_flight: int) -> h.OpenLoop:
        conns = [await HttpConnection.open(port) for _ in range(max_in_flight)]

        async def step(slot: int, k: int) -> int:
            a = self.agents[k % len(self.agents)]
            async with a.lock:  # a node's reports stay in order
                return await a.send(conns[slot])

        try:
            return await h.open_loop(
                f"http open loop, {rate:,.0f}/s offered", rate, seconds, step, max_in_flight=max_in_flight
            )
        finally:
            for c in conns:
                c.close()


@dataclass
class Target:
    """One checkout under load: its own database, its `serve` process, its enrolled agents."""

    label: str
    tree: Path
    db: h.Database
    server: Process
    agents: list[Agent]

    @classmethod
    async def prepare(
        cls, label: str, tree: Path, db: h.Database, work: Path, args: argparse.Namespace
    ) -> Target:
        import asyncpg

        # Webhook receivers run on 127.0.0.1, which a server refuses by default (SSRF).
        settings = {"MODELFORGE_WEBHOOK_ALLOW_PRIVATE": "1"} if args.webhooks else None
        server = await start_product_server(db.dsn, work, label, tree=tree, settings=settings)
        agents = await enroll(server.port, args.nodes, args.variants, 8)
        conns = [await HttpConnection.open(server.port) for _ in range(8)]

        async def discover(c: int) -> None:  # each node's first report, on the inventory stream
            for a in agents[c::8]:
                await a.send(conns[c], "inventory")

        try:
            await asyncio.gather(*(discover(c) for c in range(8)))
        finally:
            for conn in conns:
                conn.close()
        conn = await asyncpg.connect(db.dsn)
        try:
            await conn.execute("ANALYZE")  # the statistics autovacuum gives a live server
        finally:
            await conn.close()
        await Load(agents).http("warm-up", [server.port], args.connections, 2.0)
        return cls(label, tree, db, server, agents)
