"""The Ascend kind: NPUs cut into the driver's vNPU templates, or given whole.

Tessera decides which template a container gets and where it goes (never overlapping a chip's
capacity: `templates.py`); the Ascend docker runtime creates the vNPU from what the container
is handed and the driver enforces it:

- `ASCEND_VISIBLE_DEVICES`: the physical NPU ids (a 910C module: both dies);
- `ASCEND_VNPU_SPECS`: the template name, for a vNPU (none for a whole NPU);
- the `huawei.com/<cw>` runtime info (`[{"UUID", "temp"}]`), as HAMi's device plugin reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..base import (
    CARD_INSUFFICIENT_CORE,
    CARD_INSUFFICIENT_MEMORY,
    EXCLUSIVE_CONFLICT,
    NO_SELECTION,
    ContainerEdits,
    DeviceKind,
    DeviceView,
    GrantContext,
    Selection,
    Take,
)
from . import annotations as ann
from .chips import AscendChip
from .family import AscendFamily
from .templates import (
    NO_TEMPLATE_COVERS,
    ChipUse,
    Cut,
    chip_use,
    covering_cut,
    cut_of_grant,
    uncovered_reason,
    whole_chip,
)

if TYPE_CHECKING:
    from tessera.hami import ContainerRequest
    from tessera.models import DeviceGrant

VISIBLE_DEVICES = "ASCEND_VISIBLE_DEVICES"
VNPU_SPECS = "ASCEND_VNPU_SPECS"


def mode_of(common_word: str) -> str:
    """DeviceInfo.mode of this chip type's NPUs (one kind per chip type)."""
    return f"{common_word.lower()}-vnpu"


def chip_partitions_use(chip: AscendChip, device: DeviceView) -> ChipUse:
    """What the vNPUs on the device hold together, by their templates (the scheduler keeps
    them on the card: `holds_partitions`), AI CPUs included."""
    cuts = []
    for name in getattr(device, "partitions", ()):
        template = chip.template(name) if name else None
        cuts.append(Cut(template.name, template.memory, template.ai_core, template.ai_cpu)
                    if template is not None else whole_chip(chip))
    return chip_use(cuts)


class AscendVnpu(DeviceKind):
    explains = True
    holds_partitions = True

    def __init__(self, family: AscendFamily) -> None:
        self.family = family  # type: ignore[misc]
        self.name = f"{family.name}.vnpu"  # type: ignore[misc]
        self.modes = (mode_of(family.common_word),)  # type: ignore[misc]

    def _cut(self, request: ContainerRequest) -> Cut | None:
        memory = None if request.memory_percentage == 100 else request.memory_mib
        return covering_cut(self.family.chip, memory, request.cores)  # type: ignore[attr-defined]

    def capacity_refusal(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str | None:
        """The smallest covering template must fit beside the vNPUs already cut on the chip:
        memory and AI cores left (the chip's registered capacity), a whole chip only when idle."""
        cut = self._cut(request)
        if cut is None:
            return NO_TEMPLATE_COVERS
        if cut.whole and device.used_slots:
            return EXCLUSIVE_CONFLICT
        # The chip's own capacity, whatever scaling the node's configuration applied: vNPUs are
        # hard partitions, never overcommitted.
        chip = whole_chip(self.family.chip)  # type: ignore[attr-defined]
        if cut.memory_mib > min(device.memory_mib, chip.memory_mib) - device.used_mem:
            return CARD_INSUFFICIENT_MEMORY
        if cut.ai_core > min(device.cores, chip.ai_core) - device.used_cores:
            return CARD_INSUFFICIENT_CORE
        if not cut.whole and self._ai_cpus_short(device, cut):
            return CARD_INSUFFICIENT_CORE  # HAMi has no reason of its own: explain() says
        return None

    def _ai_cpus_short(self, device: DeviceView, cut: Cut) -> bool:
        """The chip's AI CPUs (the driver refuses a vNPU beyond them) would not hold the cut
        beside the vNPUs' templates already there."""
        chip = self.family.chip  # type: ignore[attr-defined]
        if not chip.ai_cpu or not cut.ai_cpu:
            return False
        return chip_partitions_use(chip, device).ai_cpu + cut.ai_cpu > chip.ai_cpu

    def partitions_problem(self, device: DeviceView) -> str | None:
        chip = self.family.chip  # type: ignore[attr-defined]
        used = chip_partitions_use(chip, device).ai_cpu
        if chip.ai_cpu and used > chip.ai_cpu:
            return f"vNPUs' AI CPUs {used} > {chip.ai_cpu}"
        return None

    def partition_of(self, device: DeviceView, grant: DeviceGrant) -> str:
        """The template a grant holds (the whole chip: '')."""
        return cut_of_grant(self.family.chip, grant.memory_mib,  # type: ignore[attr-defined]
                            grant.cores).template

    def explain(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> str:
        cut = self._cut(request)
        if cut is not None:
            if cut.whole or not self._ai_cpus_short(device, cut):
                return ""
            chip = self.family.chip  # type: ignore[attr-defined]
            used = chip_partitions_use(chip, device).ai_cpu
            return (f"{cut.template} needs {cut.ai_cpu} AI CPU(s) but {chip.common_word} NPU "
                    f"{device.index} has {chip.ai_cpu - used} of {chip.ai_cpu} left beside its "
                    f"vNPUs ({', '.join(t for t in getattr(device, 'partitions', ()) if t)})")
        memory = None if request.memory_percentage == 100 else request.memory_mib
        return uncovered_reason(self.family.chip, memory, request.cores)  # type: ignore[attr-defined]

    def take(
        self, device: DeviceView, request: ContainerRequest, selection: Selection = NO_SELECTION
    ) -> Take:
        cut = self._cut(request)
        if cut is None:  # only asked once it fits; a covered request always has a cut
            raise ValueError(uncovered_reason(self.family.chip, request.memory_mib,  # type: ignore[attr-defined]
                                              request.cores))
        return Take(cut.memory_mib, cut.ai_core, cut.template)

    def rounded_take(self, request: ContainerRequest) -> Take | None:
        """The smallest covering template (or the whole chip), as `take` charges it: a request
        for 1 AI core is granted vir05_1c_16g's 5."""
        cut = self._cut(request)
        return Take(cut.memory_mib, cut.ai_core, cut.template) if cut is not None else None

    def container_edits(self, grants: Sequence[DeviceGrant], ctx: GrantContext) -> ContainerEdits:
        chip = self.family.chip  # type: ignore[attr-defined]
        ids: list[int] = []
        for g in grants:
            device = ctx.devices.get(g.uuid)
            if device is None:
                raise ValueError(f"grant on {g.uuid}: not a device of this node")
            ids.extend((2 * device.index, 2 * device.index + 1) if chip.module_pairs
                       else (device.index,))
        cuts = [cut_of_grant(chip, g.memory_mib, g.cores) for g in grants]
        env = {VISIBLE_DEVICES: ",".join(str(i) for i in ids)}
        if len(cuts) == 1 and not cuts[0].whole:
            env[VNPU_SPECS] = cuts[0].template
        info = ann.encode_runtime_info([(g.uuid, c.template) for g, c in zip(grants, cuts,
                                                                               strict=True)])
        return ContainerEdits(env=env, annotations={ann.runtime_info_key(chip.common_word): info})
