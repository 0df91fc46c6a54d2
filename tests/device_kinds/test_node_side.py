"""A family's node side (tessera.device_kinds.node) through the node agent's device pipeline:
its backend's devices are discovered, advertised with the family's type and mode (so its kind),
scaled like NVIDIA's, and registered under the family's own node annotation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from tessera.node_agent.devices import DeviceConfig, advertise, source_from_settings
from tessera.node_agent.family_source import FamilySource

from tessera import hami
from tessera.device_kinds import registry
from tessera.device_kinds.node import HealthChange, NodeDeviceConfig, NodeFamily, PhysicalDevice
from tessera.settings import TesseraSettings

from .test_services_through_kinds import NPU, TEMPLATED


class FakeNpuBackend:
    """Two NPUs, the second failing once asked for health (a fake, as the fake NVML is)."""

    def __init__(self) -> None:
        self.closed = False

    def discover(self) -> list[PhysicalDevice]:
        return [PhysicalDevice(f"NPU-{i}", i, "Npu910", 32768, cores=20, numa=i)
                for i in range(2)]  # fmt: skip

    def wait_health(self, timeout_s: float) -> HealthChange | None:
        return HealthChange("NPU-1", False, "chip lost")

    def usage(self) -> dict[str, tuple[int, int, float]]:
        return {"NPU-0": (1 << 30, 32 << 30, 12.5)}

    def close(self) -> None:
        self.closed = True


class NpuNode(NodeFamily):
    family = NPU

    def backend(self, settings: TesseraSettings, node: str) -> FakeNpuBackend:
        return FakeNpuBackend()

    def device_type(self, device: PhysicalDevice) -> str:
        return f"TestNPU-{device.model}"

    def default_mode(self, device: PhysicalDevice) -> str:
        return "test-npu"


@pytest.fixture(autouse=True)
def npu_node() -> Iterator[None]:
    registry.register(NPU, TEMPLATED)
    registry.register_node(NpuNode())
    yield
    registry.unregister(NPU.name)


def test_the_node_agent_reads_a_familys_devices_through_its_backend():
    settings = TesseraSettings(device_family="test-npu")
    source = source_from_settings(settings, "n1")
    assert isinstance(source, FamilySource)
    found = source.discover()
    devices = advertise(found, settings, config=DeviceConfig(split_count=4, core_scaling=2.0))
    assert [(d.uuid, d.type, d.mode, d.cores, d.split_count) for d in devices] == [
        ("NPU-0", "TestNPU-Npu910", "test-npu", 40, 4),
        ("NPU-1", "TestNPU-Npu910", "test-npu", 40, 4),
    ]
    assert registry.kind_of(devices[0]) is TEMPLATED
    event = source.wait_event(0.1)
    assert event is not None and event.uuid == "NPU-1"
    assert source.host_usage()["NPU-0"][2] == 12.5
    source.close()
    assert source.backend.closed


def test_an_unknown_family_is_refused_at_start_with_a_sentence():
    with pytest.raises(ValueError, match="no device family"):
        source_from_settings(TesseraSettings(device_family="nope"), "n1")


def test_each_family_registers_under_its_own_node_annotation():
    node = NpuNode()
    npus = node.advertise(FakeNpuBackend().discover(), NodeDeviceConfig(split_count=2))
    annotations = registry.register_annotations(npus)
    assert annotations[hami.ANN_NODE_REGISTER] == "[]"
    assert '"id":"NPU-0"' in annotations["hami.io/node-test-npu-register"]
