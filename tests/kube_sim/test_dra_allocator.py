"""kube-sim's structured allocator (kube-scheduler's DynamicResources rules), pure: requests
`exactly` and `firstAvailable`, counts and `All`, CEL selectors with the quantity/semver
libraries, constraints, consumable capacity, shared counters, device taints."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.kube_sim.dra import cel
from tessera.kube_sim.dra.allocator import Allocator, Outcome, consumption
from tessera.kube_sim.dra.model import pools_for_node, usage_of

DRIVER = "gpu.example.com"
NODE = {"metadata": {"name": "node-a", "labels": {"zone": "z1"}}}
CLASSES = {
    "gpu": {"metadata": {"name": "gpu"}, "spec": {"selectors": [
        {"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}},
    "nic": {"metadata": {"name": "nic"}, "spec": {}},
}


def gpu(name: str, model: str = "A100", numa: int = 0, memory: str = "40Gi",
        **extra: Any) -> dict[str, Any]:
    return {"name": name,
            "attributes": {"model": {"string": model}, "numa": {"int": numa},
                           "driverVersion": {"version": "550.54.14"}},
            "capacity": {"memory": {"value": memory}}, **extra}


def slice_(devices: list[dict[str, Any]], node: str = "node-a", **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"{node}-{DRIVER}"}, "spec": {
        "driver": DRIVER, "nodeName": node,
        "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
        "devices": devices, **spec}}


def claim(*requests: dict[str, Any], name: str = "c", constraints: Any = None,
          uid: str = "uid-c") -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    return {"metadata": {"name": name, "namespace": "default", "uid": uid},
            "spec": {"devices": devices}}


def exactly(name: str = "gpu", cls: str = "gpu", **fields: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, **fields}}


def allocate(claims: list[dict[str, Any]], slices: list[dict[str, Any]],
             allocated: list[dict[str, Any]] = ()) -> Outcome:  # type: ignore[assignment]
    pools = pools_for_node(slices, NODE)
    from tessera.kube_sim.dra.model import device_index
    usage = usage_of(list(allocated), device_index(slices))
    counter = iter(range(1000))
    outcome = Allocator(claims, pools, CLASSES, usage, "node-a",
                        new_share_id=lambda: f"share-{next(counter)}").run()
    if outcome.ok:
        outcome.results()
    return outcome


def devices_of(outcome: Outcome, index: int = 0) -> list[str]:
    assert outcome.ok, outcome.reason
    assert outcome.allocations is not None
    return [r["device"] for r in outcome.allocations[index]["devices"]["results"]]


def test_exact_count_takes_distinct_devices_and_pins_the_node() -> None:
    slices = [slice_([gpu("gpu-0"), gpu("gpu-1"), gpu("gpu-2")])]
    outcome = allocate([claim(exactly(count=2))], slices)
    assert devices_of(outcome) == ["gpu-0", "gpu-1"]
    assert outcome.allocations is not None
    assert outcome.allocations[0]["nodeSelector"] == {"nodeSelectorTerms": [{"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}]}
    taken = {**claim(exactly(count=2)), "status": {"allocation": outcome.allocations[0]}}
    assert devices_of(allocate([claim(exactly())], slices, [taken])) == ["gpu-2"]
    assert not allocate([claim(exactly(count=2))], slices, [taken]).ok


def test_all_mode_takes_every_matching_device_or_nothing() -> None:
    slices = [slice_([gpu("gpu-0"), gpu("gpu-1"), gpu("gpu-2", model="T4")])]
    selector = [{"cel": {"expression": f'device.attributes["{DRIVER}"].model == "A100"'}}]
    outcome = allocate([claim(exactly(allocationMode="All", selectors=selector))], slices)
    assert devices_of(outcome) == ["gpu-0", "gpu-1"]
    one = {**claim(exactly(), uid="other"), "status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-1"}]}}}}
    assert not allocate([claim(exactly(allocationMode="All", selectors=selector))], slices,
                        [one]).ok


def test_first_available_tries_subrequests_in_order() -> None:
    slices = [slice_([gpu("gpu-0", model="T4")])]
    request = {"name": "gpu", "firstAvailable": [
        {"name": "big", "deviceClassName": "gpu", "selectors": [
            {"cel": {"expression": f'device.attributes["{DRIVER}"].model == "A100"'}}]},
        {"name": "small", "deviceClassName": "gpu"}]}
    outcome = allocate([claim(request)], slices)
    assert outcome.allocations is not None
    assert outcome.allocations[0]["devices"]["results"][0]["request"] == "gpu/small"


@pytest.mark.parametrize(("expression", "chosen"), [
    ('device.capacity["gpu.example.com"].memory.compareTo(quantity("64Gi")) >= 0', ["gpu-1"]),
    ('device.attributes["gpu.example.com"].driverVersion.isGreaterThan(semver("550.0.0"))',
     ["gpu-0"]),
    ('cel.bind(g, device.attributes["gpu.example.com"], g.model == "H100" && g.numa == 1)',
     ["gpu-1"]),
    ('device.attributes["other.example.com"].size() == 0 && '
     'isQuantity("1Gi") && quantity("1Gi").isLessThan(quantity("2Gi"))', ["gpu-0"]),
])
def test_cel_selectors_with_quantity_semver_and_bind(expression: str, chosen: list[str]) -> None:
    slices = [slice_([gpu("gpu-0"), gpu("gpu-1", model="H100", numa=1, memory="80Gi")])]
    outcome = allocate([claim(exactly(selectors=[{"cel": {"expression": expression}}]))], slices)
    assert devices_of(outcome) == chosen


def test_a_selector_that_is_no_bool_aborts_with_an_error() -> None:
    slices = [slice_([gpu("gpu-0")])]
    outcome = allocate([claim(exactly(selectors=[{"cel": {"expression": "1 + 1"}}]))], slices)
    assert not outcome.ok and "must evaluate to a bool" in outcome.reason
    assert cel.compile_error("device.driver ==") is not None


def test_match_and_distinct_attribute_constraints() -> None:
    slices = [slice_([gpu("gpu-0", numa=0), gpu("gpu-1", numa=1), gpu("gpu-2", numa=1)])]
    same = claim(exactly("a"), exactly("b"),
                 constraints=[{"matchAttribute": f"{DRIVER}/numa"}])
    assert devices_of(allocate([same], slices)) == ["gpu-1", "gpu-2"]
    apart = claim(exactly("a", count=2),
                  constraints=[{"requests": ["a"], "distinctAttribute": f"{DRIVER}/numa"}])
    assert sorted(devices_of(allocate([apart], slices))) == ["gpu-0", "gpu-1"]
    impossible = claim(exactly("a", count=3),
                       constraints=[{"distinctAttribute": f"{DRIVER}/numa"}])
    assert not allocate([impossible], slices).ok


def shared_gpu(name: str = "gpu-0") -> dict[str, Any]:
    return {"name": name, "allowMultipleAllocations": True,
            "attributes": {"model": {"string": "A100"}},
            "capacity": {
                "memory": {"value": "40Gi", "requestPolicy": {
                    "default": "1Gi", "validRange": {"min": "1Gi", "step": "1Gi"}}},
                "cores": {"value": "100", "requestPolicy": {
                    "default": "100", "validValues": ["10", "30", "50", "100"]}}}}


def test_consumable_capacity_rounds_by_policy_and_never_overcommits() -> None:
    slices = [slice_([shared_gpu()])]
    ask = exactly(capacity={"requests": {"memory": "3500Mi", "cores": "20"}})
    outcome = allocate([claim(ask)], slices)
    assert outcome.allocations is not None
    result = outcome.allocations[0]["devices"]["results"][0]
    assert result["shareID"] == "share-0"
    assert result["consumedCapacity"] == {"memory": "4Gi", "cores": "30"}  # rounded up
    held = []
    for i in range(3):  # 3 × 30 cores fit; a fourth does not (90 + 30 > 100)
        done = allocate([claim(ask, uid=f"u{i}")], slices, held)
        assert done.ok and done.allocations is not None
        held.append({**claim(ask, uid=f"u{i}"), "status": {"allocation": done.allocations[0]}})
    assert not allocate([claim(ask, uid="u4")], slices, held).ok
    # a request the policy cannot meet (cores above every valid value) never fits
    assert consumption(pools_for_node(slices, NODE)[0].devices[0], {"cores": 120}) is None


def test_unrequested_capacity_takes_the_default_or_all() -> None:
    device = pools_for_node([slice_([shared_gpu()])], NODE)[0].devices[0]
    assert consumption(device, {}) == {"memory": 1024**3, "cores": 100}
    plain = {"name": "gpu-0", "allowMultipleAllocations": True,
             "capacity": {"memory": {"value": "8Gi"}}}
    device = pools_for_node([slice_([plain])], NODE)[0].devices[0]
    assert consumption(device, {}) == {"memory": 8 * 1024**3}  # no policy: the whole capacity


def test_partitionable_devices_share_counters() -> None:
    counters = [{"name": "gpu-0-counters", "counters": {"memory": {"value": "40Gi"}}}]
    partitions = [
        {"name": f"gpu-0-mig-{i}", "consumesCounters": [
            {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "20Gi"}}}]}
        for i in range(3)
    ]
    slices = [slice_(partitions, sharedCounters=counters)]
    outcome = allocate([claim(exactly(count=2))], slices)
    assert devices_of(outcome) == ["gpu-0-mig-0", "gpu-0-mig-1"]
    assert not allocate([claim(exactly(count=3))], slices).ok  # 60Gi > 40Gi


def test_mig_partitions_never_overlap_on_the_card() -> None:
    """Tessera's driver's pool of one A100 in dynamic MIG (a devices slice and a counters slice):
    the allocator, knowing nothing of MIG, keeps NVIDIA's placement rules through the counters."""
    from tessera.node_agent.dra.slices import build_slices

    from tessera.models import DeviceInfo, MigCapability

    card = DeviceInfo(uuid="GPU-0", index=0, type="NVIDIA-A100-SXM4-80GB", memory_mib=81920,
                      mode="mig", mig=MigCapability(model="A100-SXM4-80GB"))
    slices = build_slices("node-a", [card], generation=1, driver_version="560.35.03")
    classes = {"mig": {"metadata": {"name": "mig"}, "spec": {"selectors": [{"cel": {
        "expression": 'device.attributes["gpu.tessera.io"].mode == "mig"'}}]}}}

    def profile(name: str, uid: str) -> dict[str, Any]:
        return claim({"name": "gpu", "exactly": {"deviceClassName": "mig", "selectors": [
            {"cel": {"expression": f'device.attributes["gpu.tessera.io"].profile == "{name}"'}}]}},
            name=uid, uid=uid)  # fmt: skip

    from tessera.kube_sim.dra.model import device_index

    held: list[dict[str, Any]] = []

    def place(name: str) -> str | None:
        wanted = profile(name, f"c{len(held)}")
        outcome = Allocator([wanted], pools_for_node(slices, NODE), classes,
                            usage_of(held, device_index(slices)), "node-a").run()
        if not outcome.ok:
            return None
        wanted["status"] = {"allocation": outcome.results()[0]}
        held.append(wanted)
        return outcome.results()[0]["devices"]["results"][0]["device"]

    assert place("3g.40gb") == "gpu-0-mig-3g-40gb-0"
    assert place("3g.40gb") == "gpu-0-mig-3g-40gb-4"
    assert place("3g.40gb") is None  # no third placement: every memory slice is taken
    assert place("1g.10gb") is None  # 6 of 7 compute slices used, but no memory slice free
    held.pop(0)  # the first 3g.40gb is released: slices 0-3 free again
    assert place("4g.40gb") == "gpu-0-mig-4g-40gb-0"  # 4 + 3 of 7 compute slices
    assert place("1g.10gb") is None
    held.clear()
    assert place("4g.40gb") == "gpu-0-mig-4g-40gb-0"
    assert place("2g.20gb") == "gpu-0-mig-2g-20gb-4"
    assert place("1g.10gb") == "gpu-0-mig-1g-10gb-6"
    # memory slice 7 is free, but the 7 compute slices are used (and 1g cannot start at 7)
    assert place("1g.10gb") is None


