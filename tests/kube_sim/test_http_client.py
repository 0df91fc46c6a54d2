"""kube-sim's outgoing HTTP client (the webhook's reviews, the extender's calls) against a real
HTTP/1.1 server on loopback: replies framed by length or in chunks, connections kept while the
server keeps them and never reused once it closed them, a silent server ends in an error that
names the wait, never a hang."""

from __future__ import annotations

import asyncio
import json

import pytest
from tessera.kube_sim.http_client import HttpError, JsonPoster


class Server:
    """Answers each POST with `reply(body)` -> (head lines, body bytes); counts connections."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.connections = 0
        self.requests: list[tuple[str, dict]] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/hook"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next(int(line.split(":")[1]) for line in lines
                              if line.lower().startswith("content-length"))  # fmt: skip
                body = json.loads(await reader.readexactly(length))
                self.requests.append((lines[0], body))
                headers, payload = self.reply(body)
                if headers is None:  # say nothing
                    await asyncio.sleep(10)
                    return
                writer.write(("HTTP/1.1 " + "\r\n".join(headers) + "\r\n\r\n").encode() + payload)
                await writer.drain()
                if any(h.lower() == "connection: close" for h in headers):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def framed(body: dict) -> tuple[list[str], bytes]:
    data = json.dumps({"echo": body}).encode()
    return ["200 OK", "content-type: application/json", f"content-length: {len(data)}"], data


async def test_replies_come_back_on_one_kept_connection():
    async with Server(framed) as server:
        client = JsonPoster(server.url, None, 5.0)
        for i in range(3):
            reply = await client.post("", {"n": i})
            assert (reply.status, reply.json()) == (200, {"echo": {"n": i}})
        await client.close()
    assert server.connections == 1
    assert server.requests[0][0] == "POST /hook HTTP/1.1"


async def test_a_chunked_reply_is_read_whole():
    def chunked(body: dict) -> tuple[list[str], bytes]:
        data = json.dumps({"echo": body}).encode()
        parts = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (data[:5], data[5:]))
        return ["200 OK", "transfer-encoding: chunked"], parts + b"0\r\n\r\n"

    async with Server(chunked) as server:
        client = JsonPoster(server.url, None, 5.0)
        assert (await client.post("", {"a": 1})).json() == {"echo": {"a": 1}}
        assert (await client.post("", {"a": 2})).json() == {"echo": {"a": 2}}
        await client.close()
    assert server.connections == 1


async def test_a_connection_the_server_closed_is_not_reused():
    def closing(body: dict) -> tuple[list[str], bytes]:
        headers, data = framed(body)
        return [*headers, "connection: close"], data

    async with Server(closing) as server:
        client = JsonPoster(server.url, None, 5.0)
        for i in range(3):
            assert (await client.post("", {"n": i})).status == 200
        await client.close()
    assert server.connections == 3


async def test_an_error_status_is_returned_with_its_body():
    async with Server(lambda body: (["500 Internal Server Error", "content-length: 4"], b"boom"))\
            as server:  # fmt: skip
        client = JsonPoster(server.url, None, 5.0)
        reply = await client.post("", {})
        assert (reply.status, reply.text) == (500, "boom")
        await client.close()


async def test_a_silent_server_or_none_at_all_is_an_error_not_a_hang():
    async with Server(lambda body: (None, b"")) as server:
        client = JsonPoster(server.url, None, 0.3)
        with pytest.raises(HttpError, match=r"no reply within 0\.3 s"):
            await client.post("", {})
        url = server.url
    client = JsonPoster(url, None, 2.0)  # the server is gone: connection refused
    with pytest.raises(HttpError, match=r"ConnectionRefusedError|OSError"):
        await client.post("", {})



@pytest.mark.parametrize("head", [
    b"HTTP/1.1 2\xb20 OK\r\ncontent-length: 2",  # read as latin-1: '2²0' (isdigit: yes)
    b"HTTP/1.1 200 OK\r\ncontent-length: \xb2",  # '²': isdigit yes, int() refuses it
    b"HTTP/1.1 200 OK\r\ncontent-length: \xb9\xb2",
    b"HTTP/1.1 200 OK\r\ncontent-length: -2",
    b"HTTP/1.1 200 OK\r\ncontent-length: 1_0",  # int() reads 10
    b"HTTP/1.1 2000 OK\r\ncontent-length: 2",
])
async def test_a_reply_with_hostile_digits_is_an_error_not_a_crash(head: bytes):
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n{}")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        client = JsonPoster(f"http://127.0.0.1:{port}/hook", None, 5.0)
        with pytest.raises(HttpError, match=r"not an HTTP/1 reply|bad Content-Length"):
            await client.post("", {})
        await client.close()
    finally:
        server.close()
        await server.wait_closed()
