"""The device-kind interface and NVIDIA's three kinds behind it (tessera/device_kinds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tessera import mig
from tessera.device_kinds import ResourceNames, Selection, registry
from tessera.device_kinds.base import GrantContext
from tessera.device_kinds.nvidia import MIG, MPS, NVIDIA, SLICES
from tessera.hami import ContainerRequest, RequestError
from tessera.models import DeviceGrant, DeviceInfo, MigInstanceGrant
from tessera.settings import TesseraSettings


@dataclass
class Device:
    uuid: str = "GPU-0"
    index: int = 0
    type: str = "NVIDIA-A100-SXM4-80GB"
    mode: str = "hami-core"
    numa: int = 0
    healthy: bool = True
    cordoned: bool = False
    memory_mib: int = 80_000
    cores: int = 100
    split_count: int = 10
    used_mem: int = 0
    used_cores: int = 0
    used_slots: int = 0
    mig_model: str = ""
    mig_geometries: tuple = ()
    mig_instances: list = field(default_factory=list)
    libvgpu_slices: int = 0


def request(count=1, memory=1000, cores=0, pct=None) -> ContainerRequest:
    return ContainerRequest(count, memory, pct, cores)


def test_resource_names_map_to_their_family_and_devices_to_their_kind():
    settings = TesseraSettings()
    assert registry.family_for_resource("nvidia.com/gpumem", settings) is NVIDIA
    assert registry.family_for_resource("example.com/npu", settings) is None
    assert registry.kind_for_mode("hami-core") is SLICES
    assert registry.kind_for_mode("mig") is MIG
    assert registry.kind_for_mode("mps") is MPS
    assert registry.family_of_mode("mps") == "nvidia"
    assert registry.kind_for_mode("no-such-mode") is None


def test_renamed_nvidia_resources_are_read_under_their_new_names():
    settings = TesseraSettings(resource_name="example.com/vgpu", resource_mem="example.com/vmem")
    container = {"name": "c", "resources": {"limits": {"example.com/vgpu": 2,
                                                       "example.com/vmem": "3000"}}}
    assert registry.read_request(container, settings) == ContainerRequest(2, 3000, None, 0)
    assert registry.read_request({"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}},
                                 settings) is None


def test_configured_names_override_defaults_and_unknown_keys_are_refused():
    names = ResourceNames("huawei.com/Ascend910B3", "huawei.com/Ascend910B3-memory")
    assert names.configured({"memory": "example.com/mem"}).memory == "example.com/mem"
    assert names.configured(None) is names
    with pytest.raises(ValueError, match="unknown resource name"):
        names.configured({"mem": "x"})


def test_a_container_naming_two_families_is_refused_with_a_sentence():
    class Other(type(NVIDIA)):
        name = "other-test"

        def default_names(self, settings):
            return ResourceNames("example.com/other")

        def resource_names(self, settings):
            return self.default_names(settings)

    other = Other()
    registry.register(other)
    try:
        container = {"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1,
                                                           "example.com/other": 1}}}
        with pytest.raises(RequestError, match="one family"):
            registry.read_request(container, TesseraSettings())
    finally:
        registry.unregister("other-test")


def test_selection_annotations_refuse_devices_by_type_uuid_and_mode():
    selection = NVIDIA.selection({"nvidia.com/use-gputype": "H100",
                                  "nvidia.com/nouse-gpuuuid": "GPU-9"})
    assert SLICES.refusal(Device(), request(), selection) == "CardTypeMismatch"
    assert SLICES.refusal(Device(type="NVIDIA-H100", uuid="GPU-9"), request(),
                          selection) == "CardUuidMismatch"
    assert SLICES.refusal(Device(type="NVIDIA-H100"), request(), selection) is None
    mps_only = Selection(modes="mps")
    assert SLICES.refusal(Device(), request(), mps_only) == "CardTypeMismatch"
    assert MPS.refusal(Device(mode="mps"), request(), mps_only) is None


@pytest.mark.parametrize(("device", "asked", "reason"), [
    (Device(healthy=False), request(), "CardNotHealth"),
    (Device(cordoned=True), request(), "CardCordoned"),
    (Device(used_slots=10), request(), "CardTimeSlicingExhausted"),
    (Device(used_mem=79_500), request(), "CardInsufficientMemory"),
    (Device(used_cores=90), request(cores=20), "CardInsufficientCore"),
    (Device(used_slots=1), request(cores=100), "ExclusiveDeviceAllocateConflict"),
    (Device(used_cores=100, used_slots=1), request(cores=0), "CardComputeUnitsExhausted"),
    (Device(), request(pct=50), None),
])  # fmt: skip
def test_slices_refuse_with_hamis_reasons(device, asked, reason):
    assert SLICES.refusal(device, asked) == reason


def test_mps_takes_one_card_per_container():
    assert MPS.refusal(Device(mode="mps"), request(count=2)) == "CardTypeMismatch"
    assert MPS.refusal(Device(mode="mps"), request(count=1)) is None


def test_mig_charges_the_covering_profile_and_refuses_static_cards():
    card = Device(mode="mig", mig_model="A100-SXM4-80GB")
    take = MIG.take(card, request(memory=15_000, cores=10))
    assert take.partition == "1g.20gb"  # the smallest profile covering both
    assert take.memory_mib >= 15_000
    assert MIG.refusal(Device(mode="mig"), request()) == "CardMigTopologyInfeasible"
    busy = Device(mode="mig", mig_model="A100-SXM4-80GB",
                  mig_instances=[mig.Instance("1g.10gb", 0)])
    # a pod asking hami-core gets a slice only on an empty card
    assert MIG.refusal(busy, request(), Selection(modes="hami-core")) == "CardMigTopologyInfeasible"


def test_container_edits_say_what_the_vendor_runtime_reads():
    settings = TesseraSettings()
    devices = {"GPU-0": DeviceInfo(uuid="GPU-0", index=0, type="NVIDIA-A100", memory_mib=80_000,
                                   mode="mps")}
    ctx = GrantContext(devices, settings, priority=0)
    grants = [DeviceGrant(uuid="GPU-0", type="NVIDIA-A100", memory_mib=2000, cores=30)]
    env = SLICES.container_edits(grants, ctx).env
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "2000m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert env["CUDA_TASK_PRIORITY"] == "0"
    mps_env = MPS.container_edits(grants, ctx).env
    assert mps_env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/tessera/mps"
    assert mps_env["CUDA_DEVICE_SM_LIMIT_0"] == "100"
    instance = MigInstanceGrant(profile="1g.10gb", start=0, size=1, mig_uuid="MIG-abc")
    mig_env = MIG.container_edits([grants[0].model_copy(update={"mig": instance})], ctx).env
    assert mig_env["NVIDIA_VISIBLE_DEVICES"] == "MIG-abc"
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in mig_env


def test_metric_labels_name_the_vendor_and_kind():
    device = DeviceInfo(uuid="GPU-0", index=3, type="NVIDIA-H200", memory_mib=1, mode="mig")
    labels = registry.kind_of(device).metric_labels(device)
    assert labels == {"deviceuuid": "GPU-0", "deviceidx": "3", "devicetype": "NVIDIA-H200",
                      "vendor": "NVIDIA", "kind": "nvidia.mig"}


def test_the_kinds_container_paths_are_where_the_node_agent_mounts():
    from tessera.node_agent import containers, mps

    from tessera.device_kinds.nvidia import mps as mps_kind
    from tessera.device_kinds.nvidia import slices

    assert slices.REGION_CONTAINER_PATH == containers.REGION_CONTAINER_PATH
    assert mps_kind.PIPE_CONTAINER_DIR == mps.PIPE_CONTAINER_DIR
