"""One family per Ascend chip type (HAMi: one `vnpus` entry, one commonWord): its resources, how
a container's request is read and normalised at admission, its selection and annotations.

- `huawei.com/<cw>`: NPUs (limits, else requests); missing beside `-memory`/`-core`: 1.
- `huawei.com/<cw>-memory`: MiB of one vNPU, rounded up to the smallest covering template
  (admission rewrites the limit/request to the template's memory, as HAMi's webhook does);
  missing: a whole NPU (admission writes the chip's allocatable memory).
- `huawei.com/<cw>-core`: AI cores the template must hold (Tessera's reading; HAMi's soft
  `hami-core` split is not offered, so `huawei.com/vnpu-mode: hami-core` is refused).
- More than one NPU: whole NPUs only (HAMi: "vNPU not supported for multiple devices").
- 910C: NPUs in modules of two dies; 1 is rounded up to 2 (HAMi), an odd count above 1 refused.
  A 910C device in Tessera's registry is a module: the request counts modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tessera.hami import ContainerRequest, RequestError

from ..base import AdmissionNotes, DeviceFamily, ResourceNames, Selection
from ..vendor_request import read_raw
from . import annotations as ann
from .chips import AscendChip, active_chip
from .templates import covering_cut, cut_of_grant, uncovered_reason

if TYPE_CHECKING:
    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings

VENDOR = "Huawei"


def family_name(common_word: str) -> str:
    return common_word.lower()


class AscendFamily(DeviceFamily):
    vendor = VENDOR
    device_word = "NPU"
    mode_annotation = ann.VNPU_MODE

    def __init__(self, chip: AscendChip) -> None:
        self.common_word = chip.common_word
        self.name = family_name(chip.common_word)  # type: ignore[misc]
        cw = chip.common_word
        self.register_annotation = ann.register_key(cw)  # type: ignore[misc]
        self.to_allocate_annotation = ann.to_allocate_key(cw)  # type: ignore[misc]
        self.allocated_annotation = ann.allocated_key(cw)  # type: ignore[misc]
        self.use_uuid_annotation = ann.use_uuid_key(cw)  # type: ignore[misc]
        self.nouse_uuid_annotation = ann.no_use_uuid_key(cw)  # type: ignore[misc]
        self.handshake_annotation = ann.handshake_key(cw)
        self.runtime_info_annotation = ann.runtime_info_key(cw)
        self.extra_annotations = (ann.runtime_info_key(cw), ann.VNPU_MODE)
        self.type_prefixes = (cw,)  # type: ignore[misc]  # an NPU's type is its commonWord
        # 910C: kubelet counts NPUs (dies), a device here is a module of two
        self.ids_per_device = 2 if chip.module_pairs else 1  # type: ignore[misc]

    @property
    def chip(self) -> AscendChip:
        return active_chip(self.common_word)

    def default_names(self, settings: TesseraSettings) -> ResourceNames:
        chip = self.chip
        return ResourceNames(count=chip.resource_name, memory=chip.resource_memory_name,
                             cores=chip.resource_core_name)

    # --- the request ---------------------------------------------------------------------------
    def read_request(
        self, container: Mapping[str, Any], settings: TesseraSettings
    ) -> ContainerRequest | None:
        names = self.resource_names(settings)
        raw = read_raw(container, names, max_cores=4096)
        if raw is None:
            return None
        chip = self.chip
        where = f"container {container.get('name', '?')}: "
        count = raw.count or 1
        if chip.module_pairs:
            if count == 1:
                count = 2
            elif count % 2:
                raise RequestError(f"{where}{names.count}: {count}: {chip.common_word} NPUs come "
                                   "in modules of two dies; ask 1 (rounded up to 2) or an even "
                                   "number")
        if raw.memory is not None and raw.memory < 1:
            raise RequestError(f"{where}{names.memory}: must be at least 1 MiB (leave it out "
                               "for a whole NPU)")
        ai_core = raw.cores or 0
        if count > 1 and raw.memory is not None:
            cut = covering_cut(chip, raw.memory, ai_core)
            if cut is None or not cut.whole:
                raise RequestError(
                    f"{where}{names.count}: {count} with {names.memory}: vNPU templates serve "
                    "one NPU per container; ask for 1 NPU with a memory size, or for whole NPUs "
                    "(leave the memory out)")
        # A memory above every template takes the whole NPU (a 910C: the whole module): the
        # request is then for whole devices, so what is granted (the device's memory) is what
        # it asks, wherever it is checked (the node agent's grant check).
        whole = raw.memory is None or (
            (cut := covering_cut(chip, raw.memory, ai_core)) is not None and cut.whole)
        return ContainerRequest(
            count=count // 2 if chip.module_pairs else count,
            memory_mib=0 if whole else raw.memory,  # type: ignore[arg-type]
            memory_percentage=100 if whole else None,
            cores=ai_core, family=self.name,
        )

    def admit_container(
        self, container: dict[str, Any], label: str, settings: TesseraSettings,
        notes: AdmissionNotes,
    ) -> ContainerRequest | None:
        """HAMi's webhook: the 910C count rounded up to a module, the memory rewritten to the
        template's (a whole NPU's when absent); a request no template covers is warned about (it
        pends with the reason)."""
        request = self.read_request(container, settings)
        if request is None:
            return None
        names = self.resource_names(settings)
        chip = self.chip
        resources = container.setdefault("resources", {})
        limits = resources.setdefault("limits", {})
        requests = resources.get("requests")
        count = request.count * (2 if chip.module_pairs else 1)
        written = limits.get(names.count, (requests or {}).get(names.count))
        if str(written) != str(count):
            limits[names.count] = count
            if isinstance(requests, dict) and names.count in requests:
                requests[names.count] = count
            notes.changes.append(f"{label}: {names.count} set to {count}"
                                 + (" (a 910C module is two NPUs)" if chip.module_pairs else ""))
        memory = None if request.memory_percentage == 100 else request.memory_mib
        cut = covering_cut(chip, memory, request.cores)
        if cut is None:
            notes.warnings.append(f"{label}: {uncovered_reason(chip, memory, request.cores)}; "
                                  "the pod will pend until a chip type that covers it is offered")
            return request
        per_npu = chip.memory_allocatable if cut.whole else cut.memory_mib  # HAMi: per NPU
        what = f"template {cut.template}" if cut.template else "a whole NPU"
        before = limits.get(names.memory, (requests or {}).get(names.memory))
        if str(before) != str(per_npu):
            limits[names.memory] = per_npu
            if isinstance(requests, dict):
                requests[names.memory] = per_npu
            notes.changes.append(f"{label}: {names.memory} {before or 'unset'} → "
                                 f"{per_npu} ({what})")
        # `-core` as written is the AI cores the template must hold; the grant holds the
        # template's. Rewritten to those (per NPU, as the memory), so Kubernetes' ResourceQuota
        # on `requests.<-core>` counts what the pod holds, as it counts the rewritten memory.
        # Not added where the pod does not name it: HAMi reads a `-core` as its soft split.
        cores_before = limits.get(names.cores, (requests or {}).get(names.cores)) \
            if names.cores else None
        per_npu_cores = chip.ai_core if cut.whole else cut.ai_core
        if cores_before is not None and str(cores_before) != str(per_npu_cores):
            limits[names.cores] = per_npu_cores
            if isinstance(requests, dict):
                requests[names.cores] = per_npu_cores
            notes.changes.append(f"{label}: {names.cores} {cores_before} → {per_npu_cores} "
                                 f"({what}'s AI cores)")
        return self.read_request(container, settings)

    def selection(self, annotations: Mapping[str, Any]) -> Selection:
        mode = annotations.get(ann.VNPU_MODE)
        if isinstance(mode, str) and mode.strip().lower() == ann.VNPU_MODE_HAMI_CORE:
            raise RequestError(
                f"annotation {ann.VNPU_MODE}: {mode!r}: Tessera cuts Ascend NPUs with the driver's "
                "vNPU templates only (HAMi's soft hami-core split is not offered); remove the "
                "annotation")
        base = super().selection({k: v for k, v in annotations.items() if k != ann.VNPU_MODE})
        return base

    # --- annotations ---------------------------------------------------------------------------
    def pod_annotations(
        self, containers: Sequence[Sequence[DeviceGrant]], devices: Mapping[str, DeviceInfo]
    ) -> dict[str, str]:
        """HAMi's `huawei.com/<cw>`: each granted NPU with its template ("" = whole)."""
        chip = self.chip
        pairs = [(g.uuid, cut_of_grant(chip, g.memory_mib, g.cores).template)
                 for grants in containers for g in grants]
        return {self.runtime_info_annotation: ann.encode_runtime_info(pairs)} if pairs else {}

    def encode_register(self, devices: Sequence[DeviceInfo]) -> str:
        """HAMi's `hami.io/node-register-<cw>` as HAMi's Ascend device plugin writes it: one
        entry per NPU, `id` its die ID, `devmem`/`devcore` one NPU's, `customInfo.NetworkID`
        on 910 chips. A 910C module lists its two NPUs (`part_ids`), each with half the
        module's memory and AI cores, at indices 2m and 2m+1 (HAMi's scheduler pairs a module's
        NPUs by index / 2)."""
        chip = self.chip
        npus: list[ann.RegisteredNpu] = []
        for d in devices:
            ids = die_ids(d) if chip.module_pairs else [d.uuid]
            for j, uuid in enumerate(ids):
                index = 2 * d.index + j if chip.module_pairs else d.index
                npus.append(ann.RegisteredNpu(
                    uuid=uuid, index=index, count=d.split_count,
                    memory_mib=d.memory_mib // len(ids), ai_core=d.cores // len(ids),
                    type=chip.common_word, healthy=d.healthy, numa=d.numa,
                    network=ann.network_id(chip, index), mode=d.mode))
        return ann.encode_register(npus)


def die_ids(module: DeviceInfo) -> list[str]:
    """A 910C module's two NPUs' IDs: the die IDs its node agent read (`part_ids`), else (a
    registration from before they were kept) Tessera's own names for them."""
    if len(module.part_ids) == 2:
        return list(module.part_ids)
    return [f"{module.uuid}-die{j}" for j in range(2)]
