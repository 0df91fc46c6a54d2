"""The scheduler's bind writes each device family's own HAMi record (HAMi's PatchAnnotations
per vendor): a Cambricon pod gets `hami.io/cambricon-mlu-devices-to-allocate` and no
`hami.io/vgpu-…` key (HAMi's NVIDIA tools would take its MLU for a GPU), a pod mixing NVIDIA
and MLU containers one key per family with its own containers only; a ledger rebuilt from the
pods reads every family's record back."""

from __future__ import annotations

from typing import Any

from tessera.scheduler.validation import allocation_from_pod

from tessera import hami
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.device_kinds.cambricon.node import CambriconNode
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.models import NodeRegistration
from tessera.settings import TesseraSettings

from .conftest import MakeService, http_client, unique
from .factories import container, device, pod
from .test_extender import bind_call, filter_call, setup_node

MLU_TO_ALLOCATE = "hami.io/cambricon-mlu-devices-to-allocate"


def mlu_container(name: str, vmemory: int) -> dict[str, Any]:
    return {"name": name, "image": "x", "resources": {"limits": {
        "cambricon.com/vmlu": 1, "cambricon.com/mlu.smlu.vmemory": vmemory,
        "cambricon.com/mlu.smlu.vcore": 50}}}


def mixed_node(name: str, tmp: str) -> NodeRegistration:
    """One NVIDIA GPU and two MLUs as their node agents advertise them."""
    settings = TesseraSettings(device_source="static", static_gpu_count=2,
                               static_gpu_model="MLU370-X4", static_gpu_memory_mib=24576,
                               region_host_dir=tmp)
    family = CambriconNode()
    mlus = family.advertise(family.backend(settings, name).discover(), NodeDeviceConfig())
    mlus = [m.model_copy(update={"index": m.index + 1}) for m in mlus]
    return NodeRegistration(node=name, devices=[device(f"GPU-{name}-0", 0), *mlus])


async def bound_annotations(make_service: MakeService, buckets: Buckets,
                            cluster: InMemoryCluster, spec: dict[str, Any],
                            tmp: str) -> tuple[str, dict[str, Any]]:  # fmt: skip
    service = await make_service()
    name = await setup_node(buckets, service, mixed_node(unique("n"), tmp))
    created = cluster.add_pod(spec)
    async with http_client(service) as client:
        assert (await filter_call(client, created, [name]))["nodenames"] == [name]
        assert await bind_call(client, created, name) == ""
    bound = cluster.pods[("default", created["metadata"]["name"])]
    assert bound["spec"]["nodeName"] == name
    return name, bound


async def test_an_mlu_pod_carries_cambricon_keys_and_no_vgpu_key(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, tmp_path
) -> None:
    name, bound = await bound_annotations(make_service, buckets, cluster,
                                          pod(mlu_container("main", 16)), str(tmp_path))
    annotations = bound["metadata"]["annotations"]
    assert hami.ANN_DEVICES_TO_ALLOCATE not in annotations
    assert hami.ANN_DEVICES_ALLOCATED not in annotations
    [[grant]] = hami.decode_pod_devices(annotations[MLU_TO_ALLOCATE])
    assert (grant.type, grant.memory_mib, grant.cores) == ("MLU370-X4", 16 * 256, 50)
    assert annotations[hami.ANN_VGPU_NODE] == name  # HAMi writes it for every device type
    # the ledger rebuilt from the cluster reads the Cambricon record back
    allocation = allocation_from_pod(bound, name)
    assert allocation is not None and allocation.containers == [[grant]]


async def test_a_mixed_pod_has_one_record_per_family_with_its_containers_only(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, tmp_path
) -> None:
    spec = pod(container("cuda", mem=1000, cores=10), mlu_container("mlu", 8))
    name, bound = await bound_annotations(make_service, buckets, cluster, spec, str(tmp_path))
    annotations = bound["metadata"]["annotations"]
    nvidia = hami.decode_pod_devices(annotations[hami.ANN_DEVICES_TO_ALLOCATE])
    mlu = hami.decode_pod_devices(annotations[MLU_TO_ALLOCATE])
    # every container listed in both, each family's devices only (HAMi's EncodePodSingleDevice)
    assert [[g.uuid for g in c] for c in nvidia] == [[f"GPU-{name}-0"], []]
    assert [len(c) for c in mlu] == [0, 1] and mlu[1][0].type == "MLU370-X4"
    allocation = allocation_from_pod(bound, name)
    assert allocation is not None
    assert allocation.containers == [nvidia[0], mlu[1]]
