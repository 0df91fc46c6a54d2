"""CPU of the scheduler's ledger write path per pod on one node of N allocations (issue 14,
Scale): the reservation (claimed ahead) and the bind encoded and applied to the index, the
agent's Allocate read off the wire (codec) and applied. No NATS, no HTTP: only the codec
(`ledger_codec.py`) and the index (`index.set_ledger`, `node_usage.py`), as the scheduler runs
them, the cyclic GC off as between the scheduler's calls.

    python bench/ledger_write_cost.py [N] [pods]      # defaults 80 allocations, 1000 pods

Prints microseconds of CPU (thread time) per pod, for the two ways a bind records itself
(issue 35): `bound mark written` (the bind writes `bound`: 2 encodes, 1 read of the agent's
write, 3 applies) and `bound mark left to the Allocate` (binding.PodBinder._leave_mark: 1
encode, 1 read, 2 applies; the KV write, its ack and its echo to every watcher, which this does
not count, are saved too). The two alternate pod by pod. For before/after comparisons on a
shared machine run it several times and compare medians. Printed, not recorded.
"""

from __future__ import annotations

import gc
import sys
import time

from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.ledger import bound_mutate
from tessera.scheduler.ledger_codec import LedgerCodec

from tessera.codec import encode
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    InFlightClaim,
    NodeLedger,
    NodeRegistration,
)

NOW = 1000.0


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    pods = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    gc.disable()
    devices = [DeviceInfo(uuid=f"GPU-{i}", index=i, type="H100", memory_mib=81920, cores=100,
                          split_count=100) for i in range(8)]  # fmt: skip
    registration = NodeRegistration(node="n1", devices=devices)

    def allocation(uid: str, gpu: int, state: AllocationState, **kw: object) -> Allocation:
        grant = DeviceGrant(uuid=devices[gpu].uuid, type="H100", memory_mib=1000, cores=1)
        return Allocation(pod_uid=uid, namespace="ns", name=uid, node="n1",
                          containers=[[grant]], state=state, **kw)  # type: ignore[arg-type]  # fmt: skip

    current = NodeLedger(node="n1", allocations={
        f"p{i}": allocation(f"p{i}", i % 8, AllocationState.ALLOCATED) for i in range(size)
    })  # fmt: skip
    spent = {"bound mark written": 0.0, "bound mark left to the Allocate": 0.0}
    setups = {mode: (ClusterIndex(), LedgerCodec(), current) for mode in spent}
    for index, _, _ in setups.values():
        index.set_registration("n1", registration, NOW)
    revision = 1
    for n in range(pods):
        for mode in spent:
            index, codec, current = setups[mode]
            uid = f"x{n}"
            allocations = dict(current.allocations)
            allocations.pop(f"x{n - 1}", None)  # the previous pod gone: the node stays at N
            allocations[uid] = allocation(uid, 0, AllocationState.RESERVED, expires_at=NOW + 30)
            claim = InFlightClaim(pod_uid=uid, namespace="ns", name=uid, taken_at=NOW,
                                  expires_at=NOW + 30)  # fmt: skip
            reserved = current.model_copy(
                update={"allocations": allocations, "claims": {uid: claim}, "claim": None})
            written = mode == "bound mark written"
            bound = bound_mutate(uid, NOW, reserved) if written else reserved
            done = dict(bound.allocations)
            done[uid] = done[uid].model_copy(update={"state": AllocationState.ALLOCATED})
            allocate = encode(bound.model_copy(update={"allocations": done, "claims": {}}))
            started = time.thread_time()
            codec.encode(reserved)
            index.set_ledger("n1", reserved, revision := revision + 1, NOW)
            if written:
                codec.encode(bound)
                index.set_ledger("n1", bound, revision := revision + 1, NOW)
            current = codec.read("n1", allocate)  # type: ignore[assignment]
            index.set_ledger("n1", current, revision := revision + 1, NOW)
            spent[mode] += time.thread_time() - started
            setups[mode] = (index, codec, current)
    for mode, seconds in spent.items():
        print(f"N={size}, {mode}: {seconds / pods * 1e6:.1f} us of CPU per pod")


if __name__ == "__main__":
    main()
