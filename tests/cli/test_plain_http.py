"""The CLI's one-socket GET (tessera_cli.kube._plain_get) reads replies as HTTP frames them
(Content-Length, chunked, until close), against a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tessera_cli.kube import ApiError, KubeClient, KubeConfig

BODY = {"kind": "PodList", "items": [{"metadata": {"name": f"p{i}"}} for i in range(300)]}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: object) -> None:
        pass

    def do_GET(self) -> None:
        data = json.dumps(BODY).encode()
        assert self.headers["Authorization"] == "Bearer t0ken"
        if self.path.startswith("/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(data), 1000):
                piece = data[i:i + 1000]
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif self.path.startswith("/missing"):
            status = {"kind": "Status", "message": 'pods "x" not found', "reason": "NotFound"}
            text = json.dumps(status).encode()
            self.send_response(404)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("path", ["/api/v1/pods", "/chunked/pods?limit=500"])
def test_a_get_reads_the_whole_reply(server: str, path: str) -> None:
    client = KubeClient(KubeConfig(server=server, token="t0ken"), timeout_s=5)
    assert client.get(path) == BODY


def test_a_refusal_carries_the_servers_message_and_reason(server: str) -> None:
    client = KubeClient(KubeConfig(server=server, token="t0ken"), timeout_s=5)
    with pytest.raises(ApiError) as refused:
        client.get("/missing")
    assert (str(refused.value), refused.value.status, refused.value.reason) == (
        'pods "x" not found', 404, "NotFound")


def test_behind_a_proxy_the_standard_client_is_used(server: str, monkeypatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("no_proxy", "")
    # urlopen keeps the opener (and the proxies it read from the environment) of its first use:
    # start this test from a new one (monkeypatch puts the old one back).
    monkeypatch.setattr(urllib.request, "_opener", None)
    client = KubeClient(KubeConfig(server=server, token="t0ken"), timeout_s=5)
    with pytest.raises(ApiError, match="cannot reach the API server"):
        client.get("/api/v1/pods")


class HostileServer:
    """Answers every request with one fixed status line and headers (and a body of 2 bytes)."""

    def __init__(self, head: bytes) -> None:
        import socket

        self.head = head
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            conn.sendall(self.head + b"\r\n\r\n{}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.thread.join(10)
        self.sock.close()



@pytest.mark.parametrize("head", [
    b"HTTP/1.1 2\xb20 OK\r\nContent-Length: 2",  # read as latin-1: '2²0' (isdigit: yes)
    b"HTTP/1.1 200 OK\r\nContent-Length: \xb2",  # '²': isdigit yes, int() refuses it
    b"HTTP/1.1 200 OK\r\nContent-Length: \xb9\xb2",
    b"HTTP/1.1 200 OK\r\nContent-Length: -2",
    b"HTTP/1.1 2000 OK\r\nContent-Length: 2",
])
def test_a_reply_with_hostile_digits_is_a_clear_error_not_a_crash(head: bytes) -> None:
    server = HostileServer(head)
    try:
        client = KubeClient(KubeConfig(server=server.url, token="t0ken"), timeout_s=5)
        with pytest.raises(ApiError, match=r"not an HTTP reply|bad Content-Length"):
            client.get("/api/v1/pods")
    finally:
        server.close()
