"""MIG (Multi-Instance GPU) facts shared by the scheduler, the node agent and the test NVML.

A MIG-capable GPU is divided into memory slices (8 on A100/H100/H200, 4 on A30) and compute
slices (7, or 4 on A30). A GPU instance profile (`1g.10gb`, `3g.40gb`, …) takes a fixed number of
each, and may only start at the memory-slice positions NVIDIA's MIG user guide lists for it
("Supported MIG Profiles"; `nvidia-smi mig -lgipp` prints the same placements). Two instances
may not share a memory slice and together may not use more compute slices than the GPU has;
within those rules any set of instances is a valid geometry.

Memory per profile is the profile's documented fraction of the card (memory slices / total
slices of the card's memory in MiB): the figure the scheduler charges. The node agent reports
what NVML says an instance really has once it exists.

Media-extension profiles (`+me`) are not offered: Kubernetes resource names cannot carry `+`,
and they differ from their base profile only in media engines, which Tessera does not schedule.

Pure data and arithmetic, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# What `migStrategy` (the NVIDIA device plugin's term) and HAMi's `mig` mode mean on a node.
STRATEGY_NONE = "none"  # MIG instances are not offered (a card in MIG mode is refused)
STRATEGY_SINGLE = "single"  # every instance offered as `nvidia.com/gpu` (one profile per node)
STRATEGY_MIXED = "mixed"  # one resource per profile: `nvidia.com/mig-<profile>`
STRATEGY_DYNAMIC = "dynamic"  # HAMi's `mig` mode: instances created per pod on allocation
STRATEGIES = (STRATEGY_NONE, STRATEGY_SINGLE, STRATEGY_MIXED, STRATEGY_DYNAMIC)

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
_PROFILE_NAME = re.compile(r"^(?P<g>[1-9])g\.(?P<gb>[0-9]+)gb$")


class MigError(ValueError):
    """A profile, geometry or placement that the GPU model does not allow (message says why)."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU instance profile of one GPU model."""

    name: str  # "1g.10gb"
    compute_slices: int  # the "1g" part
    memory_slices: int  # how many memory slices it occupies (its placement size)
    starts: tuple[int, ...]  # memory-slice positions it may start at

    @property
    def max_instances(self) -> int:
        return len(self.starts)

    @property
    def resource(self) -> str:
        return MIG_RESOURCE_PREFIX + self.name


@dataclass(frozen=True, slots=True)
class MigModel:
    """The MIG geometry of one GPU model."""

    name: str  # NVML's product name without the "NVIDIA " prefix, e.g. "A100-SXM4-80GB"
    memory_mib: int  # whole card
    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfile, ...]  # ordered smallest first

    def profile(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.profiles)
        raise MigError(f"{self.name} has no MIG profile {name!r} (it has {known})")

    def profile_memory_mib(self, profile: MigProfile) -> int:
        return self.memory_mib * profile.memory_slices // self.memory_slices

    def profile_cores(self, profile: MigProfile) -> int:
        """The profile's share of the card's compute in HAMi's cores unit (%, rounded down)."""
        return 100 * profile.compute_slices // self.compute_slices


def _eight_slice_model(name: str, memory_mib: int, sizes_gb: Sequence[int]) -> MigModel:
    """A100 / H100 / H200 share one layout; only the memory per profile differs.

    `sizes_gb`: the nominal GB of 1g (1 slice), 1g (2 slices), 2g, 3g, 4g, 7g, as the profile
    names print them."""
    one, one_wide, two, three, four, seven = sizes_gb
    return MigModel(
        name=name,
        memory_mib=memory_mib,
        memory_slices=8,
        compute_slices=7,
        profiles=(
            MigProfile(f"1g.{one}gb", 1, 1, (0, 1, 2, 3, 4, 5, 6)),
            MigProfile(f"1g.{one_wide}gb", 1, 2, (0, 2, 4, 6)),
            MigProfile(f"2g.{two}gb", 2, 2, (0, 2, 4)),
            MigProfile(f"3g.{three}gb", 3, 4, (0, 4)),
            MigProfile(f"4g.{four}gb", 4, 4, (0,)),
            MigProfile(f"7g.{seven}gb", 7, 8, (0,)),
        ),
    )


