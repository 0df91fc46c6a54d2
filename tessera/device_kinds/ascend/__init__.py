"""Huawei Ascend: one family and one kind (vNPU templates or whole NPUs) per chip type of HAMi's
`vnpus` table (910A, 910B2, 910B3, 910B4, 910B4-1, 310P, 910C). Importing registers them; the
node agent's side registers itself when `tessera.device_kinds.ascend.node` is imported."""

from ..registry import register
from .chips import DEFAULT_CHIPS
from .family import AscendFamily, family_name
from .vnpu import AscendVnpu, mode_of

FAMILIES: dict[str, AscendFamily] = {}
KINDS: dict[str, AscendVnpu] = {}
for _chip in DEFAULT_CHIPS:
    _family = AscendFamily(_chip)
    FAMILIES[_family.name] = _family
    KINDS[_family.name] = AscendVnpu(_family)
    register(_family, KINDS[_family.name])

__all__ = ["FAMILIES", "KINDS", "AscendFamily", "AscendVnpu", "family_name", "mode_of"]
from . import node as _node  # noqa: E402,F401  (the node agent's side registers itself)
