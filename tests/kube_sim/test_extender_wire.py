"""kube-sim calls an extender as kube-scheduler does (upstream `extender/v1/types.go`: no JSON
tags, so Go's field names are the keys): `{"Pod":...,"Nodes":null,"NodeNames":[...]}`,
compact; and it reads the replies as Go's decoder does, keys in any case, the last of a field's
spellings winning. A real HTTP server here records the bytes and answers what a test gives."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from tessera.kube_sim.extender import ExtenderClient, ExtenderConfig, go_field

POD = {"metadata": {"name": "p", "namespace": "default", "uid": "u-1"},
       "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


class RecordingExtender:
    """An HTTP/1.1 server that keeps every request body and answers `replies[path]` (JSON)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, bytes]] = []
        self.replies: dict[str, Any] = {}
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split(" ")[1]
                length = next(int(line.split(":", 1)[1]) for line in lines
                              if line.lower().startswith("content-length:"))  # fmt: skip
                self.bodies.append((path, await reader.readexactly(length)))
                body = json.dumps(self.replies[path]).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def extender() -> AsyncIterator[tuple[RecordingExtender, int]]:
    server = RecordingExtender()
    port = await server.start()
    yield server, port
    assert server.server is not None
    server.server.close()
    await server.server.wait_closed()


async def test_filter_sends_extender_args_with_gos_field_names(
        extender: tuple[RecordingExtender, int]) -> None:  # fmt: skip
    server, port = extender
    client = ExtenderClient(ExtenderConfig(url_prefix=f"http://127.0.0.1:{port}/ext"))
    refused = {"n2": "8/8 CardInsufficientMemory"}
    server.replies["/ext/filter"] = {"NodeNames": ["n1"], "FailedNodes": refused,
                                     "FailedAndUnresolvableNodes": {}, "Error": ""}
    try:
        result = await client.filter(POD, ["n1", "n2"])
    finally:
        await client.close()
    path, body = server.bodies[0]
    assert path == "/ext/filter"
    assert body == (b'{"Pod":' + json.dumps(POD, separators=(",", ":")).encode()
                    + b',"Nodes":null,"NodeNames":["n1","n2"]}')  # fmt: skip
    assert result.nodes == ["n1"]
    assert result.failed == {"n2": "8/8 CardInsufficientMemory"}


async def test_without_the_node_cache_the_node_list_goes_and_names_are_null(
        extender: tuple[RecordingExtender, int]) -> None:  # fmt: skip
    server, port = extender
    client = ExtenderClient(ExtenderConfig(url_prefix=f"http://127.0.0.1:{port}",
                                           node_cache_capable=False))  # fmt: skip
    server.replies["/filter"] = {"Nodes": {"items": [{"metadata": {"name": "n2"}}]}}
    try:
        result = await client.filter(POD, ["n1", "n2"])
    finally:
        await client.close()
    sent = json.loads(server.bodies[0][1])
    assert list(sent) == ["Pod", "Nodes", "NodeNames"]
    assert sent["NodeNames"] is None
    assert [i["metadata"]["name"] for i in sent["Nodes"]["items"]] == ["n1", "n2"]
    assert result.nodes == ["n2"]


async def test_replies_are_read_in_any_case_as_go_reads_them(
        extender: tuple[RecordingExtender, int]) -> None:  # fmt: skip
    server, port = extender
    client = ExtenderClient(ExtenderConfig(url_prefix=f"http://127.0.0.1:{port}"))
    try:
        # Tessera's own replies (lower-case keys)
        server.replies["/filter"] = {"nodenames": ["n2"], "failedNodes": {"n1": "x"},
                                     "failedAndUnresolvableNodes": {"n3": "y"}, "error": ""}
        result = await client.filter(POD, ["n1", "n2", "n3"])
        assert (result.nodes, result.failed, result.unresolvable) == (
            ["n2"], {"n1": "x"}, {"n3": "y"})
        # an error in Go's spelling is an error
        server.replies["/filter"] = {"Error": "no GPU"}
        with pytest.raises(Exception, match="no GPU"):
            await client.filter(POD, ["n1"])
        server.replies["/prioritize"] = [{"Host": "n1", "Score": 3}, {"host": "n2", "score": 7},
                                         {"HOST": "elsewhere", "Score": 10}]  # fmt: skip
        assert await client.prioritize(POD, ["n1", "n2"]) == {"n1": 3, "n2": 7}
    finally:
        await client.close()


def test_the_last_spelling_of_a_field_wins_as_in_go() -> None:
    assert go_field({"NodeNames": ["a"], "nodenames": ["b"]}, "NodeNames") == ["b"]
    assert go_field({"nodenames": ["b"], "NodeNames": ["a"]}, "NodeNames") == ["a"]
    assert go_field({"NODENAMES": None}, "NodeNames") is None
    assert go_field({"Nodes": 1}, "NodeNames") is None
