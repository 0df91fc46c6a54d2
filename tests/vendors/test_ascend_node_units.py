"""The node agent's side of Ascend devices: what a chip advertises (HAMi's vNPU count, a 910C
module whole) and how kubelet's device IDs map onto a 910C module (two NPUs to kubelet, one
device here), through the node agent's own advertising and ID mapping."""

from __future__ import annotations

import pytest
from tessera.node_agent.device_units import DeviceUnits
from tessera.node_agent.devices import advertise
from tessera.node_agent.family_source import FamilySource
from tessera.node_agent.handshake import HandshakeError

from tessera.device_kinds import registry
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.settings import TesseraSettings


def node_devices(model: str, count: int, tmp: str):
    settings = TesseraSettings(device_source="static", static_gpu_count=count,
                               static_gpu_model=model, region_host_dir=tmp,
                               device_family=f"ascend{model.removeprefix('Ascend').lower()}")
    source = FamilySource.of(settings, "n")
    return advertise(source.discover(), settings)


def test_a_chip_advertises_hamis_vnpu_count_not_the_nvidia_split(tmp_path) -> None:
    b3 = node_devices("Ascend910B3", 2, str(tmp_path))
    # memoryAllocatable 65536 over the smallest template (vir05_1c_16g, 16384): 4 vNPUs
    assert [(d.split_count, d.memory_mib, d.cores) for d in b3] == [(4, 65536, 20)] * 2
    b2 = node_devices("Ascend910B2", 1, str(tmp_path))
    assert [d.split_count for d in b2] == [8]  # 65536 / vir03_1c_8g's 8192
    c = node_devices("Ascend910C", 4, str(tmp_path))  # four dies: two modules, given whole
    assert [(d.split_count, d.memory_mib) for d in c] == [(1, 131072)] * 2


def test_910c_modules_are_two_of_kubelets_ids_each(tmp_path) -> None:
    [module, _] = node_devices("Ascend910C", 4, str(tmp_path))
    units = DeviceUnits(registry.family("ascend910c").ids_per_device)
    listed = units.listed(module.uuid, module.split_count)
    assert listed == [f"{module.uuid}-0", f"{module.uuid}-1"]
    assert units.collapse(listed) == [f"{module.uuid}-0"]
    assert units.expand([f"{module.uuid}-0"]) == listed
    assert units.size(2) == 1
    with pytest.raises(HandshakeError, match="split a device"):
        units.collapse(listed[:1])  # half a module
    with pytest.raises(HandshakeError, match="multiple of 2"):
        units.size(3)
    # what kubelet still offers: only whole modules count
    assert units.whole([listed[1], "other-0"]) == []
    assert units.whole(listed) == [f"{module.uuid}-0"]


def test_one_id_per_device_changes_nothing() -> None:
    units = DeviceUnits(registry.family("nvidia").ids_per_device)
    ids = ["GPU-a-3", "GPU-b-0"]
    assert units.collapse(ids) == ids and units.expand(ids) == ids and units.size(2) == 2
    assert units.listed("GPU-a", 3) == ["GPU-a-0", "GPU-a-1", "GPU-a-2"]


def test_hamis_handshake_annotations_for_the_families_present(tmp_path) -> None:
    """`hami.io/node-handshake-<chip>` / `-dcu` = `Reported_<time>` (HAMi's protocol), only
    for families with devices on the node and one of their own (none for NVIDIA here)."""
    from tessera.device_kinds.hygon.node import HygonNode
    from tessera.models import DeviceInfo

    npus = node_devices("Ascend910B3", 1, str(tmp_path))
    settings = TesseraSettings(device_source="static", static_gpu_count=1,
                               static_gpu_model="Z100L", static_gpu_memory_mib=32768,
                               region_host_dir=str(tmp_path))
    node = HygonNode()
    dcus = node.advertise(node.backend(settings, "n").discover(), NodeDeviceConfig())
    gpu = DeviceInfo(uuid="GPU-0", index=0, type="NVIDIA-A10", memory_mib=24576)
    now = 1_700_000_000.0
    written = registry.handshake_annotations([*npus, *dcus, gpu], now)
    assert set(written) == {"hami.io/node-handshake-Ascend910B3", "hami.io/node-handshake-dcu"}
    assert all(v.startswith("Reported_") and len(v) == len("Reported_2006.01.02 15:04:05")
               for v in written.values())
    assert registry.handshake_annotations([gpu], now) == {}
