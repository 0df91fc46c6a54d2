"""The sealed-capacity check reads what each container sealed from its limits file once and then
only when the file changes: a container resealed with another limit (limits.set) is counted
with the new one at once, and one whose file is gone caps nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tessera.node_agent.containers import ContainerDir, PreparedContainer
from tessera.node_agent.sealed_checks import SealedChecks

from tessera.region import ContainerLimits, DeviceLimit, seal_limits

MIB = 1 << 20


def container(root: Path) -> ContainerDir:
    prepared = PreparedContainer(pod_uid="uid-a", namespace="team", pod="a", container="main",
                                 index=0, device_ids=["GPU-0::0"], grants=[])  # fmt: skip
    cdir = ContainerDir(root / "uid-a" / "0", prepared)
    cdir.limits_dir.mkdir(parents=True)
    return cdir


def test_a_reseal_is_read_again_and_a_removed_file_caps_nothing(tmp_path: Path) -> None:
    checks = SealedChecks(SimpleNamespace(store=SimpleNamespace(all=list)))
    cdir = container(tmp_path)
    assert checks._sealed_memory(cdir) == {}  # nothing sealed yet
    seal_limits(cdir.limits_dir, ContainerLimits(devices=(DeviceLimit("GPU-0", 4000 * MIB),)))
    assert checks._sealed_memory(cdir) == {"GPU-0": 4000}
    assert checks._sealed_memory(cdir) == {"GPU-0": 4000}
    seal_limits(cdir.limits_dir, ContainerLimits(devices=(DeviceLimit("GPU-0", 9000 * MIB),)))
    assert checks._sealed_memory(cdir) == {"GPU-0": 9000}
    for f in cdir.limits_dir.iterdir():
        f.unlink()
    assert checks._sealed_memory(cdir) == {}
