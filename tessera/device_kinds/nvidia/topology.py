"""NVIDIA facts the node side reads devices by: HAMi's link scores from NVML's topology levels
and NVLinks, and which NVML events make a GPU unhealthy. Pure."""

from __future__ import annotations

# NVML topology levels (nvmlGpuTopologyLevel_t) → HAMi's link scores (higher = closer).
TOPOLOGY_INTERNAL = 0  # same board
TOPOLOGY_SINGLE = 10  # one PCIe switch
TOPOLOGY_MULTIPLE = 20  # several PCIe switches
TOPOLOGY_HOSTBRIDGE = 30  # the same host bridge
TOPOLOGY_NODE = 40  # the same CPU (NUMA node)
TOPOLOGY_SYSTEM = 50  # across CPUs
LEVEL_SCORES = {
    TOPOLOGY_SYSTEM: 10,
    TOPOLOGY_NODE: 20,
    TOPOLOGY_HOSTBRIDGE: 30,
    TOPOLOGY_MULTIPLE: 40,
    TOPOLOGY_SINGLE: 50,
    TOPOLOGY_INTERNAL: 60,
}
NVLINK_SCORE = 100

# NVML event types the node agent watches.
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID_CRITICAL = 0x8


def link_score(topology_level: int | None, nvlinks: int) -> int:
    """HAMi's score of a GPU pair: 100 per NVLink, else by the PCIe relation."""
    if nvlinks > 0:
        return NVLINK_SCORE * nvlinks
    if topology_level is None:
        return LEVEL_SCORES[TOPOLOGY_SYSTEM]
    return LEVEL_SCORES.get(topology_level, LEVEL_SCORES[TOPOLOGY_SYSTEM])


def is_critical(event_type: int, xid: int, ignored_xids: frozenset[int]) -> bool:
    """Does this NVML event make a GPU unhealthy? (single-bit ECC errors are corrected)."""
    if event_type & EVENT_XID_CRITICAL:
        return xid not in ignored_xids
    return bool(event_type & EVENT_DOUBLE_BIT_ECC)


def describe_fault(uuid: str | None, cause: str, code: int) -> str:
    """A sentence for a fault: `XID 79 on GPU-…`, a double-bit ECC error, a GPU off the bus."""
    target = uuid or "all GPUs"
    if cause == "xid":
        return f"XID {code} on {target}"
    if cause == "ecc":
        return f"double-bit ECC error on {target}"
    return f"{target} fell off the bus"