# From NVIDIA's MIG user guide, "Supported MIG Profiles". Keyed by the model name as NVML's
# nvmlDeviceGetName prints it without the "NVIDIA " prefix.
MODELS: dict[str, MigModel] = {
    m.name: m
    for m in (
        _eight_slice_model("A100-SXM4-40GB", 40960, (5, 10, 10, 20, 20, 40)),
        _eight_slice_model("A100-PCIE-40GB", 40960, (5, 10, 10, 20, 20, 40)),
        _eight_slice_model("A100-SXM4-80GB", 81920, (10, 20, 20, 40, 40, 80)),
        _eight_slice_model("A100 80GB PCIe", 81920, (10, 20, 20, 40, 40, 80)),
        _eight_slice_model("H100 80GB HBM3", 81920, (10, 20, 20, 40, 40, 80)),
        _eight_slice_model("H100 PCIe", 81920, (10, 20, 20, 40, 40, 80)),
        _eight_slice_model("H200", 144384, (18, 35, 35, 71, 71, 141)),
        MigModel(
            name="A30",
            memory_mib=24576,
            memory_slices=4,
            compute_slices=4,
            profiles=(
                MigProfile("1g.6gb", 1, 1, (0, 1, 2, 3)),
                MigProfile("2g.12gb", 2, 2, (0, 2)),
                MigProfile("4g.24gb", 4, 4, (0,)),
            ),
        ),
    )
}


def model_for(device_type: str) -> MigModel | None:
    """The MIG model of a device type as the node agent registers it (`NVIDIA-A100-SXM4-80GB`,
    `NVIDIA A100-SXM4-80GB`, `A100-SXM4-80GB`, any case); None when it is not MIG-capable."""
    name = device_type.strip()
    stripped = True
    while stripped:  # "NVIDIA-NVIDIA A100-…": the type of an NVML name that has the prefix
        stripped = False
        for prefix in ("NVIDIA-", "NVIDIA "):
            if name.upper().startswith(prefix):
                name, stripped = name[len(prefix):], True
    wanted = name.lower().replace("-", " ")
    for key, model in MODELS.items():
        if key.lower().replace("-", " ") == wanted:
            return model
    return None


def parse_profile_name(name: str) -> tuple[int, int]:
    """`"3g.40gb"` → (3, 40); MigError naming the expected form otherwise."""
    m = _PROFILE_NAME.match(name.strip())
    if m is None:
        raise MigError(f"{name!r} is not a MIG profile name (expected the form 1g.10gb)")
    return int(m["g"]), int(m["gb"])


@dataclass(frozen=True, slots=True)
class Instance:
    """A GPU instance that exists (or is planned) on one card: its profile and start slice."""

    profile: str
    start: int


def occupied(model: MigModel, instances: Iterable[Instance]) -> tuple[set[int], int]:
    """Memory slices taken and compute slices used by `instances`; MigError when they overlap
    or are placed where the profile may not start (a geometry the hardware cannot hold)."""
    slices: set[int] = set()
    compute = 0
    for inst in instances:
        profile = model.profile(inst.profile)
        if inst.start not in profile.starts:
            raise MigError(f"{profile.name} cannot start at memory slice {inst.start} "
                           f"(allowed: {', '.join(map(str, profile.starts))})")  # fmt: skip
        span = set(range(inst.start, inst.start + profile.memory_slices))
        if span & slices:
            raise MigError(f"{profile.name} at slice {inst.start} overlaps another instance")
        slices |= span
        compute += profile.compute_slices
    if compute > model.compute_slices:
        raise MigError(f"instances use {compute} compute slices, {model.name} has "
                       f"{model.compute_slices}")  # fmt: skip
    return slices, compute


def free_starts(model: MigModel, instances: Sequence[Instance], profile: MigProfile) -> list[int]:
    """Where `profile` could be created next to `instances` (empty when nowhere)."""
    taken, compute = occupied(model, instances)
    if compute + profile.compute_slices > model.compute_slices:
        return []
    return [
        s for s in profile.starts
        if not taken & set(range(s, s + profile.memory_slices))
    ]  # fmt: skip


def _openings(model: MigModel, instances: Sequence[Instance]) -> int:
    """How many (profile, start) creations would still be possible: a measure of how much a
    geometry keeps open, used to pick the placement that fragments the card least."""
    return sum(len(free_starts(model, instances, p)) for p in model.profiles)


