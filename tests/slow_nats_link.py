"""A TCP link to nats-server on which the server reads each client command late (tests of
`bus.flush` and of endpoints that must be registered before their service says it serves)."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlparse

DELAY_S = 0.3


class SlowLink:
    """A TCP link to nats-server on which the server reads each client command `delay_s` after
    the one before, in order, as a busy server may; what the server sends passes at once."""

    def __init__(self, url: str, delay_s: float = DELAY_S) -> None:
        self.delay_s = delay_s
        target = urlparse(url)
        self.host, self.port = target.hostname or "127.0.0.1", target.port or 4222
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"nats://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self.server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(self.host, self.port)
        for pipe in (self._down(server_r, client_w), self._up(client_r, server_w)):
            task = asyncio.create_task(pipe)
            self.tasks.add(task)

    @staticmethod
    async def _down(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def _up(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                command = line
                if line.split(b" ", 1)[0].upper() in (b"PUB", b"HPUB"):
                    command += await reader.readexactly(int(line.split()[-1]) + 2)
                await asyncio.sleep(self.delay_s)
                writer.write(command)
                await writer.drain()
        finally:
            writer.close()
