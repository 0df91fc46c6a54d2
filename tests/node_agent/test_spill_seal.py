"""Spill to host memory is sealed from the pod itself (docs/elastic.md, "Spilling to host
memory"): at PreStartContainer the node agent reads `tessera.io/gpumem-spill` from the pod it
read for the grant check and seals each container's bound into its limits (`spill_bytes`);
no annotation, or another container named, seals none. The node's /metrics sums the bounds it
sealed: host memory promised to spills on the node. Real NATS, real unix-socket gRPC."""

from __future__ import annotations

from node_agent_rig import grants, make_pod, running_rig
from test_agent_metrics import value

from tessera.region import SEALED_LIMITS_DIR, read_limits

SPILL = "tessera.io/gpumem-spill"


async def sealed_spill(rig, name: str, annotation: str | None) -> dict[str, int]:
    pod = make_pod(name, [("train", 1), ("eval", 1)])
    if annotation is not None:
        pod["metadata"]["annotations"] = {SPILL: annotation}
    await rig.bind(pod, [grants((rig.gpus[0], 1000, 30)), grants((rig.gpus[1], 1000, 30))])
    admission = await rig.kubelet.admit_pod(pod)
    assert admission.ok, admission.error
    return {
        c.name: read_limits(c.mount(SEALED_LIMITS_DIR).host_path).spill_bytes
        for c in admission.containers
    }


async def test_each_container_seals_the_spill_its_pod_asked_for(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        def promised() -> tuple[float | None, float | None, float | None]:
            text = rig.agent.metrics.render()
            return (value(text, "tessera_node_agent_spill_bytes", kind="promised"),
                    value(text, "tessera_node_agent_spill_bytes", kind="spilled"),
                    value(text, "tessera_node_agent_spill_containers"))  # fmt: skip

        assert promised() == (0, 0, 0)
        assert await sealed_spill(rig, "none", None) == {"train": 0, "eval": 0}
        assert await sealed_spill(rig, "all", "2048") == {"train": 2048 << 20, "eval": 2048 << 20}
        assert promised() == (4096 << 20, 0, 2)  # sealed, nothing spilled yet
        assert await sealed_spill(rig, "named", "eval=512") == {"train": 0, "eval": 512 << 20}
        # edited after admission into something nobody validated: nothing spills
        assert await sealed_spill(rig, "bad", "lots") == {"train": 0, "eval": 0}
        assert promised() == (4608 << 20, 0, 3)
        text = rig.agent.metrics.render()
        assert value(text, "tessera_node_agent_host_memory_bytes", kind="total") > 0
