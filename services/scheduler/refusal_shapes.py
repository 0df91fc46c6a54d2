"""Why a request is refused, read per node shape instead of fitted node by node (pure, numpy).

A refused pod's call words every candidate's reason (HAMi's `N/M Reason, ...`), and a pod
kube-scheduler cannot place comes back after its backoff with another list. Fitting every
candidate for that is O(nodes) per-GPU work (~30 µs a node: 0.15 s at 5,000 nodes), and the
per-node memo (`refusal_memo.py`) helps only where the nodes did not change since the last
refusal of that request, which in a busy cluster is few of them.

But a node's refusal of a request with one GPU container (one container fitted once: no
sidecar, no second container fitted on what the first took) depends on its cards only
through, per card, its static class (type, mode, NUMA node, memory, cores, split count,
health: `CardClasses`) and how the card stands against that container: for a card that still
takes pods, whether its free memory (or %) holds the container's, whether its free cores do,
whether it still computes and whether it is idle (the index's per-card arrays, exact:
`index.free_percentage`); for a card that takes none, why (unhealthy, cordoned, out of slots).
HAMi's per-GPU checks read nothing else of a card for such a request, the count of cards that
pass decides "too few cards", and NUMA binding groups by the class's NUMA node: so nodes with
the same multiset of (class, verdict inputs) get the same text. Each call groups its
candidates by that multiset (vectorised: a code per card, sorted per node, hashed, and every
node compared with its group's first so no hash collision can merge two groups), and fits
one node per group not yet known for the request (`RefusalMemo.shapes`, keyed by the exact
bytes): a first refusal fits a handful of nodes, not every one. In a homogeneous cluster the
groups are few whatever the usage, because the inputs are verdicts relative to the request.

A pod of several fitted containers (the second sees what the first took) is grouped by its
first container: a node refusing that one refuses the pod with its reasons (`first_step`); the
nodes that take it are fitted node by node. Not shared (per node, as before): nodes with MIG
cards, HAMi's pods or a blocked row, pods naming GPU UUIDs, and a quota budget (the per-card
quota check reads the budget as it is spent). `tests/scheduler/test_refusal_shapes.py`,
`test_decision_reference.py` compare every reason with fitting each node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tessera.hami import ContainerRequest, PodRequest

UNSHAREABLE = -1  # a card class (or a node's unusable signature) that is never grouped
# The sharing modes whose per-GPU checks read only what a code holds (NVIDIA's libvgpu slices
# and MPS: memory and cores against the request's, slots, health, cordon, type and mode). A
# card of any other mode (MIG: instances; another vendor's kind: its own capacity rules, e.g.
# templates) is never grouped: its node is fitted node by node.
GROUPED_MODES = frozenset({"hami-core", "mps"})
# why a card takes no pod, in HAMi's check order (health, cordon, then slots)
UNHEALTHY, CORDONED, EXHAUSTED = 1, 2, 3
_MIX = np.uint64(0x9E3779B97F4A7C15)


class CardClasses:
    """Interned static classes of cards and signatures of a node's cards that take no pod."""

    def __init__(self) -> None:
        self._classes: dict[tuple, int] = {}
        self._signatures: dict[tuple, int] = {(): 0}
        self._of: dict[int, tuple[Any, Any]] = {}  # id(devices) -> (devices, `_facts`)

    def of(self, devices: Sequence[Any]) -> list[int]:
        """Each device's class (`UNSHAREABLE` for a card of a mode not in `GROUPED_MODES`, or
        a dynamic-MIG card: its fit reads its instances)."""
        return self._facts(devices)[0]

    def _facts(self, devices: Sequence[Any]) -> tuple[list[int], list[tuple[str, int]], bool, bool]:
        """(classes, (uuid, split count) per device, every device healthy, any unshareable),
        kept per devices list (a registration's heartbeats keep the same list)."""
        kept = self._of.get(id(devices))
        if kept is not None and kept[0] is devices:
            return kept[1]
        classes = []
        for d in devices:
            mig = getattr(d, "mig", None)
            if d.mode.lower() not in GROUPED_MODES or (mig is not None and mig.model):
                classes.append(UNSHAREABLE)
                continue
            key = (d.type, d.mode, d.numa, d.memory_mib, d.cores, d.split_count, d.healthy)
            found = self._classes.get(key)
            if found is None:
                found = self._classes[key] = len(self._classes)
            classes.append(found)
        facts = (classes, [(d.uuid, d.split_count) for d in devices],
                 all(d.healthy for d in devices), UNSHAREABLE in classes)  # fmt: skip
        if len(self._of) > 65_536:  # (registrations replaced many times over: start again)
            self._of.clear()
        self._of[id(devices)] = (devices, facts)
        return facts

    def shape(
        self, devices: Sequence[Any], usage: dict[str, list[int]], cordon: frozenset[str],
        blocked: bool,
    ) -> tuple[list[int], int]:
        """(the classes of the cards that take pods, in row order; the signature of those that
        take none) as `_row_of_devices` lays the row out; signature `UNSHAREABLE` for a node
        whose refusals are not grouped (its classes then unused: none given)."""
        classes, facts, healthy, unshareable = self._facts(devices)
        if blocked or unshareable:
            return [], UNSHAREABLE
        get = usage.get
        if healthy and not cordon:  # (the usual node: only slots can put a card out)
            full = [i for i, (uuid, split) in enumerate(facts)
                    if (used := get(uuid)) is not None and used[2] >= split]  # fmt: skip
            if not full:
                return classes, 0
        usable: list[int] = []
        others: list[tuple[int, int]] = []
        for d, cls in zip(devices, classes, strict=True):
            used = get(d.uuid)
            slots = used[2] if used is not None else 0
            if not d.healthy:
                others.append((cls, UNHEALTHY))
            elif cordon and d.uuid in cordon:
                others.append((cls, CORDONED))
            elif slots >= d.split_count:
                others.append((cls, EXHAUSTED))
            else:
                usable.append(cls)
        return usable, self.signature(tuple(sorted(others)))

    def signature(self, others: tuple[tuple[int, int], ...]) -> int:
        found = self._signatures.get(others)
        if found is None:
            found = self._signatures[others] = len(self._signatures)
        return found


