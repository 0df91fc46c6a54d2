"""NVIDIA's node side is a NodeFamily like the other vendors' (tessera.device_kinds.nvidia.node):
the node agent's source for an NVIDIA node is the family's backend read through FamilySource,
and its registration is the family's `advertise`: `NVIDIA-<name>` types, `hami-core` or `mig`
by the GPU's MIG mode, dynamic MIG geometries, XID faults from the simulated GPUs."""

from __future__ import annotations

from tessera.node_agent.devices import (
    DeviceConfig,
    HealthEvent,
    PhysicalGpu,
    advertise,
    source_from_settings,
)
from tessera.node_agent.family_source import FamilySource
from tessera.node_agent.nvidia_source import NvidiaSource

from tessera.device_kinds import registry
from tessera.device_kinds.node import NodeDeviceConfig
from tessera.device_kinds.nvidia.node import NvidiaNode
from tessera.device_kinds.nvidia.static_gpus import SimulatedGpus
from tessera.settings import TesseraSettings

MODEL = "NVIDIA A100-SXM4-40GB"  # a model whose MIG profiles Tessera knows


def settings(**kw) -> TesseraSettings:
    return TesseraSettings(device_source="static", static_gpu_count=2, static_gpu_model=MODEL,
                           static_gpu_memory_mib=40960, **kw)


def test_an_nvidia_node_is_read_through_its_family_like_any_other() -> None:
    node_side = registry.node_family("nvidia")
    assert isinstance(node_side, NvidiaNode)
    source = source_from_settings(settings(), "n1")
    assert isinstance(source, FamilySource) and isinstance(source, NvidiaSource)
    assert isinstance(source.backend, SimulatedGpus) and source.family == "nvidia"
    gpus = source.discover()
    assert [g.type for g in gpus] == [f"NVIDIA-{MODEL}"] * 2
    infos = advertise(gpus, settings())
    assert [(d.type, d.mode, d.memory_mib, d.split_count, d.mig) for d in infos] == [
        (f"NVIDIA-{MODEL}", "hami-core", 40960, 10, None)] * 2
    assert registry.kind_of(infos[0]).name == "nvidia.hami-core"


def test_mig_mode_and_dynamic_geometries_come_from_the_family() -> None:
    dynamic = settings(mig_strategy="dynamic")
    gpus = source_from_settings(dynamic, "n2").discover()
    assert all(g.mig for g in gpus)
    infos = advertise(gpus, dynamic, config=DeviceConfig.of(dynamic))
    assert {d.mode for d in infos} == {"mig"}
    assert all(d.mig is not None and d.mig.model for d in infos)
    # a node configured for slices offers none, as before
    sliced = NvidiaNode().advertise(SimulatedGpus(dynamic, "n2").discover(),
                                    NodeDeviceConfig(mode="hami-core", mig_strategy="dynamic"))
    assert {(d.mode, d.mig) for d in sliced} == {("hami-core", None)}
    # a hand-made GPU (no family named) is NVIDIA's, advertised through the same node side
    plain = PhysicalGpu("GPU-x", 0, MODEL, 40960, mig=True)
    [info] = advertise([plain], dynamic, config=DeviceConfig.of(dynamic))
    assert (info.type, info.mode) == (f"NVIDIA-{MODEL}", "mig") and info.mig is not None


def test_simulated_faults_reach_the_health_monitor_with_their_xid(tmp_path) -> None:
    faults = tmp_path / "faults"
    faults.write_text("1 79\n0 43\n")
    source = source_from_settings(settings(static_fault_file=str(faults),
                                           ignored_xids="43"), "n3")
    gpus = source.discover()
    event = source.wait_event(0.5)
    assert event == HealthEvent(gpus[1].uuid, "xid", 79)
    assert event.describe() == f"XID 79 on {gpus[1].uuid}"
    assert source.wait_event(0.2) is None  # XID 43 is ignored
