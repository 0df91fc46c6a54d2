"""Static MIG: which existing MIG instances this node offers kubelet, under which resource names.

The NVIDIA device plugin's MIG strategies (its `migStrategy`), for instances that already exist
(an operator made them with `nvidia-smi mig -cgi … -C`):

- `none`: instances are not offered (and the scheduler never places libvgpu slices on a card in
  MIG mode);
- `mixed`: one resource per profile, `nvidia.com/mig-<profile>` (`nvidia.com/mig-1g.10gb`), each
  instance one device;
- `single`: every instance offered as the GPU resource (`nvidia.com/gpu`). NVIDIA's rules: no
  GPU in MIG mode is `none`; every GPU in MIG mode, each with instances, all of one profile, is
  valid; anything else offers nothing, with a reason (`single_devices`). The instances then
  *are* the node's GPUs: each is advertised as one whole device (split count 1: never sliced)
  served by the node's GPU plugin.

An instance is a device whose ID is its MIG UUID; the container gets the UUIDs in
`NVIDIA_VISIBLE_DEVICES` (the NVIDIA container toolkit exposes exactly those instances), and no
libvgpu: MIG isolates in hardware. Pure code, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from tessera import mig
from tessera.models import DeviceInfo, StaticMigInstance

from .devices import PhysicalGpu


@dataclass(frozen=True, slots=True)
class MigOffer:
    """One existing MIG instance as this node offers it."""

    uuid: str  # "MIG-…": the device ID kubelet sees
    parent_uuid: str
    parent_index: int
    profile: str  # "1g.10gb"
    start: int
    gi_id: int
    numa: int = 0
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class MigPlan:
    """resource name → its instances (sorted by parent then start), and why nothing is
    offered when a strategy cannot apply."""

    resources: dict[str, tuple[MigOffer, ...]]
    problem: str = ""


def plan(strategy: str, offers: Iterable[MigOffer], gpu_resource: str) -> MigPlan:
    items = sorted(offers, key=lambda o: (o.parent_index, o.start))
    if strategy not in (mig.STRATEGY_SINGLE, mig.STRATEGY_MIXED) or not items:
        return MigPlan({})
    if strategy == mig.STRATEGY_SINGLE:
        profiles = sorted({o.profile for o in items})
        if len(profiles) > 1:
            return MigPlan({}, f"migstrategy single needs one MIG profile on the node, it has "
                               f"{', '.join(profiles)} (use mixed)")  # fmt: skip
        return MigPlan({gpu_resource: tuple(items)})
    by_profile: dict[str, list[MigOffer]] = {}
    for o in items:
        by_profile.setdefault(mig.MIG_RESOURCE_PREFIX + o.profile, []).append(o)
    return MigPlan({name: tuple(v) for name, v in sorted(by_profile.items())})


def single_devices(gpus: Iterable[PhysicalGpu], offers: Iterable[MigOffer]
                   ) -> tuple[list[DeviceInfo] | None, str]:
    """The `single` strategy, with NVIDIA's rules (its device plugin and GPU feature discovery):
    no GPU of the node (`gpus`: those it offers) in MIG mode → as `none` (None: the GPUs
    themselves are offered); GPUs with MIG on and off mixed, a GPU in MIG mode without an
    instance, or more than one profile on the node → invalid: no device, and the reason.
    Otherwise each instance is one device of the GPU resource — its MIG UUID, the profile's
    memory, all of its compute, one pod (split count 1), typed like GPU feature discovery's
    product name (`NVIDIA-NVIDIA A100-SXM4-80GB-MIG-1g.10gb`)."""
    gpus = sorted(gpus, key=lambda g: g.index)
    items = sorted(offers, key=lambda o: (o.parent_index, o.start))
    if not any(g.mig for g in gpus):
        return None, ""
    plain = [g for g in gpus if not g.mig]
    if plain:
        return [], (f"migstrategy single needs every GPU in MIG mode; GPU {plain[0].index} "
                    f"({plain[0].uuid}) is not (use mixed, or filter the GPU out)")
    held = {o.parent_uuid for o in items}
    empty = [g for g in gpus if g.uuid not in held]
    if empty:
        return [], (f"migstrategy single: GPU {empty[0].index} ({empty[0].uuid}) is in MIG mode "
                    "but holds no instance (create them with nvidia-smi mig -cgi <profile> -C)")
    profiles = sorted({o.profile for o in items})
    if len(profiles) > 1:
        return [], (f"migstrategy single needs one MIG profile on the node, it has "
                    f"{', '.join(profiles)} (use mixed)")
    by_uuid = {g.uuid: g for g in gpus}
    out = []
    for o in items:
        gpu = by_uuid.get(o.parent_uuid)
        if gpu is None:
            continue
        model = mig.model_for(gpu.name)
        memory = model.profile_memory_mib(model.profile(o.profile)) if model else 0
        out.append(DeviceInfo(
            uuid=o.uuid, index=len(out), type=f"{gpu.type}-MIG-{o.profile}", memory_mib=memory,
            physical_memory_mib=memory, cores=100, split_count=1, numa=o.numa,
            healthy=o.healthy,
        ))
    return out, ""


def instances_by_gpu(
    offers: Iterable[MigOffer], holders: Mapping[str, str],
    models: Mapping[str, mig.MigModel | None],
) -> dict[str, list[StaticMigInstance]]:
    """GPU uuid → its served instances as the registration shows them, each with its placement
    size (`models`: GPU uuid → its profile table) and the pod (`holders`: MIG UUID →
    namespace/name, from kubelet) that holds it."""
    out: dict[str, list[StaticMigInstance]] = {}
    for o in sorted(offers, key=lambda o: (o.parent_index, o.start)):
        model = models.get(o.parent_uuid)
        try:
            size = model.profile(o.profile).memory_slices if model else 1
        except mig.MigError:
            size = 1
        out.setdefault(o.parent_uuid, []).append(StaticMigInstance(
            uuid=o.uuid, profile=o.profile, start=o.start, size=size,
            pod=holders.get(o.uuid, "")))
    return out


def single_instance_env(grants: Iterable, priority: int) -> dict[str, str] | None:
    """The whole Allocate answer for a container holding only single-strategy instances (its
    grants name MIG UUIDs, the devices such a node advertises): those instances, as the NVIDIA
    device plugin hands MIG devices over, and no libvgpu — the hardware isolates them and each
    is the pod's alone. None when the container holds anything else."""
    uuids = [g.uuid for g in grants]
    if not uuids or not all(u.startswith("MIG-") and g.mig is None
                            for u, g in zip(uuids, grants, strict=True)):
        return None
    visible = ",".join(uuids)
    return {"NVIDIA_VISIBLE_DEVICES": visible, "CUDA_VISIBLE_DEVICES": visible,
            "CUDA_TASK_PRIORITY": str(priority)}


