"""bench.ingest's `--webhooks` tier: the closed loop with and without 3 subscriptions, round by
round; the receivers, minimal HTTP/1.1 servers on 127.0.0.1 in
the bench process that answer every delivery 200 at once and count them, and the subscriptions
made and removed over the product's HTTP API (never its code)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from bench import harness as h
from bench.agents import Load
from bench.servers import OPERATOR_TOKEN

SECRET = "whsec_YmVuY2gtd2ViaG9vay1zZWNyZXQtMzItYnl0ZXMhIQ=="
_OK = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"


@dataclass
class Receiver:
    """Counts what it is sent; answers 200 with keep-alive."""

    server: asyncio.Server | None = None
    port: int = 0
    deliveries: int = 0
    ids: set[str] = field(default_factory=set)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length, ident = 0, ""
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                    elif name.lower() == b"webhook-id":
                        ident = value.strip().decode()
                await reader.readexactly(length)
                self.deliveries += 1
                self.ids.add(ident)
                writer.write(_OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def start(self) -> Receiver:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@contextlib.asynccontextmanager
async def subscribed(port: int, receivers: list[Receiver], classes: list[str]) -> AsyncIterator[list[str]]:
    """A subscription per receiver on the server at `port` while the block runs; removed after."""
    auth = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    base = f"http://127.0.0.1:{port}/api/v1/webhooks"
    async with httpx.AsyncClient(headers=auth, timeout=30) as client:
        ids = []
        for r in receivers:
            answer = await client.post(
                base,
                json={"url": f"http://127.0.0.1:{r.port}/hook", "secret": SECRET, "event_classes": classes},
            )
            answer.raise_for_status()
            ids.append(answer.json()["subscription_id"])
        await asyncio.sleep(1.5)  # the server's delivery worker takes them at its next scan (1 s)
        try:
            yield ids
        finally:
            for ident in ids:
                (await client.delete(f"{base}/{ident}")).raise_for_status()


WEBHOOK_TARGET = 0.9  # ingest with 3 subscriptions active, as a share of ingest without


async def webhook_rounds(
    port: int, load: Load, meter: h.Meter, args: argparse.Namespace
) -> tuple[h.Sample, h.Sample, int]:
    """The closed loop without webhooks and with 3 subscriptions active, round by round."""
    c = args.connections
    classes = [x for x in args.webhook_classes.split(",") if x]
    without = h.Sample(f"http: no webhook subscriptions, {c} in flight")
    with_hooks = h.Sample(f"http: 3 webhook subscriptions ({'+'.join(classes)}), {c} in flight")
    receivers = [await Receiver().start() for _ in range(3)]
    try:
        for _ in range(args.rounds):
            s, u = await meter.measure(load.http(without.name, [port], c, args.duration))
            without.merge(s, u)
            async with subscribed(port, receivers, classes):
                s, u = await meter.measure(load.http(with_hooks.name, [port], c, args.duration))
                with_hooks.merge(s, u)
    finally:
        for r in receivers:
            r.close()
    return without, with_hooks, sum(r.deliveries for r in receivers)
