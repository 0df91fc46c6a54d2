"""The services ask the device kind: a family registered beside NVIDIA (a test family with
templates, as a vendor folder would register one) is admitted, placed only on its own devices
(rounded up to its smallest covering template), never charged to the NVIDIA quota; NVIDIA pods
never land on its devices. The family is test-only: the real vendors are their own folders."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
from tessera.admission import rules as admission
from tessera.scheduler.cards import build_cards
from tessera.scheduler.decide import decide
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.node_names import NodeNames
from tessera.scheduler.placement import fit_pod
from tessera.scheduler.quota_client import grants_charge
from tessera.scheduler.rules import FitContext, QuotaBudget, parse_pod_options

from tessera import hami
from tessera.device_kinds import (
    ContainerEdits,
    DeviceFamily,
    DeviceKind,
    GrantContext,
    ResourceNames,
    Selection,
    Take,
    registry,
)
from tessera.device_kinds.base import NO_SELECTION
from tessera.hami import ContainerRequest, RequestError
from tessera.models import DeviceGrant, DeviceInfo, NodeLedger, NodeRegistration
from tessera.settings import TesseraSettings

TEMPLATES = (4096, 8192, 16384)  # MiB, smallest first


class NpuFamily(DeviceFamily):
    name = "test-npu"
    vendor = "Example"
    register_annotation = "hami.io/node-test-npu-register"
    to_allocate_annotation = "hami.io/test-npu-devices-to-allocate"
    allocated_annotation = "hami.io/test-npu-devices-allocated"
    type_prefixes = ("TestNPU",)

    def default_names(self, settings: TesseraSettings) -> ResourceNames:
        return ResourceNames("example.com/npu", memory="example.com/npu-memory")

    def read_request(self, container: Mapping[str, Any], settings: TesseraSettings
                     ) -> ContainerRequest | None:
        names = self.resource_names(settings)
        limits = (container.get("resources") or {}).get("limits") or {}
        if names.count not in limits and names.memory not in limits:
            return None
        count = int(limits.get(names.count, 1))
        memory = int(limits.get(names.memory, 0))
        if memory > TEMPLATES[-1]:
            raise RequestError(f"{names.memory}: {memory} MiB is more than any template")
        return ContainerRequest(count, memory, None if memory else 100, 0, family=self.name)

    def admit_container(self, container, label, settings, notes):
        request = self.read_request(container, settings)
        if request is not None and request.memory_mib == 0:
            notes.warnings.append(f"container {label}: no memory asked: a whole NPU")
        return request


NPU = NpuFamily()


class NpuTemplates(DeviceKind):
    name = "test-npu.template"
    family = NPU
    modes = ("test-npu",)

    def take(self, device, request, selection: Selection = NO_SELECTION) -> Take:
        wanted = request.memory_on(device.memory_mib)
        template = next((t for t in TEMPLATES if t >= wanted), device.memory_mib)
        return Take(template, 0, f"vir{template // 1024:02d}")

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        return ContainerEdits(env={"TEST_NPU_VISIBLE": ",".join(g.uuid for g in grants)})


TEMPLATED = NpuTemplates()
SETTINGS = TesseraSettings()


@pytest.fixture(autouse=True)
def npu_family() -> Iterator[None]:
    registry.register(NPU, TEMPLATED)
    yield
    registry.unregister(NPU.name)


def npu(uuid: str, memory: int = 16384, used: int = 0) -> DeviceInfo:
    return DeviceInfo(uuid=uuid, index=0, type="TestNPU-1", memory_mib=memory, cores=100,
                      mode="test-npu")


def gpu(uuid: str) -> DeviceInfo:
    return DeviceInfo(uuid=uuid, index=0, type="NVIDIA-H100", memory_mib=81920)


def pod_of(limits: dict[str, Any], uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "default", "uid": uid, "annotations": {}},
            "spec": {"containers": [{"name": "main", "image": "x",
                                     "resources": {"limits": limits}}]}}


def fit(devices: list[DeviceInfo], spec: dict[str, Any]):
    cards = build_cards(NodeRegistration(node="n", devices=devices), [], 0.0)
    return fit_pod(cards, hami.parse_pod_request(spec, SETTINGS),
                   FitContext(parse_pod_options(spec, SETTINGS)))


def test_a_request_is_rounded_up_to_the_smallest_covering_template_on_its_own_family():
    placed = fit([gpu("GPU-a"), npu("NPU-a")], pod_of({"example.com/npu": 1,
                                                        "example.com/npu-memory": 3000}))
    assert placed.ok
    [[grant]] = placed.containers
    assert (grant.uuid, grant.memory_mib) == ("NPU-a", 4096)


def test_no_request_lands_on_another_familys_device():
    nvidia_only = fit([npu("NPU-a")], pod_of({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}))
    assert not nvidia_only.ok
    assert nvidia_only.reason_text() == "1/1 CardTypeMismatch"
    npu_only = fit([gpu("GPU-a")], pod_of({"example.com/npu": 1}))
    assert npu_only.reason_text() == "1/1 CardTypeMismatch"


def test_a_full_device_is_refused_by_the_kinds_own_fit():
    ledger_full = build_cards(NodeRegistration(node="n", devices=[npu("NPU-a", memory=8192)]),
                              [], 0.0)
    ledger_full[0].used_mem = 6000
    spec = pod_of({"example.com/npu": 1, "example.com/npu-memory": 1000})
    placed = fit_pod(ledger_full, hami.parse_pod_request(spec, SETTINGS),
                     FitContext(parse_pod_options(spec, SETTINGS)))
    assert placed.reason_text() == "1/1 CardInsufficientMemory"  # 4096 does not fit in 2192


def test_the_decision_over_a_mixed_cluster_places_each_family_on_its_nodes():
    index = ClusterIndex()
    for name, devices in (("gpu-node", [gpu("GPU-a")]), ("npu-node", [npu("NPU-a")])):
        index.set_registration(name, NodeRegistration(node=name, devices=devices), 0.0)
        index.set_ledger(name, NodeLedger(node=name), 1, 0.0)
    for limits, node in (({"example.com/npu": 1, "example.com/npu-memory": 5000}, "npu-node"),
                         ({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 5000}, "gpu-node")):
        spec = pod_of(limits)
        decision = decide(index, hami.parse_pod_request(spec, SETTINGS),
                          parse_pod_options(spec, SETTINGS), NodeNames(["gpu-node", "npu-node"]))
        assert [entry.name for entry, _ in decision.fits()] == [node]


def test_admission_reads_the_family_and_charges_no_nvidia_quota():
    decision = admission.decide(pod_of({"example.com/npu": 1}), "default", SETTINGS)
    assert isinstance(decision, admission.Admitted)
    assert decision.warnings == ("container main: no memory asked: a whole NPU",)
    assert decision.quota is not None and (decision.quota.memory_mib, decision.quota.gpus) == (
        0, 0)
    mixed = pod_of({"example.com/npu": 1, "nvidia.com/gpu": 1})
    denied = admission.decide(mixed, "default", SETTINGS)
    assert isinstance(denied, admission.Denial) and "one family" in denied.message
    too_big = admission.decide(pod_of({"example.com/npu-memory": 99999}), "default", SETTINGS)
    assert isinstance(too_big, admission.Denial) and "more than any template" in too_big.message


def test_quota_counts_only_families_that_count_in_it():
    grants = [[DeviceGrant(uuid="NPU-a", type="TestNPU-1", memory_mib=4096, cores=0),
               DeviceGrant(uuid="GPU-a", type="NVIDIA-H100", memory_mib=1000, cores=10)]]
    assert grants_charge(grants, 0) == (1000, 10, 1)
    assert hami.grants_quota_charge(grants, 0) == (1000, 10, 1)
    # and the scheduler's quota check never refuses a request the quota does not count
    spec = pod_of({"example.com/npu": 1, "example.com/npu-memory": 4000})
    cards = build_cards(NodeRegistration(node="n", devices=[npu("NPU-a")]), [], 0.0)
    placed = fit_pod(cards, hami.parse_pod_request(spec, SETTINGS),
                     FitContext(parse_pod_options(spec, SETTINGS), QuotaBudget(0, 0)))
    assert placed.ok
