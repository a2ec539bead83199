"""Webhook tests' real receiver: an HTTP server on 127.0.0.1 in a thread of the test process that
records every delivery (verified with the helper docs/integrations.md shows) and answers with a
status the test chooses; it can be stopped and started again on the same port."""

from __future__ import annotations

import re
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec

from ledger.events import EnrollmentTokenCreated, EventMetadata, NewEvent, enrollment_token_stream
from ledger.store import EventStore

ROOT = Path(__file__).resolve().parent.parent
SECRET = "whsec_" + "c2VjcmV0LWtleS1vZi10aGlydHktdHdvLWJ5dGVzIQ=="


def docs_verifier() -> Any:
    """The `verify_webhook` function of docs/integrations.md, as the page shows it."""
    text = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (code,) = [b for b in blocks if "def verify_webhook" in b]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/integrations.md", "exec"), namespace)
    return namespace["verify_webhook"]


class Delivery(msgspec.Struct):
    headers: dict[str, str]
    body: bytes
    verified: bool

    @property
    def event(self) -> dict[str, Any]:
        return msgspec.json.decode(self.body)  # type: ignore[no-any-return]

    @property
    def position(self) -> int:
        return int(self.headers["webhook-id"])


class Receiver:
    def __init__(self, secret: str = SECRET, port: int = 0) -> None:
        self.secret = secret
        self.verify = docs_verifier()
        self.deliveries: list[Delivery] = []
        self.status = 200
        self.answer = b"ok"
        self.lock = threading.Lock()
        self.port = port
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    receiver.verify(receiver.secret, headers, body)
                    verified = True
                except ValueError:
                    verified = False
                with receiver.lock:
                    status, answer = receiver.status, receiver.answer
                    if 200 <= status < 300:
                        receiver.deliveries.append(Delivery(headers, body, verified))
                self.send_response(status)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def positions(self) -> list[int]:
        with self.lock:
            return [d.position for d in self.deliveries]

    def wait_for(self, count: int, within: float = 30.0) -> list[int]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            got = self.positions()
            if len(set(got)) >= count:
                return got
            time.sleep(0.05)
        raise AssertionError(f"{len(set(self.positions()))} of {count} events delivered within {within}s")


def token_event(at: datetime | None = None) -> NewEvent:
    now = at or datetime.now(UTC)
    token_id = uuid.uuid4().hex[:12]
    return NewEvent(
        payload=EnrollmentTokenCreated(
            token_id=token_id, secret_sha256="0" * 64, expires_at=now + timedelta(hours=1), uses=1
        ),
        metadata=EventMetadata(received_at=now, source="operator"),
    )


async def append_tokens(store: EventStore, count: int) -> list[int]:
    """`count` lifecycle events, one transaction each; their global positions."""
    positions = []
    for _ in range(count):
        event = token_event()
        result = await store.append(enrollment_token_stream(event.payload.token_id), None, [event])  # type: ignore[union-attr]
        positions.append(result.events[0].global_position)
    return positions
