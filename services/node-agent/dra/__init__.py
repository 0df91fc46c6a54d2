"""Tessera's DRA driver (`gpu.tessera.io`): the node agent as a kubelet DRA plugin (docs/dra.md).

    slices     the node's GPUs as the slices of its pool (pure)
    partitions a card in dynamic MIG as partitionable devices with shared counters (pure)
    config     the driver's opaque configuration: TimeSlicing or MPS sharing (pure)
    claims     what an allocated claim gives which containers (pure)
    accounting DRA claims as ledger allocations (pure CAS bodies)
    cdi        the CDI specs of prepared claims
    records    what was prepared, one file per claim
    driver     NodePrepareResources / NodeUnprepareResources (MIG instances, MPS daemons)
    endpoint   plugin registration, the dra.v1 and dra-health services, slice publishing
    runner     how the node agent starts it (`TESSERA_DRA=true`)
"""

from .driver import DraDriver, PrepareError
from .endpoint import DraEndpoint
from .runner import start_driver
from .settings import DraSettings

__all__ = ["DraDriver", "DraEndpoint", "DraSettings", "PrepareError", "start_driver"]