def test_class_then_claim_configuration_is_copied_into_the_allocation() -> None:
    """The driver reads its opaque configuration from the allocation: the class's entries first
    (`FromClass`, naming the requests that used the class), then the claim's (`FromClaim`, as
    written), so the claim's can override the class's."""
    opaque = {"driver": DRIVER, "parameters": {"sharing": "a"}}
    classes = {**CLASSES, "gpu": {**CLASSES["gpu"], "spec": {
        **CLASSES["gpu"]["spec"], "config": [{"opaque": opaque}]}}}
    own = {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"sharing": "b"}}}
    wanted = claim(exactly())
    wanted["spec"]["devices"]["config"] = [own]
    outcome = Allocator([wanted], pools_for_node([slice_([gpu("gpu-0")])], NODE), classes,
                        usage_of([], {}), "node-a").run()
    assert outcome.ok, outcome.reason
    assert outcome.results()[0]["devices"]["config"] == [
        {"source": "FromClass", "requests": ["gpu"], "opaque": opaque},
        {"source": "FromClaim", **own},
    ]


def test_taints_need_tolerations() -> None:
    tainted = gpu("gpu-0", taints=[{"key": "example.com/unhealthy", "value": "ecc",
                                    "effect": "NoSchedule"}])
    slices = [slice_([tainted])]
    assert not allocate([claim(exactly())], slices).ok
    toleration = {"key": "example.com/unhealthy", "operator": "Exists", "effect": "NoSchedule"}
    outcome = allocate([claim(exactly(tolerations=[toleration]))], slices)
    assert devices_of(outcome) == ["gpu-0"]
    assert outcome.allocations is not None
    assert outcome.allocations[0]["devices"]["results"][0]["tolerations"] == [toleration]



