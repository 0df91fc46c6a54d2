"""Cambricon MLU (370, 590): the `mlu` family and its kind (sMLU shares or whole MLUs).
Importing registers them; the node agent's side registers itself when
`tessera.device_kinds.cambricon.node` is imported."""

from ..registry import register
from .family import FAMILY, MLU, CambriconFamily
from .smlu import SMLU, CambriconSmlu

register(MLU, SMLU)

__all__ = ["FAMILY", "MLU", "SMLU", "CambriconFamily", "CambriconSmlu"]
from . import node as _node  # noqa: E402,F401  (the node agent's side registers itself)