def best_start(model: MigModel, instances: Sequence[Instance], profile: MigProfile) -> int | None:
    """The start for a new `profile` instance that leaves the most room for later ones (ties:
    the highest start, which keeps the low slices for the wide profiles that must start at 0);
    None when it fits nowhere."""
    best: tuple[int, int] | None = None
    for start in free_starts(model, instances, profile):
        score = (_openings(model, [*instances, Instance(profile.name, start)]), start)
        if best is None or score > best:
            best = score
    return None if best is None else best[1]


def within_geometries(
    instances: Iterable[Instance], geometries: Sequence[Mapping[str, int]] | None
) -> bool:
    """Whether the profile counts of `instances` stay inside one of the allowed geometries (an
    operator's list of `{profile: count}`); no list means anything the hardware allows."""
    if not geometries:
        return True
    counts: dict[str, int] = {}
    for inst in instances:
        counts[inst.profile] = counts.get(inst.profile, 0) + 1
    return any(
        all(n <= allowed.get(name, 0) for name, n in counts.items()) for allowed in geometries
    )


def validate_geometries(model: MigModel, geometries: Sequence[Mapping[str, int]]) -> None:
    """MigError unless every geometry names this model's profiles with counts ≥ 1 and can be
    laid out on the card (some placement of all its instances exists)."""
    for geometry in geometries:
        plan: list[Instance] = []
        widest_first = sorted(geometry.items(), key=lambda kv: -model.profile(kv[0]).memory_slices)
        for name, count in widest_first:
            if not isinstance(count, int) or count < 1:
                raise MigError(f"geometry {dict(geometry)}: count of {name} must be ≥ 1")
            profile = model.profile(name)
            for _ in range(count):
                start = best_start(model, plan, profile)
                if start is None:
                    raise MigError(f"geometry {dict(geometry)} does not fit on {model.name}")
                plan.append(Instance(name, start))


def parse_geometries(text: str) -> dict[str, list[dict[str, int]]]:
    """The `mig_geometries` setting: JSON `{model: [{profile: count}, …]}` (empty text: none),
    every geometry checked against its model (MigError naming what is wrong)."""
    import json

    if not text.strip():
        return {}
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise MigError(f"MIG geometries are not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise MigError("MIG geometries: expected {model: [{profile: count}, …]}")
    out: dict[str, list[dict[str, int]]] = {}
    for name, geometries in raw.items():
        model = model_for(str(name))
        if model is None:
            raise MigError(f"MIG geometries: {name!r} is not a MIG model "
                           f"(known: {', '.join(MODELS)})")  # fmt: skip
        if not isinstance(geometries, list) or not all(isinstance(g, dict) for g in geometries):
            raise MigError(f"MIG geometries of {model.name}: expected a list of {{profile: count}}")
        validate_geometries(model, geometries)
        out[model.name] = [dict(g) for g in geometries]
    return out


def smallest_profile(model: MigModel, memory_mib: int, cores: int) -> MigProfile | None:
    """The smallest profile whose memory and compute cover the request (memory first, then
    compute); None when even the whole card does not. `cores` 0 means no compute requirement."""
    fitting = [
        p for p in model.profiles
        if model.profile_memory_mib(p) >= memory_mib and model.profile_cores(p) >= cores
    ]  # fmt: skip
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.memory_slices, p.compute_slices))


# NVML names a GPU instance profile by an index (`NVML_GPU_INSTANCE_PROFILE_<n>_SLICE`, nvml.h):
# the node agent asks NVML for the profile at that index and creates instances with the profile
# id NVML returns. The "1 slice rev2" profile is the 1g profile with two memory slices.
_NVML_PROFILE_BY_COMPUTE = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
NVML_PROFILE_1_SLICE_REV2 = 0x9
# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE, by compute slices
NVML_CI_PROFILE_BY_COMPUTE = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


def nvml_profile_index(model: MigModel, profile: MigProfile) -> int:
    """The NVML_GPU_INSTANCE_PROFILE_* index of `profile` on `model`."""
    smallest = min(p.memory_slices for p in model.profiles if p.compute_slices == 1)
    if profile.compute_slices == 1 and profile.memory_slices > smallest:
        return NVML_PROFILE_1_SLICE_REV2
    return _NVML_PROFILE_BY_COMPUTE[profile.compute_slices]
