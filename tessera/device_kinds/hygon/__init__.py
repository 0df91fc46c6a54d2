"""Hygon DCU: the `dcu` family and its kind (vDCUs or whole DCUs). Importing registers them;
the node agent's side registers itself when `tessera.device_kinds.hygon.node` is imported."""

from ..registry import register
from .family import DCU, FAMILY, HygonFamily
from .vdcu import VDCU, HygonVdcu

register(DCU, VDCU)

__all__ = ["DCU", "FAMILY", "VDCU", "HygonFamily", "HygonVdcu"]
from . import node as _node  # noqa: E402,F401  (the node agent's side registers itself)
