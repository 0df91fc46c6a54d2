"""A claim with `adminAccess: true` consumes nothing (resource.k8s.io/v1: it "ignores all
ordinary claims to the device ... and any resource allocations"), so a ledger or quota rebuilt
from the cluster's ResourceClaims (the scheduler's and the quota service's, after NATS lost its
store) gives it no slice: it used to restore the monitor's card as a whole-card grant beside
the tenants' slices. Pure: `tessera.dra_restore` on claims as the allocator writes them."""

from __future__ import annotations

from tessera.dra_names import DRIVER_NAME
from tessera.dra_restore import allocations_from_claims
from tessera.models import DeviceInfo
from tessera.restore import RestoreReport

NODE = "gpu-node-1"
CARD = DeviceInfo(uuid="GPU-card-1", index=0, type="NVIDIA-H100", memory_mib=16384, cores=100,
                  split_count=10)  # fmt: skip


def pod_with_claim(name: str, namespace: str, uid: str) -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid},
            "spec": {"nodeName": NODE,
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": f"{name}-gpu"}],
                     "containers": [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}}]},
            "status": {"phase": "Running"}}  # fmt: skip


def claim_for(pod: dict, result: dict) -> dict:
    meta = pod["metadata"]
    return {"metadata": {"name": f"{meta['name']}-gpu", "namespace": meta["namespace"],
                         "uid": f"claim-{meta['uid']}"},
            "status": {"allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER_NAME, "pool": NODE, "device": "gpu-0",
                **result}]}},
                "reservedFor": [{"resource": "pods", "name": meta["name"], "uid": meta["uid"]}]}}


def test_a_rebuild_gives_an_admin_access_claim_no_slice() -> None:
    tenant = pod_with_claim("train", "team-a", "uid-train")
    monitor = pod_with_claim("monitor", "monitoring", "uid-monitor")
    claims = [claim_for(tenant, {"consumedCapacity": {"memory": "12Gi", "cores": "50"}}),
              claim_for(monitor, {"adminAccess": True})]  # fmt: skip
    report = RestoreReport()
    by_node = allocations_from_claims(
        claims, {p["metadata"]["uid"]: p for p in (tenant, monitor)},
        lambda node: [CARD] if node == NODE else None, quota_held=False, now=1.0, report=report,
    )  # fmt: skip
    [(allocation, _)] = by_node[NODE]
    assert allocation.pod_uid == "uid-train"
    assert [(g.uuid, g.memory_mib, g.cores) for row in allocation.containers for g in row] == [
        ("GPU-card-1", 12288, 50)]
    assert report.refused == [] and report.gpu_pods == 1