def first_step(
    request: PodRequest, options: Any, budget: Any
) -> tuple[ContainerRequest, PodRequest | None] | None:
    """The first container fitted for this pod when its refusals may be grouped, and None or,
    for a pod of several fitted containers, that container as a pod of its own: a node that
    refuses the first container refuses the pod with exactly that container's reasons (the fit
    stops there: `placement.fit_pod`), the others are fitted node by node. None when nothing
    is grouped (GPU UUIDs named, or a quota budget: the per-card quota check reads the budget
    as the pod's containers spend it)."""
    if options.use_uuids or options.nouse_uuids:
        return None
    if budget.memory_mib is not None or budget.cores is not None:
        return None
    steps = [r for r in request.all if r is not None]
    if not steps:
        return None
    if len(steps) == 1:
        return steps[0], None
    return steps[0], PodRequest(containers=[steps[0]])


def group(index: Any, slots: np.ndarray, r: ContainerRequest) -> tuple[np.ndarray, list[bytes],
                                                                           np.ndarray]:
    """The candidates grouped by what their refusal of `r` depends on: (group by candidate,
    -1 where not grouped; each group's exact key; each group's first candidate)."""
    signature = index.unusable_sig[slots]
    classes = index.card_class[slots]
    carded = classes >= 0
    if r.memory_percentage is not None:
        memory_ok = index.card_pct[slots] >= r.memory_percentage
    else:
        memory_ok = index.card_mem[slots] >= r.memory_mib
    codes = classes.astype(np.int64) * 16
    codes += memory_ok * 8
    codes += (index.card_cores[slots] >= r.cores) * 4
    codes += index.card_computing[slots] * 2
    codes += index.card_idle[slots]
    codes[~carded] = -1
    codes.sort(axis=1)
    codes = np.concatenate((signature[:, None].astype(np.int64), codes), axis=1)
    hashes = np.zeros(len(slots), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in codes.T:
            hashes = hashes * _MIX + column.astype(np.uint64)
            hashes ^= hashes >> np.uint64(29)
    shareable = signature >= 0
    _unique, first, which = np.unique(hashes, return_index=True, return_inverse=True)
    exact = (codes == codes[first[which]]).all(axis=1) & shareable
    groups = np.where(exact, which, -1)
    keys = [codes[i].tobytes() for i in first.tolist()]
    return groups, keys, first
