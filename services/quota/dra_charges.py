"""Running DRA pods' charges, read back from their ResourceClaims after the quota state was lost.

A pod the DRA allocator placed carries no HAMi annotations, so `charges_from_pods` (which reads
those) would forget its charge until the scheduler's restored ledger entry reaches the reconcile
pass; read from its claims (`tessera.dra_restore`, the driver's own reading of a claim, against
the node's registered GPUs) the charge is back in the same rebuild as every other pod's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nats.js.kv import KeyValue

from tessera import bus
from tessera.cluster.resources_port import list_claims_if_served
from tessera.dra_restore import allocations_from_claims, claim_nodes, pods_with_claims
from tessera.models import Allocation, DeviceInfo, NodeRegistration
from tessera.restore import RestoreReport


async def dra_allocations(cluster: Any, nodes: KeyValue, pods: Iterable[Any], now: float,
                          report: RestoreReport) -> list[Allocation]:  # fmt: skip
    """The allocations of the running DRA pods among `pods` (none without such pods)."""
    wanted = pods_with_claims(pods)
    if not wanted:
        return []
    claims = await list_claims_if_served(cluster)
    pools = claim_nodes(claims)
    on = {str(p["spec"].get("nodeName")) for p in wanted.values()
          if p["spec"].get("nodeName") in pools}  # fmt: skip
    devices: dict[str, list[DeviceInfo]] = {}
    for node in sorted(on):
        entry = await bus.read(nodes, node, NodeRegistration)
        if entry is not None:
            devices[node] = list(entry.value.devices)
    by_node = allocations_from_claims(claims, wanted, devices.get, quota_held=True, now=now,
                                      report=report)  # fmt: skip
    return [allocation for found in by_node.values() for allocation, _claim in found]
