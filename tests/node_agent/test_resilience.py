"""The agent rides out a NATS crash: it keeps its kubelet socket, and serves again once the
broker is back."""

from __future__ import annotations

import asyncio

from node_agent_rig import grants, make_pod, running_rig

from tessera.bus import connect, ensure_bus
from tessera.region import SEALED_LIMITS_DIR, read_limits
from tessera.settings import NatsSettings, TesseraSettings


async def test_nats_killed_and_restarted(short_dir, fresh_nats):
    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="test-resilience")
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        async with running_rig(short_dir, nc, buckets) as rig:
            gpu0, gpu1 = rig.gpus
            first = make_pod("before", [("main", 1)])
            await rig.bind(first, [grants((gpu0, 1000, 10))])
            assert (await rig.kubelet.admit_pod(first)).ok
            fresh_nats.kill()
            # Without the ledger the agent cannot attribute an Allocate: it refuses, and lives.
            during = make_pod("during", [("main", 1)])
            refused = await rig.kubelet.admit_pod(during)
            assert not refused.ok
            rig.kubelet.remove_pod(during["metadata"]["uid"])
            fresh_nats.restart()
            for _ in range(100):
                if nc.is_connected:
                    break
                await asyncio.sleep(0.1)
            after = make_pod("after", [("main", 1)])
            await rig.bind(after, [grants((gpu1, 3000, 30))])
            admission = await rig.kubelet.admit_pod(after)
            assert admission.ok, admission.error
            sealed = read_limits(admission.containers[0].mount(SEALED_LIMITS_DIR).host_path)
            assert sealed.devices[0].mem_limit_bytes >> 20 == 3000
            # And the heartbeat put the node back (the KV is on disk; the key is re-put anyway).
            for _ in range(50):
                try:
                    if await buckets.nodes.get(rig.node):
                        break
                except Exception:
                    await asyncio.sleep(0.1)
            assert await buckets.nodes.get(rig.node)
    finally:
        await nc.close()
