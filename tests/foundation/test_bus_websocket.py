"""nats-py is imported without aiohttp (tessera/__init__.py: a tenth of every service's start),
and a websocket URL still connects: `tessera.bus.connect` binds aiohttp in for it. Checked in a
fresh interpreter (this one may have imported aiohttp already), against a real nats-server with
its websocket listener."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tessera_cli.nats_embedded import find_nats_server, free_port

CLIENT = textwrap.dedent("""
    import asyncio, sys
    import tessera.scheduler.runtime  # a service's imports
    from nats.aio import transport
    assert "aiohttp" not in sys.modules and transport.aiohttp is None, "aiohttp imported"
    from tessera.bus import connect
    from tessera.settings import NatsSettings

    async def main(url):
        nc = await connect(NatsSettings(NATS_URL=url), name="ws-test", initial_attempts=20)
        sub = await nc.subscribe("ws.test")
        await nc.publish("ws.test", b"over websocket")
        msg = await sub.next_msg(timeout=5)
        await nc.close()
        print(msg.data.decode())

    asyncio.run(main(sys.argv[1]))
""")


def test_a_websocket_url_connects_though_aiohttp_is_kept_out_of_nats_import(
    tmp_path: Path,
) -> None:
    port, ws_port = free_port(), free_port()
    config = tmp_path / "ws.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\n'
                      f'websocket {{ listen: "127.0.0.1:{ws_port}", no_tls: true }}\n')
    server = subprocess.Popen([find_nats_server(), "-c", str(config)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-c", CLIENT, f"ws://127.0.0.1:{ws_port}"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(10)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "over websocket"
