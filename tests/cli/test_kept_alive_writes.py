"""The CLI's writes reuse one HTTP/1.1 connection, as kubectl's transport does (`tessera apply`
of many objects is one connection, not one per object), and a connection the server closed
meanwhile is handled: an idempotent request is sent again on a new one, a POST is not (the
server may have done it), against a real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tessera_cli.kube import ApiError, KubeClient, KubeConfig


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections = 0
        self.requests: list[tuple[str, str, dict]] = []
        self.close_next = False  # answer the next request by closing the connection unread


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, *_: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def _answer(self) -> None:
        if self.server.close_next:
            self.server.close_next = False
            self.close_connection = True
            return  # nothing read, nothing answered: as a server closing an idle connection
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        self.server.requests.append((self.command, self.path, body))
        if body.get("metadata", {}).get("name") == "taken":
            reply, status = {"kind": "Status", "message": 'pods "taken" already exists',
                             "reason": "AlreadyExists"}, 409  # fmt: skip
        else:
            reply, status = {"kind": "Pod", "metadata": body.get("metadata", {})}, 201
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Warning", '299 - "careful"')
        self.end_headers()
        self.wfile.write(data)

    do_POST = do_PUT = do_PATCH = do_DELETE = _answer


@pytest.fixture
def server() -> Iterator[Server]:
    httpd = Server()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def client_for(server: Server, prefix: str = "") -> KubeClient:
    host, port = server.server_address[:2]
    return KubeClient(KubeConfig(server=f"http://{host}:{port}{prefix}"), timeout_s=5.0)


def pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}}


def test_many_writes_share_one_connection_and_keep_replies_warnings_and_refusals(
    server: Server,
) -> None:
    with client_for(server) as client:
        for i in range(5):
            assert client.post("/api/v1/namespaces/default/pods", pod(f"p{i}"))["metadata"] == {
                "name": f"p{i}"}
        with pytest.raises(ApiError) as refused:
            client.post("/api/v1/namespaces/default/pods", pod("taken"))
        client.patch("/api/v1/namespaces/default/pods/p0", {"metadata": {"labels": {"a": "b"}}})
        assert client.take_warnings() == ["careful"] * 7
    assert refused.value.status == 409 and "already exists" in str(refused.value)
    assert server.connections == 1
    assert [r[0] for r in server.requests] == ["POST"] * 6 + ["PATCH"]


def test_a_server_path_prefix_is_kept(server: Server) -> None:
    with client_for(server, "/k8s/clusters/c1") as client:
        client.put("/api/v1/namespaces/default/pods/p0", pod("p0"))
    assert server.requests[0][1] == "/k8s/clusters/c1/api/v1/namespaces/default/pods/p0"


def test_an_idempotent_write_on_a_closed_connection_is_sent_again(server: Server) -> None:
    with client_for(server) as client:
        client.put("/api/v1/namespaces/default/pods/p0", pod("p0"))
        server.close_next = True
        client.put("/api/v1/namespaces/default/pods/p0", pod("p0"))
    assert [r[0] for r in server.requests] == ["PUT", "PUT"]
    assert server.connections == 2


def test_a_create_on_a_closed_connection_is_not_sent_twice(server: Server) -> None:
    with client_for(server) as client:
        client.post("/api/v1/namespaces/default/pods", pod("p0"))
        server.close_next = True
        with pytest.raises(ApiError, match="cannot reach the API server"):
            client.post("/api/v1/namespaces/default/pods", pod("p1"))
        # the next request opens a new connection and goes through
        client.post("/api/v1/namespaces/default/pods", pod("p2"))
    assert [r[2]["metadata"]["name"] for r in server.requests] == ["p0", "p2"]
