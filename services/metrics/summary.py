"""Per-GPU figures joined from the three sources: what the node advertises (registration), what
the scheduler granted (ledger) and what is really used (usage samples). Pure.

Both the Prometheus exposition and the dashboard read these rows, so they always agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.models import (
    ContainerUsage,
    DeviceInfo,
    DeviceUsage,
    HostDeviceUsage,
    MigInstanceGrant,
    UsageSample,
)

from .view import ClusterView, counted_containers

MIB = 1024 * 1024


@dataclass
class Slice:
    """One container's share of one GPU."""

    namespace: str
    pod: str
    pod_uid: str
    container: str
    container_index: int
    memory_mib: int
    cores: int
    state: str
    used_bytes: int | None = None
    limit_bytes: int | None = None
    sm_util: float | None = None
    sm_limit: int | None = None
    breach: str | None = None  # the watchdog's latest breach reason on this slice's GPU
    mig: MigInstanceGrant | None = None  # dynamic MIG: the instance serving this grant
    memory_limit_mib: int = 0  # elastic: the burst limit granted (0: a hard slice)
    borrowed_bytes: int | None = None  # elastic: used beyond the guarantee
    cores_limit: int = 0  # elastic compute: the burst limit granted (0: a hard slice)
    sm_allowance: float | None = None  # elastic compute: the allowance in force now (% of GPU)


@dataclass
class GpuSummary:
    node: str
    device: DeviceInfo
    slices: list[Slice] = field(default_factory=list)
    host: HostDeviceUsage | None = None

    @property
    def allocated_mib(self) -> int:
        return sum(s.memory_mib for s in self.slices)

    @property
    def allocated_cores(self) -> int:
        return sum(s.cores for s in self.slices)

    @property
    def containers_used_bytes(self) -> int | None:
        used = [s.used_bytes for s in self.slices if s.used_bytes is not None]
        return sum(used) if used else None

    @property
    def physical_mib(self) -> int:
        return self.device.physical_memory_mib or self.device.memory_mib


@dataclass
class NodeSummary:
    name: str
    registered: bool
    heartbeat_at: float | None
    gpus: list[GpuSummary]
    orphan_slices: list[tuple[str, Slice]] = field(default_factory=list)  # (uuid, slice)


def _container_usage(sample: UsageSample | None) -> dict[tuple[str, str], ContainerUsage]:
    if sample is None:
        return {}
    return {(c.pod_uid, c.container): c for c in sample.containers}


def _device_usage_by_pod(sample: UsageSample | None) -> dict[tuple[str, str], list[DeviceUsage]]:
    """(pod uid, GPU uuid) -> what each of the pod's containers reports on that GPU."""
    out: dict[tuple[str, str], list[DeviceUsage]] = {}
    for container in sample.containers if sample else []:
        for device in container.devices:
            out.setdefault((container.pod_uid, device.uuid), []).append(device)
    return out


def _breach(view: ClusterView, pod_uid: str, uuid: str) -> str | None:
    return view.breached.get(pod_uid, {}).get(uuid)


def summarise(view: ClusterView, now: float) -> list[NodeSummary]:
    """Every node seen in the registrations or the ledgers, sorted by name."""
    usage = view.fresh_usage(now)
    out: list[NodeSummary] = []
    for name in sorted(set(view.nodes) | set(view.ledgers)):
        registration = view.nodes.get(name)
        sample = usage.get(name)
        hosts = {d.uuid: d for d in sample.devices} if sample else {}
        gpus = {
            d.uuid: GpuSummary(name, d, host=hosts.get(d.uuid))
            for d in sorted(registration.devices if registration else [], key=lambda d: d.index)
        }
        by_container = _container_usage(sample)
        by_pod_device = _device_usage_by_pod(sample)
        node = NodeSummary(
            name=name,
            registered=view.node_registered(name, now),
            heartbeat_at=registration.heartbeat_at if registration else None,
            gpus=list(gpus.values()),
        )
        for allocation in view.active_allocations(name):
            for index, grants in counted_containers(allocation):
                container = (
                    allocation.container_names[index]
                    if index < len(allocation.container_names)
                    else f"#{index}"
                )
                used = by_container.get((allocation.pod_uid, container))
                used_by_uuid = {d.uuid: d for d in used.devices} if used else {}
                for grant in grants:
                    device_usage = used_by_uuid.get(grant.uuid)
                    if device_usage is None and used is None:
                        # The ledger lacks container names: join on the GPU when only one of
                        # the pod's containers reports on it.
                        candidates = by_pod_device.get((allocation.pod_uid, grant.uuid), [])
                        device_usage = candidates[0] if len(candidates) == 1 else None
                    piece = Slice(
                        namespace=allocation.namespace,
                        pod=allocation.name,
                        pod_uid=allocation.pod_uid,
                        container=container,
                        container_index=index,
                        memory_mib=grant.memory_mib,
                        cores=grant.cores,
                        state=str(allocation.state),
                        used_bytes=device_usage.used_bytes if device_usage else None,
                        limit_bytes=device_usage.limit_bytes if device_usage else None,
                        sm_util=device_usage.sm_util if device_usage else None,
                        sm_limit=device_usage.sm_limit if device_usage else None,
                        breach=_breach(view, allocation.pod_uid, grant.uuid),
                        mig=grant.mig,
                        memory_limit_mib=grant.memory_limit_mib,
                        borrowed_bytes=device_usage.borrowed_bytes if device_usage else None,
                        cores_limit=grant.cores_limit,
                        sm_allowance=(device_usage.sm_allowance or None) if device_usage
                        else None,
                    )
                    gpu = gpus.get(grant.uuid)
                    if gpu is None:
                        node.orphan_slices.append((grant.uuid, piece))
                    else:
                        gpu.slices.append(piece)
        out.append(node)
    return out
