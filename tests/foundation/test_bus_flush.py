"""`bus.flush`: once it returns, a subscription made just before it is in place on the server,
so a request another connection makes at once is answered (nats-py's own `flush` lets its PING
overtake the SUB still queued, and the request got "no responders" on a busy host)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from urllib.parse import urlparse

from tessera import bus
from tessera.settings import NatsSettings

DELAY_S = 0.3


class SlowLink:
    """A TCP link to nats-server on which the server reads each client command `DELAY_S` after
    the one before, in order, as a busy server may; what the server sends passes at once."""

    def __init__(self, url: str) -> None:
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

    @staticmethod
    async def _up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                command = line
                if line.split(b" ", 1)[0].upper() in (b"PUB", b"HPUB"):
                    command += await reader.readexactly(int(line.split()[-1]) + 2)
                await asyncio.sleep(DELAY_S)
                writer.write(command)
                await writer.drain()
        finally:
            writer.close()


async def test_a_subscription_flushed_is_in_place_for_another_connection(nats_url: str) -> None:
    link = SlowLink(nats_url)
    slow_url = await link.start()
    subscriber = requester = None
    try:
        subscriber = await bus.connect(NatsSettings(NATS_URL=slow_url), "slow-subscriber")
        requester = await bus.connect(NatsSettings(NATS_URL=nats_url), "requester")
        subject = f"test.flush.{uuid.uuid4().hex[:8]}"

        async def answer(msg) -> None:
            await msg.respond(b"here")

        await subscriber.subscribe(subject, cb=answer)
        await bus.flush(subscriber)
        reply = await requester.request(subject, b"", timeout=10)
        assert reply.data == b"here"
    finally:
        for nc in (subscriber, requester):
            if nc is not None:
                await nc.close()
        await link.stop()