def test_a_none_taint_is_stored_and_reported_but_keeps_no_claim_off() -> None:
    """KEP-5055's `None` effect (a driver's informational health taint, as NVIDIA's DRA driver
    publishes non-critical XIDs): the API server accepts it, the allocator ignores it; an effect
    it does not know is refused with the API server's list."""
    from tessera.kube_sim.dra.slices import validate_slice

    noted = gpu("gpu-0", taints=[{"key": "example.com/xid", "value": "48", "effect": "None"}])
    assert validate_slice(slice_([noted])) == []
    assert devices_of(allocate([claim(exactly())], [slice_([noted])])) == ["gpu-0"]
    odd = gpu("gpu-0", taints=[{"key": "example.com/xid", "effect": "Sometimes"}])
    (error,) = validate_slice(slice_([odd]))
    assert (error.type, error.field) == ("NotSupported", "spec.devices[0].taints[0].effect")
    assert 'supported values: "NoExecute", "NoSchedule", "None"' in error.body()

def test_only_the_newest_pool_generation_and_reachable_slices_count() -> None:
    old = slice_([gpu("gpu-old")])
    new = slice_([gpu("gpu-new")])
    new["metadata"]["name"] = "newer"
    new["spec"]["pool"]["generation"] = 2
    elsewhere = slice_([gpu("gpu-b")], node="node-b")
    assert devices_of(allocate([claim(exactly())], [old, new, elsewhere])) == ["gpu-new"]
    everywhere = {"metadata": {"name": "net"}, "spec": {
        "driver": DRIVER, "allNodes": True,
        "pool": {"name": "fabric", "generation": 0, "resourceSliceCount": 1},
        "devices": [gpu("fabric-0")]}}
    outcome = allocate([claim(exactly())], [everywhere])
    assert devices_of(outcome) == ["fabric-0"]
    assert outcome.allocations is not None and "nodeSelector" not in outcome.allocations[0]


