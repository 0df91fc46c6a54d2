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
