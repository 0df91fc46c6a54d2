"""Ascend, Cambricon and Hygon as device kinds: requests read as HAMi's docs write them, fit per
device, what the container gets, and the node side over the simulated vendor libraries."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from tessera.device_kinds import AdmissionNotes, GrantContext, registry
from tessera.device_kinds.ascend import FAMILIES, KINDS
from tessera.device_kinds.ascend import annotations as asc_ann
from tessera.device_kinds.ascend.node import AscendNode
from tessera.device_kinds.ascend.templates import NO_TEMPLATE_COVERS
from tessera.device_kinds.cambricon import MLU, SMLU
from tessera.device_kinds.cambricon import annotations as mlu_ann
from tessera.device_kinds.cambricon.node import CambriconNode
from tessera.device_kinds.hygon import DCU, VDCU
from tessera.device_kinds.hygon import annotations as dcu_ann
from tessera.device_kinds.hygon.node import HygonNode
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.hami import RequestError
from tessera.models import DeviceGrant
from tessera.settings import TesseraSettings

SETTINGS = TesseraSettings()
B3, C910 = FAMILIES["ascend910b3"], FAMILIES["ascend910c"]


def container(limits: dict, name: str = "main") -> dict:
    return {"name": name, "resources": {"limits": dict(limits)}}


@dataclass
class View:
    """A device as the scheduler shows it to a kind."""

    uuid: str = "dev-0"
    index: int = 0
    type: str = "Ascend910B3"
    mode: str = "ascend910b3-vnpu"
    numa: int = 0
    healthy: bool = True
    cordoned: bool = False
    memory_mib: int = 65536
    cores: int = 20
    split_count: int = 4
    used_mem: int = 0
    used_cores: int = 0
    used_slots: int = 0

    def hold(self, take) -> None:
        self.used_mem += take.memory_mib
        self.used_cores += take.cores
        self.used_slots += 1


def test_every_vendors_resource_names_belong_to_its_family() -> None:
    for name, family in [("huawei.com/Ascend910B3", "ascend910b3"),
                         ("huawei.com/Ascend910B3-memory", "ascend910b3"),
                         ("huawei.com/Ascend310P", "ascend310p"),
                         ("huawei.com/Ascend910C", "ascend910c"),
                         ("cambricon.com/vmlu", "mlu"),
                         ("cambricon.com/mlu.smlu.vmemory", "mlu"),
                         ("cambricon.com/mlu.smlu.vcore", "mlu"),
                         ("hygon.com/dcunum", "dcu"), ("hygon.com/dcumem", "dcu"),
                         ("hygon.com/dcucores", "dcu"), ("nvidia.com/gpu", "nvidia")]:
        assert registry.family_for_resource(name, SETTINGS).name == family, name
    # configurable, as HAMi's resourceCountName/resourceMemoryName/resourceCoreName
    custom = TesseraSettings(device_resource_names={"dcu": {"count": "hygon.com/dcu"}})
    assert registry.family_for_resource("hygon.com/dcu", custom).name == "dcu"
    assert registry.family_for_resource("hygon.com/dcunum", custom) is None


def test_requests_as_hamis_docs_write_them() -> None:
    asc = registry.read_request(container({"huawei.com/Ascend910B3": 1,
                                           "huawei.com/Ascend910B3-memory": 2000}), SETTINGS)
    assert (asc.family, asc.count, asc.memory_mib, asc.memory_percentage) == (
        "ascend910b3", 1, 2000, None)
    mlu = registry.read_request(container({"cambricon.com/vmlu": 1,
                                           "cambricon.com/mlu.smlu.vmemory": 16,
                                           "cambricon.com/mlu.smlu.vcore": 50}), SETTINGS)
    assert (mlu.family, mlu.count, mlu.memory_mib, mlu.cores) == ("mlu", 1, 4096, 50)
    dcu = registry.read_request(container({"hygon.com/dcunum": 1, "hygon.com/dcumem": 2000,
                                           "hygon.com/dcucores": 60}), SETTINGS)
    assert (dcu.family, dcu.count, dcu.memory_mib, dcu.cores) == ("dcu", 1, 2000, 60)
    whole = registry.read_request(container({"cambricon.com/vmlu": 2}), SETTINGS)
    assert (whole.count, whole.memory_percentage, whole.cores) == (2, 100, 100)


@pytest.mark.parametrize(("limits", "words"), [
    ({"huawei.com/Ascend910B3": 2, "huawei.com/Ascend910B3-memory": 4000}, "one NPU per"),
    ({"huawei.com/Ascend910C": 3}, "modules of two"),
    ({"cambricon.com/vmlu": 2, "cambricon.com/mlu.smlu.vcore": 50}, "one MLU per container"),
    ({"cambricon.com/vmlu": 1, "cambricon.com/mlu.smlu.vcore": 150}, "at most 100"),
    ({"hygon.com/dcunum": 2, "hygon.com/dcumem": 1000}, "one DCU per container"),
    ({"hygon.com/dcunum": "1.5"}, "whole number"),
    ({"hygon.com/dcunum": 1, "cambricon.com/vmlu": 1}, "one family"),
])
def test_requests_no_vendor_can_serve_are_refused_with_a_sentence(limits, words) -> None:
    with pytest.raises(RequestError, match=words):
        registry.read_request(container(limits), SETTINGS)


def test_ascend_admission_rounds_up_as_hamis_webhook_does() -> None:
    c = container({"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 2000})
    notes = AdmissionNotes()
    request = B3.admit_container(c, "container main", SETTINGS, notes)
    assert c["resources"]["limits"]["huawei.com/Ascend910B3-memory"] == 16384
    assert "vir05_1c_16g" in notes.changes[0]
    assert request == B3.read_request(c, SETTINGS)  # admitting twice changes nothing more
    assert B3.admit_container(c, "container main", SETTINGS, AdmissionNotes()) == request

    c = container({"huawei.com/Ascend910C": 1})
    notes = AdmissionNotes()
    request = C910.admit_container(c, "container main", SETTINGS, notes)
    assert c["resources"]["limits"]["huawei.com/Ascend910C"] == 2
    assert request.count == 1  # one module of two dies

    c = container({"huawei.com/Ascend910B3": 1, "huawei.com/Ascend910B3-memory": 90000})
    notes = AdmissionNotes()
    B3.admit_container(c, "container main", SETTINGS, notes)
    assert "will pend" in notes.warnings[0]

    with pytest.raises(RequestError, match="hami-core"):
        B3.selection({asc_ann.VNPU_MODE: "hami-core"})
    chosen = B3.selection({"hami.io/use-Ascend910B3-uuid": "a,b"})
    assert chosen.use_uuids == {"a", "b"}


def test_ascend_chips_fill_template_by_template_and_never_overlap() -> None:
    kind = KINDS["ascend910b3"]
    chip = View()
    small = registry.read_request(container({"huawei.com/Ascend910B3": 1,
                                             "huawei.com/Ascend910B3-memory": 1000}), SETTINGS)
    big = registry.read_request(container({"huawei.com/Ascend910B3": 1,
                                           "huawei.com/Ascend910B3-memory": 20000}), SETTINGS)
    whole = registry.read_request(container({"huawei.com/Ascend910B3": 1}), SETTINGS)
    assert kind.take(chip, small).partition == "vir05_1c_16g"
    chip.hold(kind.take(chip, big))
    assert kind.refusal(chip, whole) == "ExclusiveDeviceAllocateConflict"
    chip.hold(kind.take(chip, small))
    chip.hold(kind.take(chip, small))  # 10 + 5 + 5 = 20 AI cores: the chip is cut up
    assert kind.refusal(chip, small) == "CardInsufficientMemory"
    huge = registry.read_request(container({"huawei.com/Ascend910B3": 1,
                                            "huawei.com/Ascend910B3-memory": 70000}), SETTINGS)
    assert kind.refusal(View(), huge) == NO_TEMPLATE_COVERS
    assert "no vNPU template of Ascend910B3 covers 70000" in kind.explain(View(), huge)


def test_what_each_vendors_container_gets() -> None:
    asc_dev = FAMILIES["ascend910b3"]
    node = AscendNode(asc_dev)
    devices = node.advertise(node_devices(node, "Ascend910B3", 2), NodeDeviceConfig())
    ctx = GrantContext({d.uuid: d for d in devices}, SETTINGS)
    grant = DeviceGrant(uuid=devices[1].uuid, type="Ascend910B3", memory_mib=16384, cores=5)
    edits = KINDS["ascend910b3"].container_edits([grant], ctx)
    assert edits.env == {"ASCEND_VISIBLE_DEVICES": "1", "ASCEND_VNPU_SPECS": "vir05_1c_16g"}
    info = json.loads(edits.annotations["huawei.com/Ascend910B3"])
    assert info == [{"UUID": devices[1].uuid, "temp": "vir05_1c_16g"}]
    whole = [DeviceGrant(uuid=d.uuid, type="Ascend910B3", memory_mib=65536, cores=20)
             for d in devices]
    assert KINDS["ascend910b3"].container_edits(whole, ctx).env == {
        "ASCEND_VISIBLE_DEVICES": "0,1"}


def node_devices(node, model: str, count: int, tmp: str = ""):
    settings = TesseraSettings(device_source="static", static_gpu_count=count,
                               static_gpu_model=model, region_host_dir=tmp)
    return node.backend(settings, "n1").discover()


def test_ascend_node_discovers_npus_and_910c_modules(tmp_path) -> None:
    node = AscendNode(B3)
    found = node_devices(node, "Ascend910B3", 8, str(tmp_path))
    devices = node.advertise(found, NodeDeviceConfig())
    assert [d.index for d in devices] == list(range(8))
    assert {(d.type, d.memory_mib, d.cores, d.mode) for d in devices} == {
        ("Ascend910B3", 65536, 20, "ascend910b3-vnpu")}  # the chip's own memory and AI cores
    register = asc_ann.decode_register(B3.encode_register(devices))
    assert [r.network for r in register] == [0, 0, 0, 0, 1, 1, 1, 1]

    module = AscendNode(C910)
    modules = module.advertise(node_devices(module, "Ascend910C", 4, str(tmp_path)),
                               NodeDeviceConfig())
    assert [(d.index, d.memory_mib, d.cores) for d in modules] == [(0, 131072, 40),
                                                                    (1, 131072, 40)]
    assert len(asc_ann.decode_register(C910.encode_register(modules))) == 4  # dies
    grant = DeviceGrant(uuid=modules[1].uuid, type="Ascend910C", memory_mib=131072, cores=40)
    edits = KINDS["ascend910c"].container_edits([grant], GrantContext(
        {d.uuid: d for d in modules}, SETTINGS))
    assert edits.env == {"ASCEND_VISIBLE_DEVICES": "2,3"}


def test_ascend_health_follows_dcmi(tmp_path) -> None:
    faults = tmp_path / "faults"
    settings = TesseraSettings(device_source="static", static_gpu_count=2,
                               static_gpu_model="Ascend910B3", region_host_dir=str(tmp_path),
                               static_fault_file=str(faults))
    backend = AscendNode(B3).backend(settings, "n1")
    uuid1 = backend.discover()[1].uuid
    faults.write_text("1 3\n")
    change = backend.wait_health(2.0)
    assert change is not None and change.uuid == uuid1 and not change.healthy
    assert [d.healthy for d in backend.discover()] == [True, False]
    with faults.open("a") as f:
        f.write("1 0\n")
    assert backend.wait_health(2.0).healthy
    backend.dcmi.set_usage(0, 4096, 37)
    used, total, util = backend.usage()[backend.discover()[0].uuid]
    assert (used, total, util) == (4096 << 20, 65536 << 20, 37.0)


def test_mlu_share_gets_its_smlu_and_loses_it_on_release(tmp_path) -> None:
    node = CambriconNode()
    settings = TesseraSettings(device_source="static", static_gpu_count=2,
                               static_gpu_model="MLU370-X4", static_gpu_memory_mib=24576,
                               region_host_dir=str(tmp_path))
    backend = node.backend(settings, "n1")
    devices = {d.uuid: d for d in node.advertise(backend.discover(), NodeDeviceConfig())}
    dev = next(d for d in devices.values() if d.index == 1)
    assert (dev.type, dev.mode, dev.memory_mib, dev.cores) == ("MLU370-X4", "smlu", 24576, 100)
    grant = DeviceGrant(uuid=dev.uuid, type=dev.type, memory_mib=4096, cores=50)
    edits = SMLU.container_edits([grant], GrantContext(devices, SETTINGS))
    assert [d.container_path for d in edits.devices] == [
        "/dev/cambricon_ctl", "/dev/cambricon_dev1", "/dev/cambricon_ipcm1"]
    assert edits.annotations[mlu_ann.DSMLU_PROFILE] == "1_50_16"
    made = node.node_edits([grant], devices, owner="uid-1/main")
    assert made.devices[0].container_path == "/dev/cambricon-caps/cap_dev1_mi1"
    again = node.node_edits([grant], devices, owner="uid-1/main")  # kubelet asks twice
    assert again.devices == made.devices and len(backend.cndev.smlu_infos()) == 1
    other = node.node_edits([DeviceGrant(uuid=dev.uuid, type=dev.type, memory_mib=4096,
                                         cores=50)], devices, owner="uid-2/main")
    assert other.devices[0].container_path == "/dev/cambricon-caps/cap_dev1_mi2"
    with pytest.raises(RuntimeError, match="refused"):  # the driver never gives > 100 %
        node.node_edits([DeviceGrant(uuid=dev.uuid, type=dev.type, memory_mib=256,
                                     cores=10)], devices, owner="uid-3/main")
    node.release("uid-1")
    assert [i.holder.partition("@")[0] for i in backend.cndev.smlu_infos()] == ["uid-2/main"]
    node.reconcile([])
    assert backend.cndev.smlu_infos() == []


def test_dcu_vdcu_gets_its_config_file(tmp_path) -> None:
    node = HygonNode()
    settings = TesseraSettings(device_source="static", static_gpu_count=2,
                               static_gpu_model="Z100L", static_gpu_memory_mib=32768,
                               region_host_dir=str(tmp_path))
    backend = node.backend(settings, "n1")
    devices = {d.uuid: d for d in node.advertise(backend.discover(), NodeDeviceConfig())}
    dev = next(d for d in devices.values() if d.index == 0)
    assert (dev.type, dev.mode) == ("DCU-Z100L", "vdcu")
    grant = DeviceGrant(uuid=dev.uuid, type=dev.type, memory_mib=2000, cores=60)
    edits = VDCU.container_edits([grant], GrantContext(devices, SETTINGS))
    assert [d.container_path for d in edits.devices] == [
        "/dev/kfd", "/dev/mkfd", "/dev/dri/card0", "/dev/dri/renderD128"]
    made = node.node_edits([grant], devices, owner="uid-1/main")
    vdev_dir = made.mounts[0].host_path
    assert made.mounts[0].container_path == "/etc/vdev/docker/"
    (conf_file,) = list(__import__("pathlib").Path(vdev_dir).iterdir())
    conf = dcu_ann.VdevConfig.parse(conf_file.read_text())
    assert (conf.cu_count, conf.memory_mib, conf.device_id) == (36, 2000, 0)  # 60 % of 60 CUs
    second = node.node_edits([DeviceGrant(uuid=dev.uuid, type=dev.type, memory_mib=2000,
                                          cores=40)], devices, owner="uid-2/main")
    other = dcu_ann.VdevConfig.parse(next(__import__("pathlib").Path(
        second.mounts[0].host_path).iterdir()).read_text())
    assert other.cu_mask & conf.cu_mask == 0 and other.cu_count == 24  # never a CU twice
    with pytest.raises(RuntimeError, match="fewer are free"):
        node.node_edits([DeviceGrant(uuid=dev.uuid, type=dev.type, memory_mib=100, cores=10)],
                        devices, owner="uid-3/main")
    node.release("uid-1")
    assert len(backend.smi.vdevs()) == 1
    register = dcu_ann.decode_register(DCU.encode_register(list(devices.values())))
    assert [r.type for r in register] == ["DCU-Z100L", "DCU-Z100L"]


def test_mlu_and_dcu_fit_is_hamis_generic_one() -> None:
    mlu = View(type="MLU370-X4", mode="smlu", memory_mib=24576, cores=100, split_count=10)
    share = registry.read_request(container({"cambricon.com/vmlu": 1,
                                             "cambricon.com/mlu.smlu.vmemory": 16,
                                             "cambricon.com/mlu.smlu.vcore": 50}), SETTINGS)
    mlu.hold(SMLU.take(mlu, share))
    mlu.hold(SMLU.take(mlu, share))
    assert SMLU.refusal(mlu, share) == "CardInsufficientCore"
    dcu = View(type="DCU-Z100L", mode="vdcu", memory_mib=32768, cores=100, split_count=10)
    big = registry.read_request(container({"hygon.com/dcunum": 1,
                                           "hygon.com/dcumem": 30000}), SETTINGS)
    dcu.hold(VDCU.take(dcu, big))
    assert VDCU.refusal(dcu, big) == "CardInsufficientMemory"
    assert MLU.selection({"cambricon.com/use-mlutype": "MLU590"}).type_refusal(mlu) == \
        "CardTypeMismatch"
    assert DCU.selection({"hygon.com/nouse-gpuuuid": "dev-0"}).uuid_refusal(dcu) == \
        "CardUuidMismatch"


def test_an_ascend_chip_is_never_overcommitted_whatever_the_nodes_scaling() -> None:
    kind = KINDS["ascend910b3"]
    scaled = View(memory_mib=131072, cores=40)  # a node configured with scaling 2
    big = registry.read_request(container({"huawei.com/Ascend910B3": 1,
                                           "huawei.com/Ascend910B3-memory": 20000}), SETTINGS)
    scaled.hold(kind.take(scaled, big))
    scaled.hold(kind.take(scaled, big))
    assert kind.refusal(scaled, big) == "CardInsufficientMemory"  # the chip's 64 GiB are cut


@pytest.mark.parametrize(("node_side", "model"), [
    (CambriconNode(), "MLU370-X4"), (HygonNode(), "Z100L")])
def test_a_fault_on_every_card_reports_every_card(tmp_path, node_side, model) -> None:
    """A fault line for every device (`-1`) turns each one unhealthy: the health monitor hears
    of each (one wait each), none dropped because one poll found them together."""
    faults = tmp_path / "faults"
    settings = TesseraSettings(device_source="static", static_gpu_count=2, static_gpu_model=model,
                               static_gpu_memory_mib=24576, region_host_dir=str(tmp_path),
                               static_fault_file=str(faults))
    backend = node_side.backend(settings, "n1")
    faults.write_text("-1 0\n")
    changes = [backend.wait_health(2.0), backend.wait_health(2.0)]
    assert all(c is not None and not c.healthy for c in changes)
    assert {c.uuid for c in changes} == {d.uuid for d in backend.discover()}
    assert backend.wait_health(0.1) is None
