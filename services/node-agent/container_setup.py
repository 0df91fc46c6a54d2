"""What a container the handshake serves gets: HAMi's env for its slices, the mounts that give
it libvgpu, its region and its sealed limits, and the limits PreStartContainer seals. Pure."""

from __future__ import annotations

from typing import Any

from tessera.node_agent.containers import (
    LIBVGPU_CONTAINER_PATH,
    PRELOAD_CONTAINER_PATH,
    REGION_CONTAINER_DIR,
    REGION_CONTAINER_PATH,
    ContainerDir,
    sealed_device_limit,
)

from tessera import elastic
from tessera.device_kinds.nvidia.slices import slice_env
from tessera.device_kinds.types import GrantContext
from tessera.models import Allocation, DeviceGrant
from tessera.region import SEALED_LIMITS_DIR, ContainerLimits
from tessera.settings import TesseraSettings


def container_env(
    allocation: Allocation, grants: list[DeviceGrant], settings: TesseraSettings
) -> dict[str, str]:
    """HAMi's env for libvgpu slices (a fallback: libvgpu obeys the sealed limits file when
    there is one): the slices kind's, for callers holding an allocation (the DRA driver)."""
    ctx = GrantContext(devices={}, settings=settings, priority=allocation.priority,
                       core_policy=allocation.core_policy or settings.core_policy)
    return slice_env(grants, ctx)


def container_mounts(
    cdir: ContainerDir, settings: TesseraSettings, preload_host_path: str
) -> list[tuple[str, str, bool]]:
    """(container path, host path, read-only) of every mount, parents before what they hold
    (container runtimes mount in order of path depth)."""
    return [
        (LIBVGPU_CONTAINER_PATH, settings.libvgpu_host_path, True),
        (PRELOAD_CONTAINER_PATH, preload_host_path, True),
        # The region's directory read-only and the file itself read-write on top: the tenant can
        # write its counters but neither rename, unlink nor replace the file (a mount point
        # cannot be renamed over: EBUSY; the directory takes no new file: EROFS). Nothing it
        # writes there is the account anyway: that is the agent's lease service (leases.py).
        (REGION_CONTAINER_DIR, str(cdir.region_dir), True),
        (REGION_CONTAINER_PATH, str(cdir.region_file), False),
        # The directory, never the file: the agent replaces the limits file by rename (a
        # bind-mounted file would keep the old inode); the lease socket lives there too.
        (SEALED_LIMITS_DIR, str(cdir.limits_dir), True),
    ]


def spill_of(pod: dict[str, Any] | None, container: str) -> int:
    """Host memory (bytes) the pod lets `container` spill to (`tessera.io/gpumem-spill`, read
    from the cluster's pod as the grant check read it; admission validated it); 0 without a
    pod, an opt-in, or a readable one."""
    if not isinstance(pod, dict):
        return 0
    annotations = (pod.get("metadata") or {}).get("annotations")
    if not isinstance(annotations, dict) or elastic.ANN_GPUMEM_SPILL not in annotations:
        return 0
    spec = pod.get("spec") or {}
    names = [str(c.get("name", "")) for c in
             [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]]  # fmt: skip
    return elastic.spill_bytes_of(annotations, names, container)


def limits_for(
    allocation: Allocation, index: int, settings: TesseraSettings, spill_bytes: int = 0
) -> ContainerLimits:
    """What PreStartContainer seals for container `index` of `allocation` (`spill_bytes`: the
    host memory the pod lets it spill to, tessera.io/gpumem-spill, read from the pod)."""
    grants = allocation.containers[index]
    return ContainerLimits(
        devices=tuple(
            sealed_device_limit(g.uuid, memory_mib=g.memory_mib, cores=g.cores,
                                memory_burst_mib=g.memory_limit_mib or None,
                                cores_burst=g.cores_limit or None)  # elastic (docs/elastic.md)
            for g in grants
        ),
        priority=allocation.priority,
        core_policy=allocation.core_policy or settings.core_policy,
        oversubscribe=settings.device_memory_scaling > 1,
        scrub_on_free=allocation.scrub_on_free or settings.scrub_on_free,
        region_path=REGION_CONTAINER_PATH,
        lease=settings.memory_leases,  # the agent's lease service is the account (leases.py)
        spill_bytes=spill_bytes,  # docs/elastic.md "Spilling to host memory" (libvgpu spill.c)
    )
