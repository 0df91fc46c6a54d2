"""Dynamic MIG (HAMi's `mig` mode), the pure decision for one card: which GPU instance profile a
container's slice becomes and where on the card it goes.

The request (memory MiB, compute %) is fitted to the smallest profile that covers both
(tessera/mig.py); among the profiles that cover it, smallest first, the first one with a free
placement next to the card's existing instances, inside the operator's allowed geometries, is
taken, at the start that fragments the card least. The usage charged is the profile's, not the
request's. A card never mixes modes: one holding libvgpu slices is refused until it is empty
(and the libvgpu rules refuse a card holding MIG instances). Every refusal is
`CardMigTopologyInfeasible` with a sentence saying why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tessera import mig

CARD_MIG_INFEASIBLE = "CardMigTopologyInfeasible"


@dataclass(frozen=True, slots=True)
class MigFit:
    """The instance to create for the container, and what it charges on the card."""

    profile: str
    start: int
    memory_mib: int
    cores: int


@dataclass(frozen=True, slots=True)
class MigRefusal:
    reason: str  # HAMi's name
    detail: str  # a sentence for the user

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def _refuse(detail: str) -> MigRefusal:
    return MigRefusal(CARD_MIG_INFEASIBLE, detail)


def fit(
    card_type: str,
    existing: Sequence[mig.Instance],
    memory_mib: int,
    cores: int,
    *,
    libvgpu_slices: int = 0,
    geometries: Sequence[Mapping[str, int]] | None = None,
) -> MigFit | MigRefusal:
    """Where a container asking `memory_mib` and `cores` (%) goes on a card of `card_type`
    that holds `existing` instances and `libvgpu_slices` libvgpu allocations."""
    model = mig.model_for(card_type)
    if model is None:
        return _refuse(f"{card_type} has no MIG profiles")
    if libvgpu_slices:
        return _refuse(f"the card holds {libvgpu_slices} libvgpu slice(s); a card switches "
                       "to MIG only when it is empty (modes are never mixed on one card)")
    try:
        mig.occupied(model, existing)
    except mig.MigError as exc:
        return _refuse(f"the card's instances are not a valid geometry: {exc}")
    covering = sorted(
        (p for p in model.profiles
         if model.profile_memory_mib(p) >= memory_mib and model.profile_cores(p) >= cores),
        key=lambda p: (p.memory_slices, p.compute_slices),
    )  # fmt: skip
    if not covering:
        return _refuse(f"no MIG profile of {model.name} covers {memory_mib} MiB and {cores} % "
                       f"(the largest is {model.profiles[-1].name})")  # fmt: skip
    tried = []
    for profile in covering:
        start = mig.best_start(model, existing, profile)
        if start is None:
            tried.append(f"{profile.name}: no free placement")
            continue
        if not mig.within_geometries([*existing, mig.Instance(profile.name, start)], geometries):
            tried.append(f"{profile.name}: outside the allowed geometries")
            continue
        return MigFit(profile.name, start, model.profile_memory_mib(profile),
                      model.profile_cores(profile))
    held = ", ".join(f"{i.profile}@{i.start}" for i in existing) or "none"
    return _refuse(f"{'; '.join(tried)} (instances on the card: {held})")
