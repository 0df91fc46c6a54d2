"""The names Tessera's DRA driver publishes under: one home for every string other parts match.

The driver name is the domain of every attribute and capacity it publishes, so a CEL selector
reads them as `device.attributes["gpu.tessera.io"].uuid` and
`device.capacity["gpu.tessera.io"].memory`; the DeviceClass of the same name selects the
driver's devices (`tessera up --dra` installs it, the Helm chart too)."""

from __future__ import annotations

DRIVER_NAME = "gpu.tessera.io"
DEVICE_CLASS = "gpu.tessera.io"  # libvgpu slices of cards in mode hami-core
MIG_DEVICE_CLASS = "mig.gpu.tessera.io"  # MIG partitions of cards in dynamic MIG (KEP-4815)
MPS_DEVICE_CLASS = "mps.gpu.tessera.io"  # slices of cards in mode mps, MPS sharing configured

# Attributes (qualified by the driver name when a selector reads them).
ATTR_UUID = "uuid"
ATTR_INDEX = "index"
ATTR_TYPE = "type"  # HAMi's device type, "NVIDIA-<NVML name>": what nvidia.com/use-gputype matches
ATTR_MODEL = "model"  # the NVML name without the vendor, e.g. "A100-SXM4-80GB"
ATTR_NUMA = "numa"
ATTR_MODE = "mode"  # hami-core, mps (the node configuration's operating mode), mig (a partition)
ATTR_MIG_CAPABLE = "migCapable"
ATTR_DRIVER_VERSION = "driverVersion"
ATTR_MIG_PROFILE = "profile"  # a MIG partition's GPU instance profile, e.g. "1g.10gb"
ATTR_MIG_START = "memorySliceStart"  # the first memory slice of its placement
ATTR_MIG_SLICES = "memorySlices"  # how many memory slices its placement spans

# Capacities.
CAP_MEMORY = "memory"  # bytes, published in MiB steps ("81920Mi")
CAP_CORES = "cores"  # percent of one card's compute, 100 × core scaling in all
CAP_SLOTS = "slots"  # HAMi's split count: how many allocations a card holds; each takes one

# Shared counters of a card in dynamic MIG (KEP-4815): one counter set per card, one counter per
# memory slice (each placement consumes those it spans) and the card's compute slices.
COUNTER_MEMORY_SLICE = "memory-slice-{}"
COUNTER_COMPUTE_SLICES = "compute-slices"

# Opaque device configuration (DeviceClaimConfiguration.opaque.parameters) the driver reads.
CONFIG_API_VERSION = "gpu.tessera.io/v1alpha1"
CONFIG_KIND = "GpuConfig"

# Allocation.reason of a ledger entry a DRA claim made (the driver's prepare, or the ledger's
# rebuild from the claim: tessera.dra_restore).
DRA_REASON = "dra"

# The Node annotation a DRA-mode agent writes: the scheduler extender never places there.
ANN_ALLOCATION_MODE = "tessera.io/allocation-mode"

# The taint an unhealthy GPU carries (KEP-5055 device taints).
TAINT_UNHEALTHY = "gpu.tessera.io/unhealthy"

# CDI: the kind of every device the driver hands kubelet (`<vendor>/<class>=<name>`).
CDI_KIND = "tessera.io/gpu"
CDI_VERSION = "0.6.0"

# The plugin-registration and kubelet plugin API versions the driver serves.
PLUGIN_TYPE = "DRAPlugin"
DRA_SERVICE_VERSIONS = ("v1.DRAPlugin",)


def qualified(name: str) -> str:
    """`gpu.tessera.io/<name>`: how a constraint names one of the driver's attributes."""
    return f"{DRIVER_NAME}/{name}"
