"""Each device family's grants under its own HAMi keys (tessera.device_kinds.pod_grants), and the
pod's whole record read back from them: what restore, the node agent's grant check and the CLI
read."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tessera import hami, signing
from tessera.device_kinds import pod_grants
from tessera.models import DeviceGrant
from tessera.restore import allocation_from_pod

GPU = DeviceGrant(uuid="GPU-a", type="NVIDIA-A10", memory_mib=3000, cores=30)
MLU = DeviceGrant(uuid="MLU-b", type="MLU370-X4", memory_mib=4096, cores=50)
DCU = DeviceGrant(uuid="DCU-c", type="DCU-Z100L", memory_mib=2000, cores=60)
NPU = DeviceGrant(uuid="npu-d", type="Ascend910B3", memory_mib=16384, cores=5)


def test_an_nvidia_pod_is_recorded_as_before() -> None:
    containers = [[GPU], []]
    out = pod_grants.grant_annotations(containers, (pod_grants.TO_ALLOCATE,))
    assert out == {hami.ANN_DEVICES_TO_ALLOCATE: hami.encode_pod_devices(containers)}
    assert pod_grants.pod_grants_text(out) == out[hami.ANN_DEVICES_TO_ALLOCATE]


@pytest.mark.parametrize(("grant", "prefix"), [
    (MLU, "hami.io/cambricon-mlu"), (DCU, "hami.io/dcu"), (NPU, "hami.io/Ascend910B3")])
def test_a_vendor_pod_carries_its_own_keys_only(grant: DeviceGrant, prefix: str) -> None:
    containers = [[], [grant]]
    out = pod_grants.grant_annotations(containers, pod_grants.ROLES)
    text = hami.encode_pod_devices(containers)
    assert out == {f"{prefix}-devices-to-allocate": text, f"{prefix}-devices-allocated": text}
    assert pod_grants.pod_grants_text(out, pod_grants.ALLOCATED) == text


def test_a_mixed_pod_is_split_by_family_and_merged_back_whole() -> None:
    containers = [[GPU], [MLU], [], [DCU]]
    out = pod_grants.grant_annotations(containers, (pod_grants.ALLOCATED,))
    assert hami.decode_pod_devices(out[hami.ANN_DEVICES_ALLOCATED]) == [[GPU], [], [], []]
    assert hami.decode_pod_devices(out["hami.io/cambricon-mlu-devices-allocated"]) == [
        [], [MLU], [], []]
    assert hami.decode_pod_devices(out["hami.io/dcu-devices-allocated"]) == [[], [], [], [DCU]]
    # read back as the one text the node agent signs
    assert pod_grants.pod_grants_text(out) == hami.encode_pod_devices(containers)


def test_reading_prefers_each_familys_allocated_record_and_refuses_a_malformed_merge() -> None:
    annotations = {"hami.io/dcu-devices-to-allocate": ";",  # emptied as HAMi's plugins do
                   "hami.io/dcu-devices-allocated": "DCU-c,DCU-Z100L,2000,60:;"}
    assert pod_grants.pod_grants_text(annotations) == "DCU-c,DCU-Z100L,2000,60:;"
    assert pod_grants.pod_grants_text(annotations, pod_grants.TO_ALLOCATE) == ";"
    assert pod_grants.pod_grants_text({"other": "x"}) is None
    with pytest.raises(ValueError):
        pod_grants.pod_grants_text({hami.ANN_DEVICES_ALLOCATED: "GPU-a,NVIDIA,1,1:;",
                                    "hami.io/dcu-devices-allocated": "no-separators"})
    with pytest.raises(ValueError):
        pod_grants.role_keys("bound")


def test_every_familys_keys_are_listed_for_clearing_and_for_slim_listings() -> None:
    from tessera.cluster.slim_pods import ANNOTATIONS

    keys = pod_grants.role_keys(pod_grants.TO_ALLOCATE)
    assert {hami.ANN_DEVICES_TO_ALLOCATE, "hami.io/cambricon-mlu-devices-to-allocate",
            "hami.io/dcu-devices-to-allocate",
            "hami.io/Ascend910B3-devices-to-allocate"} <= set(keys)
    assert set(pod_grants.all_keys()) <= set(ANNOTATIONS)


def test_a_vendor_pods_signed_record_restores_and_verifies() -> None:
    containers = [[MLU]]
    annotations = {**pod_grants.grant_annotations(containers, pod_grants.ROLES),
                   hami.ANN_VGPU_NODE: "mlu-1", hami.ANN_BIND_PHASE: hami.BIND_PHASE_SUCCESS}
    pod = {"metadata": {"uid": "u1", "name": "p", "namespace": "default",
                        "annotations": annotations},
           "spec": {"nodeName": "mlu-1", "containers": [{"name": "main"}]},
           "status": {"phase": "Running"}}
    found = allocation_from_pod(pod, quota_held=False, now=0.0, claim_ttl_s=10.0)
    assert found is not None and found[0].containers == containers
    # the node agent signs the whole record; the vendor's key read back verifies
    key = Ed25519PrivateKey.generate()
    text = hami.encode_pod_devices(containers)
    signature = signing.record_signature(signing.Signer("who", key), "u1", text)
    read = pod_grants.pod_grants_text(annotations, pod_grants.ALLOCATED)
    assert read == text
    assert signing.record_verifies(signature, "u1", read, "who", {"who": key.public_key()})


def test_every_familys_record_is_scheduler_owned() -> None:
    """Restore and the grant check read a vendor's record as NVIDIA's: nobody else may write it
    (the webhook denies a pod or an update setting one)."""
    for key in ("hami.io/cambricon-mlu-devices-allocated", "hami.io/dcu-devices-to-allocate",
                "hami.io/Ascend910B3-devices-allocated", hami.ANN_DEVICES_ALLOCATED):
        assert hami.scheduler_owned(key), key
    assert not hami.scheduler_owned("cambricon.com/use-mlutype")
