"""NVIDIA: one family, three kinds (libvgpu slices, MIG, MPS). Importing registers them."""

from ..registry import register
from .family import FAMILY, NVIDIA, NvidiaFamily
from .mig import MIG, NvidiaMig
from .mps import MPS, NvidiaMps
from .slices import SLICES, NvidiaSlices

register(NVIDIA, SLICES, MIG, MPS)

__all__ = ["FAMILY", "MIG", "MPS", "NVIDIA", "SLICES", "NvidiaFamily", "NvidiaMig", "NvidiaMps",
           "NvidiaSlices"]
from . import node as _node  # noqa: E402,F401  (the node agent's side registers itself)
