"""Spill to host memory is sealed from the pod itself (docs/elastic.md, "Spilling to host
memory"): at PreStartContainer the node agent reads `tessera.io/gpumem-spill` from the pod it
read for the grant check and seals each container's bound into its limits (`spill_bytes`);
no annotation, or another container named, seals none. Real NATS, real unix-socket gRPC."""

from __future__ import annotations

from node_agent_rig import grants, make_pod, running_rig

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
        assert await sealed_spill(rig, "none", None) == {"train": 0, "eval": 0}
        assert await sealed_spill(rig, "all", "2048") == {"train": 2048 << 20, "eval": 2048 << 20}
        assert await sealed_spill(rig, "named", "eval=512") == {"train": 0, "eval": 512 << 20}
        # edited after admission into something nobody validated: nothing spills
        assert await sealed_spill(rig, "bad", "lots") == {"train": 0, "eval": 0}
