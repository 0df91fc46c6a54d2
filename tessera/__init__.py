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
    """Have nats-py's transport module imported with aiohttp hidden.

    nats-py imports aiohttp (and through it an SSL context with the system's CA certificates)
    only to offer websocket URLs (`ws://`, `wss://`); that import was a tenth of every
    service's start. Tessera connects over TCP, so when nats-py's transport is first imported
    (by whatever imports nats, whenever: a CLI command that never touches the bus imports
    nothing of it), `import aiohttp` fails inside it (nats-py then leaves its websocket
    transport unbound), and aiohttp is importable again right after. `tessera.bus.connect`
    (the one place that connects) binds aiohttp into the transport when a websocket URL is
    configured. Nothing happens if nats-py's transport or aiohttp is already imported."""
    import sys
    from importlib.abc import MetaPathFinder
    from importlib.machinery import ModuleSpec, PathFinder
    from types import ModuleType
    from typing import Any

    if "nats.aio.transport" in sys.modules or "aiohttp" in sys.modules:
        return

    class TransportWithoutAiohttp(MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
            if name != "nats.aio.transport":
                return None
            sys.meta_path.remove(self)  # once
            spec = PathFinder.find_spec(name, path, target)
            loader: Any = spec.loader if spec is not None else None
            if loader is None or not hasattr(loader, "exec_module"):
                return spec
            run = loader.exec_module

            def exec_module(module: ModuleType) -> None:
                hidden = "aiohttp" not in sys.modules
                if hidden:
                    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # import raises
                try:
                    run(module)
                finally:
                    if hidden and "aiohttp" in sys.modules and sys.modules["aiohttp"] is None:
                        del sys.modules["aiohttp"]

            loader.exec_module = exec_module  # this module's own loader object
            return spec

    sys.meta_path.insert(0, TransportWithoutAiohttp())


_nats_without_websockets()
