"""Tessera's shared package: the contract every service builds on.

- `tessera.settings`  settings from env (HAMi's defaults)
- `tessera.bus`       NATS names, connecting, bucket/stream creation, CAS updates
- `tessera.codec`     versioned msgpack codec for messages
- `tessera.models`    every message on the bus
- `tessera.hami`      HAMi encodings: requests, pod and node annotations
- `tessera.cluster`   the cluster port (Kubernetes operations) and its implementations
- `tessera.events`    a client for the public event stream
- `tessera.simnodes`  the simulated nodes the local stack asks kube-sim to play

The `tessera` command and the local-stack runner live in their own package, `tessera_cli`,
which no service installs a dependency on (tests/foundation/test_architecture.py).
"""

__version__ = "0.1.0"


def _nats_without_websockets() -> None:
    """Import nats-py's transport module with aiohttp hidden.

    nats-py imports aiohttp (and through it an SSL context with the system's CA certificates)
    only to offer websocket URLs (`ws://`, `wss://`); that import was a tenth of every
    service's start. Tessera connects over TCP, so nats-py's transport is first imported here
    with `import aiohttp` failing (nats-py then leaves its websocket transport unbound), and
    aiohttp is importable again right after. `tessera.bus.connect` (the one place that
    connects) binds aiohttp into the transport when a websocket URL is configured.
    Every tessera module runs this before it can import nats; nothing if nats-py's transport
    or aiohttp is already imported."""
    import sys

    if "nats.aio.transport" in sys.modules or "aiohttp" in sys.modules:
        return
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # `import aiohttp` raises
    try:
        import nats.aio.transport  # noqa: F401
    except ImportError:
        pass  # nats-py missing or broken: whoever imports it says so
    finally:
        if "aiohttp" in sys.modules and sys.modules["aiohttp"] is None:
            del sys.modules["aiohttp"]


_nats_without_websockets()