def on_offered_gpus(offers: Iterable[MigOffer], health: Mapping[str, bool]) -> list[MigOffer]:
    """Only instances of GPUs the node offers (`health`: advertised GPU uuid → healthy, after
    the node config's filters), each as healthy as its GPU (an XID on the card makes its
    instances Unhealthy for kubelet)."""
    return [replace(o, healthy=health[o.parent_uuid]) for o in offers if o.parent_uuid in health]


def container_env(offers: Iterable[MigOffer], requested: list[str]) -> dict[str, str]:
    """The env of a container given the instances `requested` (device IDs = MIG UUIDs);
    ValueError naming the first ID that is not one of `offers`."""
    known = {o.uuid for o in offers}
    unknown = [i for i in requested if i not in known]
    if unknown:
        raise ValueError(f"device {unknown[0]!r} is not a MIG instance this resource offers")
    if len(set(requested)) != len(requested):
        raise ValueError("the same MIG instance was requested twice")
    return {"NVIDIA_VISIBLE_DEVICES": ",".join(requested)}


def socket_name(resource: str) -> str:
    """The device-plugin socket for `resource` (`nvidia.com/mig-1g.10gb` →
    `tessera-mig-1g.10gb.sock`)."""
    return "tessera-" + resource.rsplit("/", 1)[-1] + ".sock"


def simulated_offers(gpus: Iterable, layout: str, node: str) -> list[MigOffer]:
    """The static source's instances: `layout` ('1g.10gb@0,3g.40gb@4') on every GPU whose model
    has MIG profiles, checked against the model's placement rules (MigError when invalid)."""
    import uuid as uuidlib

    wanted = [item.strip() for item in layout.split(",") if item.strip()]
    out: list[MigOffer] = []
    for gpu in gpus:
        model = mig.model_for(gpu.name)
        if model is None or not wanted:
            continue
        instances = []
        for item in wanted:
            profile, _, start = item.partition("@")
            if not start.isdigit():
                raise mig.MigError(f"static MIG instance {item!r}: expected <profile>@<start>")
            instances.append(mig.Instance(model.profile(profile).name, int(start)))
        mig.occupied(model, instances)  # the layout must be one the hardware can hold
        for gi_id, inst in enumerate(instances, start=1):
            name = f"{node}/gpu{gpu.index}/gi{gi_id}"
            out.append(MigOffer(
                uuid=f"MIG-{uuidlib.uuid5(uuidlib.NAMESPACE_DNS, name)}", parent_uuid=gpu.uuid,
                parent_index=gpu.index, profile=inst.profile, start=inst.start, gi_id=gi_id,
                numa=gpu.numa,
            ))
    return out
