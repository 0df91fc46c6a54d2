"""An embedded uvicorn serves HTTP and leaves the process's signal handlers as it found them.

Plain `uvicorn.Server.serve()` swaps SIGINT/SIGTERM while it runs and restores what it saw at
start when it stops; in a process whose handlers changed meanwhile (pytest-asyncio's runner,
a service's own stop handling), that restores a stale handler.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import uvicorn

from tessera.embedded_http import EmbeddedUvicorn
from tessera_cli.nats_embedded import free_port


async def _hello(scope: dict, receive: object, send: object) -> None:  # a bare ASGI app
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"hello"})  # type: ignore[operator]


def test_serving_and_stopping_touch_no_signal_handler() -> None:
    def ours(*_: object) -> None:
        return None

    previous = {sig: signal.signal(sig, ours) for sig in (signal.SIGINT, signal.SIGTERM)}
    seen_while_serving: dict[signal.Signals, object] = {}

    async def serve_once() -> str:
        port = free_port()
        server = EmbeddedUvicorn(uvicorn.Config(_hello, host="127.0.0.1", port=port,
                                                lifespan="off", log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        for sig in previous:
            seen_while_serving[sig] = signal.getsignal(sig)
        async with httpx.AsyncClient() as http:
            body = (await http.get(f"http://127.0.0.1:{port}/")).text
        server.should_exit = True
        await task
        return body

    try:
        assert asyncio.run(serve_once()) == "hello"
        for sig in previous:
            assert seen_while_serving[sig] is ours, f"{sig.name} replaced while serving"
            assert signal.getsignal(sig) is ours, f"{sig.name} not as it was after stopping"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
