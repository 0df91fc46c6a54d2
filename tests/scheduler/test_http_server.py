"""The extender's HTTP server over a real socket (http_server.py): what kube-scheduler, kubelet
and Prometheus see is what uvicorn gave them. Keep-alive and pipelined calls answered in order,
one body per reply with its length, 404/405 (Allow), 413 before an oversized body is sent, HEAD
without a body, chunked bodies, `Expect: 100-continue`, and 400 with a close for bytes that are
not HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

import httpx
import pytest

from tessera.cluster.memory import InMemoryCluster

from .conftest import MakeService
from .factories import container, pod


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
async def served(make_service: MakeService) -> Any:
    service = await make_service(config={"max_body_bytes": 4000})
    port = free_port()
    task = asyncio.create_task(service.serve_http("127.0.0.1", port))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            break
        except OSError:
            assert loop.time() < deadline
            await asyncio.sleep(0.05)
    yield service, port
    service.stopping.set()
    await asyncio.wait_for(task, 10)


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:] if line)}  # fmt: skip
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body  # fmt: skip


async def test_keep_alive_and_pipelined_calls_are_answered_in_order(
    served: Any, cluster: InMemoryCluster
) -> None:
    _service, port = served
    spec = cluster.add_pod(pod(container(mem=1000)))
    filter_body = json.dumps({"Pod": spec, "NodeNames": ["n1"]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        # Three calls written at once on one connection, then one more after the answers.
        writer.write(post("/filter", filter_body) + b"GET /healthz HTTP/1.1\r\nHost: s\r\n\r\n"
                     + post("/bind", b'{"PodName": ""}'))  # fmt: skip
        first, second, third = [await read_reply(reader) for _ in range(3)]
        writer.write(b"HEAD /readyz HTTP/1.1\r\nHost: s\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    finally:
        writer.close()
    assert first[0] == 200 and first[1]["content-type"] == "application/json"
    assert "NodeUnregistered" in json.loads(first[2])["failedNodes"]["n1"]
    assert second[:1] == (200,) and json.loads(second[2]) == {"ok": True}
    assert third[0] == 400 and "needs PodName and Node" in json.loads(third[2])["Error"]
    assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: 14" in head.lower()


async def test_refusals_oversized_wrong_method_unknown_path_and_garbage(served: Any) -> None:
    _service, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        # 413 is answered from the headers alone, before the body is sent.
        writer.write(b"POST /filter HTTP/1.1\r\nHost: s\r\nContent-Length: 5000\r\n\r\n")
        status, _headers, body = await read_reply(reader)
        assert status == 413 and "larger than 4000 bytes" in json.loads(body)["error"]
        writer.write(b" " * 5000)  # the body is read and dropped; the connection goes on
        writer.write(b"GET /filter HTTP/1.1\r\nHost: s\r\n\r\n")
        status, headers, _body = await read_reply(reader)
        assert status == 405 and headers["allow"] == "POST"
        writer.write(post("/nowhere", b"{}"))
        assert (await read_reply(reader))[0] == 404
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = await read_reply(reader)
        assert status == 400 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
    finally:
        writer.close()


async def test_endless_request_target_or_header_block_is_refused(served: Any) -> None:
    """A client that never ends its request line or its headers is answered 400 and closed once
    past the caps, instead of the server accumulating what it sends. (A reset instead of the 400
    is the kernel's answer to bytes still arriving after the close: refused all the same.)"""
    _service, port = served
    cases = (
        (b"POST /", b"a" * 4096),
        (b"POST /filter HTTP/1.1\r\n", b"x-pad: " + b"b" * 4089 + b"\r\n"),
    )
    for prefix, filler in cases:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(prefix)
            with contextlib.suppress(ConnectionError):
                for _ in range(64):  # 256 KiB, past both caps
                    writer.write(filler)
                    await writer.drain()
            try:
                status, headers, _body = await read_reply(reader)
                assert status == 400 and headers["connection"] == "close"
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
            except ConnectionResetError:
                pass
        finally:
            writer.close()


async def test_chunked_body_and_expect_continue(served: Any, cluster: InMemoryCluster) -> None:
    _service, port = served
    spec = cluster.add_pod(pod(container(mem=1000)))
    body = json.dumps({"pod": spec, "nodenames": ["n1"]}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /filter HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"".join(b"%x\r\n%s\r\n" % (len(part), part)
                                for part in (body[:50], body[50:]))
                     + b"0\r\n\r\n")  # fmt: skip
        status, _headers, reply = await read_reply(reader)
        assert status == 200 and "n1" in json.loads(reply)["failedNodes"]
        writer.write(post("/filter", b"", "Expect: 100-continue\r\n"))
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
            b"HTTP/1.1 100 Continue")
        status, _headers, reply = await read_reply(reader)
        assert status == 400 and "not valid JSON" in json.loads(reply)["error"]
        # A chunked body over the limit: 413 once it is known, nothing parsed.
        writer.write(b"POST /bind HTTP/1.1\r\nHost: s\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (4500, b" " * 4500))  # fmt: skip
        assert (await read_reply(reader))[0] == 413
    finally:
        writer.close()


async def test_httpx_client_sees_the_same_extender(served: Any) -> None:
    """An ordinary HTTP client (keep-alive pool, its own framing) against the server."""
    _service, port = served
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
        for _ in range(3):
            assert (await client.get("/readyz")).json() == {"ready": True}
        metrics = await client.get("/metrics")
        wrong = await client.post("/readyz")
    assert metrics.status_code == 200 and "tessera_scheduler_" in metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, HEAD"


async def test_an_idle_connection_is_closed_after_the_keep_alive_and_a_used_one_is_not(
    served: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle is counted from the last request or reply: a connection used every 0.2 s outlives
    the 0.5 s keep-alive; left alone, it is closed about 0.5 s after its last reply."""
    from tessera.scheduler import http_server

    monkeypatch.setattr(http_server, "KEEP_ALIVE_S", 0.5)
    _service, port = served
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    try:
        for _ in range(6):  # 1.2 s of use, more than twice the keep-alive
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: s\r\n\r\n")
            status, _headers, _body = await read_reply(reader)
            assert status == 200
            await asyncio.sleep(0.2)
        last = loop.time()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        assert 0.2 <= loop.time() - last < 3.0
    finally:
        writer.close()