def test_a_missing_class_is_a_reason() -> None:
    outcome = allocate([claim(exactly(cls="nope"))], [slice_([gpu("gpu-0")])])
    assert not outcome.ok and 'device class "nope" not found' in outcome.reason


def test_an_extended_resource_maps_to_the_newest_class_then_the_first_name() -> None:
    from tessera.kube_sim.dra.scheduling import extended_resource_classes

    def device_class(name: str, created: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "creationTimestamp": created},
                "spec": {"extendedResourceName": "example.com/gpu"}}

    older = device_class("a", "2026-01-01T00:00:00Z")
    newer = device_class("z", "2026-02-01T00:00:00Z")
    mapping = extended_resource_classes([newer, older])
    assert mapping["example.com/gpu"] == "z"  # the class created later
    assert mapping["deviceclass.resource.kubernetes.io/a"] == "a"  # every class's implicit name
    tie = [device_class("b", "2026-03-01T00:00:00Z"), device_class("c", "2026-03-01T00:00:00Z")]
    assert extended_resource_classes(tie[::-1])["example.com/gpu"] == "b"


def test_admin_access_reaches_devices_others_hold_without_taking_them() -> None:
    slices = [slice_([gpu("gpu-0")])]
    held = {**claim(exactly(), uid="other"), "status": {"allocation": {"devices": {"results": [
        {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]}}}}
    outcome = allocate([claim(exactly(adminAccess=True))], slices, [held])
    assert devices_of(outcome) == ["gpu-0"]
    assert outcome.allocations is not None
    assert outcome.allocations[0]["devices"]["results"][0]["adminAccess"] is True
    monitor = {**claim(exactly(adminAccess=True), uid="m"),
               "status": {"allocation": outcome.allocations[0]}}
    assert devices_of(allocate([claim(exactly())], slices, [monitor])) == ["gpu-0"]


def test_toleration_seconds_defers_a_no_execute_eviction() -> None:
    from datetime import UTC, datetime, timedelta

    from tessera.kube_sim.dra.eviction import eviction_time

    now = datetime(2026, 12, 6, 12, 0, 0, tzinfo=UTC)
    taint = {"key": "k", "value": "v", "effect": "NoExecute", "timeAdded": "2026-12-06T11:59:50Z"}
    assert eviction_time(taint, [], now) == now  # untolerated: at once
    forever = {"key": "k", "operator": "Exists", "effect": "NoExecute"}
    assert eviction_time(taint, [forever], now) is None
    thirty = {**forever, "tolerationSeconds": 30}
    assert eviction_time(taint, [thirty], now) == now + timedelta(seconds=20)
    other = {"key": "x", "operator": "Exists"}
    assert eviction_time(taint, [other], now) == now


def test_selector_results_are_shared_only_by_devices_alike_in_what_they_read() -> None:
    """Selector results are cached per what of a device the expression reads: GPUs of one model
    on two nodes share `model` results but never `uuid` or a whole-map macro's."""
    assert cel.selector_reads(f'device.attributes["{DRIVER}"].model == "A100"') == (
        ("attributes", f"{DRIVER}/model"),)
    assert cel.selector_reads(f'device.attributes["{DRIVER}"].exists(k, k == "uuid")') is None
    for node, wanted in (("node-a", "gpu-1"), ("node-b", "gpu-0")):
        devices = [gpu(f"gpu-{i}", attributes={
            "model": {"string": "A100"}, "uuid": {"string": f"GPU-{node}-{i}"}})
            for i in range(2)]
        pools = pools_for_node([slice_(devices, node=node)], {"metadata": {"name": node}})
        uuid = f"GPU-{node}-{wanted[-1]}"
        for expression in (f'device.attributes["{DRIVER}"].uuid == "{uuid}"',
                           f'device.attributes["{DRIVER}"].exists(k, k == "uuid") && '
                           f'device.attributes["{DRIVER}"].uuid == "{uuid}"'):
            request = exactly(selectors=[{"cel": {"expression": expression}}])
            outcome = Allocator([claim(request)], pools, CLASSES, usage_of([], {}), node).run()
            [result] = outcome.results()[0]["devices"]["results"]
            assert result["device"] == wanted, (node, expression)
