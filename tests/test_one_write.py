"""A response in one write (api/http/one_write.py): uvicorn's protocol over a transport that
gathers what one loop iteration writes. What a client receives, and in what order, is what plain
uvicorn sends; what changes is how many writes carry it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from api.http.one_write import GatheringTransport, OneWriteHttpProtocol


class Recording(asyncio.Transport):
    """A socket's transport that records what is done to it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.done: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.done.append(("write", bytes(data)))

    def close(self) -> None:
        self.done.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.done.append(("abort", b""))
        self.closing = True

    def write_eof(self) -> None:
        self.done.append(("eof", b""))

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def answer(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the body; answers it back, whole or (path /stream) in two chunks a moment apart."""
    body = b""
    more = True
    while more:
        event = await receive()
        body += event.get("body", b"")
        more = event.get("more_body", False)
    if scope["path"] == "/stream":
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"first,", "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"second", "more_body": False})
        return
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def exchange(request: bytes, *, until: int = 1) -> list[tuple[str, bytes]]:
    """What the protocol does to its socket for `request`, once it has done `until` things."""
    config = uvicorn.Config(answer, http=OneWriteHttpProtocol, lifespan="off", log_config=None)
    config.load()
    protocol = OneWriteHttpProtocol(config, ServerState(), {}, asyncio.get_running_loop())
    socket = Recording()
    protocol.connection_made(socket)
    protocol.data_received(request)
    for _ in range(200):
        await asyncio.sleep(0.005)
        if len(socket.done) >= until and all(t.done() for t in protocol.tasks):
            break
    return socket.done


def post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Length: %d\r\n" % (path, len(body))
    return head + b"".join(extra) + b"\r\n" + body


async def test_a_response_goes_to_the_socket_in_one_write_with_its_headers_first() -> None:
    done = await exchange(post(b"/", b"report body"))
    assert [kind for kind, _ in done] == ["write"]
    response = done[0][1]
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-length: 11" in head.lower()
    assert body == b"report body"


async def test_a_streamed_body_is_not_held_back_until_it_ends() -> None:
    done = await exchange(post(b"/stream", b""), until=2)
    writes = [data for kind, data in done if kind == "write"]
    assert len(writes) == 2, done
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and b"first," in writes[0]
    assert b"second" in writes[1] and b"first," not in writes[1]


async def test_a_connection_the_client_closes_gets_its_response_before_the_close() -> None:
    done = await exchange(post(b"/", b"last", b"Connection: close\r\n"), until=2)
    assert [kind for kind, _ in done] == ["write", "close"]
    assert done[0][1].endswith(b"\r\n\r\nlast")


async def test_writes_of_one_iteration_are_sent_together_and_later_ones_apart() -> None:
    socket = Recording()
    gathering = GatheringTransport(socket, asyncio.get_running_loop())
    gathering.write(b"a")
    gathering.write(bytearray(b"b"))
    gathering.write(b"")
    gathering.writelines([memoryview(b"c"), b"d"])
    assert socket.done == [] and gathering.get_write_buffer_size() == 4
    await asyncio.sleep(0)
    assert socket.done == [("write", b"abcd")]
    gathering.write(b"e")
    await asyncio.sleep(0)
    assert socket.done == [("write", b"abcd"), ("write", b"e")]
    assert gathering.get_write_buffer_size() == 0


@pytest.mark.parametrize("end", ["close", "write_eof"])
async def test_what_was_gathered_is_sent_before_the_connection_ends(end: str) -> None:
    socket = Recording()
    gathering = GatheringTransport(socket, asyncio.get_running_loop())
    gathering.write(b"answer")
    getattr(gathering, end)()
    await asyncio.sleep(0)
    assert socket.done == [("write", b"answer"), ("close" if end == "close" else "eof", b"")]


async def test_an_aborted_connection_sends_nothing_more() -> None:
    socket = Recording()
    gathering = GatheringTransport(socket, asyncio.get_running_loop())
    gathering.write(b"half an answer")
    gathering.abort()
    gathering.write(b"after the abort")
    await asyncio.sleep(0)
    assert socket.done == [("abort", b"")]
