"""Which family a simulated node's model belongs to (`tessera up --nodes-file`, the node agent's
static source): an Ascend chip type or chip name (`Ascend910B3`, `910B3`), a Cambricon card
(`MLU370-X4`, `MLU590`), a Hygon DCU (`Z100L`, `K100_AI`, `DCU-Z100`); anything else is an
NVIDIA GPU. Pure."""

from __future__ import annotations

from .ascend.chips import active_chips, chip_for_name, chip_for_type
from .ascend.family import family_name

NVIDIA = "nvidia"
MLU = "mlu"
DCU = "dcu"
DCU_MODELS = ("Z100", "Z100L", "K100", "K100_AI")


def family_for_model(model: str) -> str:
    text = model.strip()
    chips = active_chips()
    chip = chip_for_type(chips, text) or chip_for_name(chips, text)
    if chip is not None:
        return family_name(chip.common_word)
    if text.upper().startswith("MLU"):
        return MLU
    if text.upper().startswith("DCU-") or text.upper() in DCU_MODELS:
        return DCU
    return NVIDIA


def is_vendor_model(model: str) -> bool:
    return family_for_model(model) != NVIDIA


def node_labels(model: str) -> dict[str, str]:
    """The labels HAMi's docs have an operator put on a vendor's nodes (Ascend:
    `accelerator=huawei-Ascend910` / `huawei-Ascend310P`; MLU: `mlu=on`; DCU: `dcu=on`);
    NVIDIA's `gpu=on`."""
    family = family_for_model(model)
    if family == MLU:
        return {"mlu": "on"}
    if family == DCU:
        return {"dcu": "on"}
    if family != NVIDIA:
        return {"accelerator": "huawei-Ascend310P" if "310" in family else "huawei-Ascend910",
                "ascend": "on"}
    return {"gpu": "on"}


NVIDIA_REGISTER = "hami.io/node-nvidia-register"


def node_registered(node: dict, model: str) -> bool:
    """Whether a Node object shows its node agent registered the devices of `model`: NVIDIA's
    register annotation, else kubelet's allocatable of the vendor family's count resource
    (a Cambricon node has no HAMi register annotation)."""
    meta = node.get("metadata") or {}
    family = family_for_model(model)
    if family == NVIDIA:
        return NVIDIA_REGISTER in (meta.get("annotations") or {})
    from tessera.settings import TesseraSettings

    from . import registry

    count = registry.names_of(family, TesseraSettings()).count
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    try:
        return int(str(allocatable.get(count, "0"))) > 0
    except ValueError:
        return False
