"""The names Tessera's DRA driver publishes under: one home for every string other parts match.

The driver name is the domain of every attribute and capacity it publishes, so a CEL selector
reads them as `device.attributes["gpu.tessera.io"].uuid` and
`device.capacity["gpu.tessera.io"].memory`; the DeviceClass of the same name selects the
driver's devices (`tessera up --dra` installs it, the Helm chart too)."""

from __future__ import annotations

DRIVER_NAME = "gpu.tessera.io"
DEVICE_CLASS = "gpu.tessera.io"

# Attributes (qualified by the driver name when a selector reads them).
ATTR_UUID = "uuid"
ATTR_INDEX = "index"
ATTR_TYPE = "type"  # HAMi's device type, "NVIDIA-<NVML name>": what nvidia.com/use-gputype matches
ATTR_MODEL = "model"  # the NVML name without the vendor, e.g. "A100-SXM4-80GB"
ATTR_NUMA = "numa"
ATTR_MODE = "mode"  # hami-core, mps (the node configuration's operating mode)
ATTR_MIG_CAPABLE = "migCapable"
ATTR_DRIVER_VERSION = "driverVersion"

# Capacities.
CAP_MEMORY = "memory"  # bytes, published in MiB steps ("81920Mi")
CAP_CORES = "cores"  # percent of one card's compute, 100 × core scaling in all
CAP_SLOTS = "slots"  # HAMi's split count: how many allocations a card holds; each takes one

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
