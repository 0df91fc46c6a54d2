"""What a claim gives whom (dra/claims.py): exact grants from the allocator's consumedCapacity,
and every malformed value from the API server refused with a sentence, never a crash."""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
from tessera.node_agent.dra.claims import ClaimError, plan

from tessera.models import DeviceInfo

NODE = "n1"
DEVICES = [DeviceInfo(uuid=f"GPU-{i}", index=i, type="NVIDIA-A10", memory_mib=24576)
           for i in range(2)]  # fmt: skip


def claim(results: list, reserved: list | None = None) -> dict:
    return {
        "metadata": {"name": "c", "namespace": "ns", "uid": "cu"},
        "status": {"allocation": {"devices": {"results": results}},
                   "reservedFor": reserved or [{"resource": "pods", "name": "p", "uid": "pu"}]},
    }  # fmt: skip


POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "pu"},
    "spec": {
        "resourceClaims": [{"name": "gpu", "resourceClaimName": "c"}],
        "initContainers": [{"name": "init"}],
        "containers": [{"name": "a"}, {"name": "b", "resources": {"claims": [{"name": "gpu"}]}}],
    },
}


def result(**over: object) -> dict:
    base = {"request": "gpu", "driver": "gpu.tessera.io", "pool": NODE, "device": "gpu-1",
            "consumedCapacity": {"memory": "3000Mi", "cores": "30", "slots": "1"}}  # fmt: skip
    base.update(over)
    return base


def test_the_grant_is_the_consumed_capacity_of_the_container_that_names_the_claim() -> None:
    got = plan(claim([result()]), POD, NODE, DEVICES)
    assert (got.container_index, got.container, got.containers) == (2, "b", [2])
    [device] = got.devices
    assert (device.grant.uuid, device.grant.memory_mib, device.grant.cores) == ("GPU-1", 3000, 30)
    # bytes round up to whole MiB (the policy's step is 1Mi; a stray byte is never lost)
    odd = plan(claim([result(consumedCapacity={"memory": "1048577", "cores": "0"})]), POD, NODE,
               DEVICES)  # fmt: skip
    assert odd.devices[0].grant.memory_mib == 2
    # no consumable capacity: the whole device
    whole = plan(claim([result(consumedCapacity=None)]), POD, NODE, DEVICES)
    assert (whole.devices[0].grant.memory_mib, whole.devices[0].grant.cores) == (24576, 100)


@pytest.mark.parametrize("bad, words", [
    (result(device="gpu-9"), "not one this node offers"),
    (result(pool="other"), "is not this node's"),
    (result(consumedCapacity={"memory": "30Gi"}), "which offers 24576 MiB"),
    (result(consumedCapacity={"cores": "101"}), "at most 100"),
    (result(consumedCapacity={"cores": "1.5"}), "not a whole number"),
    (result(consumedCapacity={"memory": "-1Mi"}), "negative"),
    (result(consumedCapacity={"memory": "lots"}), "memory"),
    (result(consumedCapacity=["memory"]), "not a map"),
    (result(driver="other.example.com"), "holds no device of gpu.tessera.io"),
])  # fmt: skip
def test_bad_allocations_are_refused_with_a_sentence(bad: dict, words: str) -> None:
    with pytest.raises(ClaimError, match=words):
        plan(claim([bad]), POD, NODE, DEVICES)


def test_hostile_shapes_raise_claim_error_or_nothing() -> None:
    values = [None, 1, "x", [], {}, [None], {"a": None}, -1, 10**30, "1e400"]
    paths = [("status",), ("status", "allocation"), ("status", "allocation", "devices"),
             ("status", "allocation", "devices", "results"), ("metadata",)]  # fmt: skip
    for path, value in itertools.product(paths, values):
        broken = copy.deepcopy(claim([result()]))
        target = broken
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with contextlib.suppress(ClaimError):
            plan(broken, POD, NODE, DEVICES)
    for key, value in itertools.product(["request", "device", "shareID", "consumedCapacity"],
                                        values):  # fmt: skip
        with contextlib.suppress(ClaimError):
            plan(claim([result(**{key: value})]), POD, NODE, DEVICES)
