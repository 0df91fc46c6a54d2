"""tessera-node-agent: device discovery, device plugin, container regions.

`NodeAgent` (agent.py) assembles: `devices` / `nvml` (what GPUs, healthy or not), `registration`
(tessera-nodes heartbeats, node events, HAMi's node annotation), `plugin` (kubelet's device
plugin and the exact-identity handshake, rules in `handshake`), `containers` (the per-container
directories shared with libvgpu), `usage` (sampling, OOM events, contention flags, cleanup) and
`limits` (tessera.node.<node>.limits.set).
"""
