"""Ascend vNPU templates: which cut a request gets, and whether a chip still has room for it.

Rules (HAMi's docs and device ConfigMap are the facts; the rules as written are Tessera's):

- A request for one NPU with `…-memory` (and optionally `…-core`, AI cores) is rounded up to the
  **smallest template that covers it**: templates in order of memory (then AI cores), the first
  whose memory ≥ the request (× the chip's `memoryFactor`) and whose AI cores ≥ the cores asked.
- A request above every template but within the chip's `memoryCapacity` takes the **whole chip**
  (HAMi: `memoryAllocatable`, template ""); a request above that is covered by nothing and
  pends with `NoVnpuTemplateCovers`.
- A request without `…-memory` (and every request for more than one NPU) takes whole chips.
- Templates on one chip never overlap its capacity: the vNPUs on a chip together hold at most
  its `memoryAllocatable` MiB, its AI cores and its AI CPUs; a whole chip holds no vNPU beside it.
- 910C: NPUs come in modules of two dies (indices 2k, 2k+1); a request is for whole modules.

Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .chips import AscendChip

# Tessera's reason code for a request no template (and no whole chip) covers; HAMi's codes for
# the rest (specs/hami-compat.md "Fit").
NO_TEMPLATE_COVERS = "NoVnpuTemplateCovers"
INSUFFICIENT_MEMORY = "CardInsufficientMemory"
INSUFFICIENT_CORE = "CardInsufficientCore"
EXCLUSIVE_CONFLICT = "ExclusiveDeviceAllocateConflict"
MODULE_PAIR_UNAVAILABLE = "AllocatedCardsInsufficientRequest"
WHOLE = ""  # the template name of a whole chip (HAMi's `temp: ""`)


@dataclass(frozen=True)
class Cut:
    """What one grant takes on one chip: a template, or the whole chip (`template == ""`)."""

    template: str
    memory_mib: int
    ai_core: int
    ai_cpu: int

    @property
    def whole(self) -> bool:
        return self.template == WHOLE


def whole_chip(chip: AscendChip) -> Cut:
    """A whole NPU (910C: a whole module of two dies)."""
    dies = 2 if chip.module_pairs else 1
    return Cut(WHOLE, chip.memory_allocatable * dies, chip.ai_core * dies, chip.ai_cpu * dies)


def covering_cut(chip: AscendChip, memory_mib: int | None, ai_core: int = 0) -> Cut | None:
    """The cut a one-NPU request gets on this chip type; None when nothing covers it.
    `memory_mib` None: the whole chip."""
    if memory_mib is None:
        return whole_chip(chip)
    wanted = memory_mib * chip.memory_factor
    for t in chip.templates:  # smallest first
        if t.memory >= wanted and t.ai_core >= ai_core:
            return Cut(t.name, t.memory, t.ai_core, t.ai_cpu)
    if wanted <= chip.memory_capacity and ai_core <= chip.ai_core:
        return whole_chip(chip)
    return None


def cut_of_grant(chip: AscendChip, memory_mib: int, ai_core: int) -> Cut:
    """The cut a recorded grant holds (its memory and AI cores are the cut's): the template with
    exactly those figures, else the whole chip. Reading the ledger back never re-rounds."""
    for t in chip.templates:
        if t.memory == memory_mib and t.ai_core == ai_core:
            return Cut(t.name, t.memory, t.ai_core, t.ai_cpu)
    return whole_chip(chip)


def uncovered_reason(chip: AscendChip, memory_mib: int | None, ai_core: int) -> str:
    """The sentence behind NoVnpuTemplateCovers (no parentheses: it is shown inside some)."""
    largest = chip.templates[-1] if chip.templates else None
    biggest = (f"largest template {largest.name} holds {largest.memory} MiB / {largest.ai_core} "
               "AI cores, " if largest else "")
    return (f"no vNPU template of {chip.common_word} covers {memory_mib} MiB / {ai_core} AI cores: "
            f"{biggest}a whole chip {chip.memory_capacity} MiB / {chip.ai_core} AI cores")


@dataclass(frozen=True)
class ChipUse:
    """What the grants on one chip hold together."""

    memory_mib: int = 0
    ai_core: int = 0
    ai_cpu: int = 0
    vnpus: int = 0
    whole: bool = False

    def plus(self, cut: Cut) -> ChipUse:
        if cut.whole:
            return ChipUse(self.memory_mib + cut.memory_mib, self.ai_core + cut.ai_core,
                           self.ai_cpu + cut.ai_cpu, self.vnpus, True)
        return ChipUse(self.memory_mib + cut.memory_mib, self.ai_core + cut.ai_core,
                       self.ai_cpu + cut.ai_cpu, self.vnpus + 1, self.whole)

    @property
    def idle(self) -> bool:
        return not self.whole and self.vnpus == 0


def chip_use(cuts: Iterable[Cut]) -> ChipUse:
    use = ChipUse()
    for cut in cuts:
        use = use.plus(cut)
    return use


def refusal(chip: AscendChip, use: ChipUse, cut: Cut) -> str | None:
    """Why this chip cannot take the cut now (a HAMi reason code), or None when it can. A whole
    chip needs an idle chip; a template needs memory, AI cores and AI CPUs left beside the
    vNPUs already cut (never overlapping the chip's capacity)."""
    if use.whole:
        return EXCLUSIVE_CONFLICT
    if cut.whole:
        return None if use.idle else EXCLUSIVE_CONFLICT
    if use.memory_mib + cut.memory_mib > chip.memory_allocatable:
        return INSUFFICIENT_MEMORY
    if use.ai_core + cut.ai_core > chip.ai_core:
        return INSUFFICIENT_CORE
    if chip.ai_cpu and use.ai_cpu + cut.ai_cpu > chip.ai_cpu:
        return INSUFFICIENT_CORE
    return None


def module_of(index: int) -> int:
    """910C: the module (card) an NPU index belongs to; its two dies are 2k and 2k+1."""
    return index // 2


def whole_modules(free_indices: Iterable[int], count: int) -> list[int] | None:
    """910C: `count` NPUs (even) as whole free modules, the lowest modules first; None when too
    few modules have both dies free."""
    free = set(free_indices)
    modules = sorted({m for m in map(module_of, free) if {2 * m, 2 * m + 1} <= free})
    need = count // 2
    if count % 2 or len(modules) < need:
        return None
    return [i for m in modules[:need] for i in (2 * m, 2 * m + 1)]
