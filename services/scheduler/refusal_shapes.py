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
from itertools import pairwise
from typing import Any

import numpy as np

from tessera.device_kinds.nvidia.slices import SLICES
from tessera.hami import ContainerRequest, PodRequest

from .cards import Card
from .rules import FitContext, card_refusal, check_health, check_type_and_mode, relevant_checks

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
        self._rep: list[Any] = []  # by class: its first device (static checks of a pod's steps)
        self._statics: tuple[np.ndarray, ...] | None = None
        self._reason_ids: dict[str, int] = {}  # a static check's reason -> its id

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
                self._rep.append(d)
                self._statics = None
            classes.append(found)
        # (cards out of index order: a pod's steps pick by index on ties, the row by position)
        ordered = all(a.index < b.index for a, b in pairwise(devices))
        facts = (classes, [(d.uuid, d.split_count) for d in devices],
                 all(d.healthy for d in devices), UNSHAREABLE in classes or not ordered)
        if len(self._of) > 65_536:  # (registrations replaced many times over: start again)
            self._of.clear()
        self._of[id(devices)] = (devices, facts)
        return facts

    def shape(
        self, devices: Sequence[Any], usage: dict[str, list[int]], cordon: frozenset[str],
        blocked: bool,
    ) -> tuple[list[int], int, list[int]]:
        """(the classes of the cards that take pods, in row order; the signature of those that
        take none; the used slots of the first, in the same order) as `_row_of_devices` lays
        the row out; signature `UNSHAREABLE` for a node whose refusals are not grouped (its
        classes then unused: none given)."""
        classes, facts, healthy, unshareable = self._facts(devices)
        if blocked or unshareable:
            return [], UNSHAREABLE, []
        get = usage.get
        if healthy and not cordon:  # (the usual node: only slots can put a card out)
            used = [u[2] if (u := get(uuid)) is not None else 0 for uuid, _split in facts]
            if all(n < split for n, (_uuid, split) in zip(used, facts, strict=True)):
                return classes, 0, used
        usable: list[int] = []
        slots_used: list[int] = []
        others: list[tuple[int, int]] = []
        for d, cls in zip(devices, classes, strict=True):
            found = get(d.uuid)
            slots = found[2] if found is not None else 0
            if not d.healthy:
                others.append((cls, UNHEALTHY))
            elif cordon and d.uuid in cordon:
                others.append((cls, CORDONED))
            elif slots >= d.split_count:
                others.append((cls, EXHAUSTED))
            else:
                usable.append(cls)
                slots_used.append(slots)
        return usable, self.signature(tuple(sorted(others))), slots_used

    def statics(self) -> tuple[np.ndarray, ...]:
        """By class: (memory MiB, cores, split count, libvgpu slices: a pod's steps grouped)."""
        if self._statics is None:
            rep = self._rep
            self._statics = (
                np.asarray([d.memory_mib for d in rep] or [0], dtype=np.int64),
                np.asarray([d.cores for d in rep] or [0], dtype=np.int64),
                np.asarray([d.split_count for d in rep] or [1], dtype=np.int64),
                np.asarray([d.mode.lower() == "hami-core" and Card.from_device(d).kind is SLICES
                            for d in rep] or [False], dtype=bool),
            )  # fmt: skip
        return self._statics

    def static_refusal(self, request: ContainerRequest, options: Any) -> np.ndarray:
        """By class: 0 when a card of it passes the checks that read only what it is (family,
        type and mode against the pod's selection, the kind's cards per container), else 1 +
        the id of the reason it fails with (`static_reasons`)."""
        ctx = FitContext(options)
        checks = [c for c in relevant_checks(request, ctx)
                  if c in (check_health, check_type_and_mode)]  # fmt: skip
        found = []
        for d in self._rep:
            reason = card_refusal(Card.from_device(d), request, ctx, checks)
            if reason is None:
                found.append(0)
                continue
            known = self._reason_ids.get(reason)
            if known is None:
                known = self._reason_ids[reason] = len(self._reason_ids)
            found.append(1 + known)
        return np.asarray(found or [0], dtype=np.int64)

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
        return PodSteps(steps, options), None  # type: ignore[return-value]
    if all(r is None for r in request.init) and not (
        options.numa_bind or "numa" in options.gpu_policies
        or "topology-aware" in options.gpu_policies
    ):  # fmt: skip
        return PodSteps(steps, options), None  # type: ignore[return-value]
    return steps[0], PodRequest(containers=[steps[0]])


class PodSteps:
    """A pod of several app containers (no GPU init container), each picking its cards by the
    GPU policy's order among those that pass, after the ones before it took theirs: grouped by
    the container it fails at and how the cards stand against that one then (`_group_steps`)."""

    __slots__ = ("containers", "options")

    def __init__(self, containers: list[ContainerRequest], options: Any) -> None:
        self.containers, self.options = containers, options


def group(index: Any, slots: np.ndarray, r: ContainerRequest | PodSteps
          ) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    """The candidates grouped by what their refusal of `r` (a container, or a pod's steps
    with its options: `first_step`) depends on: (group by candidate, -1 where not grouped;
    each group's exact key; each group's first candidate)."""
    options = None
    if isinstance(r, PodSteps):
        if len(r.containers) > 1:
            return _group_steps(index, slots, r)
        options, r = r.options, r.containers[0]
    signature = index.unusable_sig[slots]
    classes = index.card_class[slots]
    carded = classes >= 0
    if r.memory_percentage is not None:
        memory_ok = index.card_pct[slots] >= r.memory_percentage
    else:
        memory_ok = index.card_mem[slots] >= r.memory_mib
    cores_ok = index.card_cores[slots] >= r.cores
    computing, idle = index.card_computing[slots], index.card_idle[slots]
    if options is not None:
        codes, _passes = _card_codes(index, np.where(carded, classes, 0), carded, r, options,
                                     memory_ok, cores_ok, computing, idle)  # fmt: skip
    else:
        codes = classes.astype(np.int64) * 16
        codes += memory_ok * 8
        codes += cores_ok * 4
        codes += computing * 2
        codes += idle
        codes[~carded] = -1
    codes.sort(axis=1)
    return _grouped(signature[:, None].astype(np.int64), codes, signature >= 0)


# a card's verdict against a container, in HAMi's check order (`rules.FIT_CHECKS`): 0 takes it
_SLOTS, _MUTEX, _MEMORY, _CORES, _EXCLUSIVE, _COMPUTE, _STATIC = range(1, 8)  # (+ reason id)


def _card_codes(
    index: Any, cls: np.ndarray, carded: np.ndarray, r: ContainerRequest, options: Any,
    memory_ok: np.ndarray, cores_ok: np.ndarray, computing: np.ndarray, idle: np.ndarray,
    exhausted: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(each card's code: what its verdict on `r` depends on, -1 for no card; whether it takes
    `r`). A libvgpu-slices card's code is its verdict: the first of HAMi's checks it fails
    (what `rules.card_refusal` reads of it: its class's static checks, by their reason; slots;
    mutex on a used card; memory; cores; 100 % cores on a used card; no compute left for a
    container asking none), so cards failing at the same check are alike whatever else
    differs (the text counts reasons, and the cards that pass); its class too where the pod
    binds to one NUMA node (the passing cards' NUMA nodes decide). Any other card's code is
    its class and the raw inputs (as `CardClasses` groups them), negative."""
    _memory, cores_of, _split, sliced = index.card_classes.statics()
    # (later checks first, each overwritten by the earlier ones: int16 masks, no select)
    verdict = np.zeros(cls.shape, dtype=np.int16)
    used = ~idle
    if r.cores == 0:
        np.putmask(verdict, (cores_of > 0)[cls] & ~computing, _COMPUTE)
    if r.cores >= 100:
        np.putmask(verdict, used, _EXCLUSIVE)
    np.putmask(verdict, ~cores_ok, _CORES)
    np.putmask(verdict, ~memory_ok, _MEMORY)
    if options.mutex:
        np.putmask(verdict, used, _MUTEX)
    if exhausted is not None:
        np.putmask(verdict, exhausted, _SLOTS)
    static = index.card_classes.static_refusal(r, options)
    if static.any():
        at = static[cls]
        verdict = np.where(at > 0, (_STATIC + at).astype(np.int16), verdict)
    takes = carded & (verdict == 0)
    if options.numa_bind:
        verdict = verdict + cls.astype(np.int64) * 4096
    if not sliced.all():
        raw = memory_ok * 8 + cores_ok * 4 + computing * 2 + idle
        if exhausted is not None:
            raw = np.where(exhausted, 16, raw)
        verdict = np.where(sliced[cls], verdict, -2 - (cls.astype(np.int64) * 64 + raw))
    codes = verdict
    np.putmask(codes, ~carded, -1)
    return codes, takes
    return codes, carded & (verdict == 0)


def _grouped(head: np.ndarray, codes: np.ndarray, where: np.ndarray
             ) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    """Candidates grouped where `where` by their row of `head` (int64) and of `codes`: equal
    rows, one group (a hash of the rows' words; every row then compared with its group's
    first, so no collision merges two groups)."""
    codes = np.ascontiguousarray(codes)
    words = codes.view(np.uint64) if codes.shape[1] * codes.itemsize % 8 == 0 else codes
    hashes = np.zeros(len(codes), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in (*head.T, *words.T):
            hashes = hashes * _MIX + column.astype(np.uint64)
            hashes ^= hashes >> np.uint64(29)
    hashes[~where] = np.uint64(0)
    _unique, first, which = np.unique(hashes, return_index=True, return_inverse=True)
    at = first[which]
    exact = (words == words[at]).all(axis=1) & (head == head[at]).all(axis=1) & where
    groups = np.where(exact, which, -1)
    keys = [head[i].tobytes() + codes[i].tobytes() for i in first.tolist()]
    return groups, keys, first


def _group_steps(index: Any, slots: np.ndarray, steps: PodSteps) -> tuple[np.ndarray, list[bytes],
                                                                             np.ndarray]:
    """`group` for a pod of several app containers. `placement.fit_pod` fits them in order;
    the first that finds too few cards refuses the node with its reasons counted on the
    cards as the containers before it left them (`pick_cards` takes the first `count` of
    those that pass, by the policy's device score, ties by index). Each step's verdicts and
    pick are computed here for every candidate at once from the index's per-card arrays
    (libvgpu slices only: memory, cores, slots, idle, still computing; a class's static
    checks asked of its first device), the cards taken charged as `_take` charges them; a
    node refusing at step j is grouped by (j, its cards' classes and verdict inputs against
    that container then), whose text one fit of the whole pod finds. Nodes that take every
    container are not grouped (the walk fits them)."""
    classes = index.card_class[slots]
    carded = classes >= 0
    signature = index.unusable_sig[slots]
    memory, cores_of, split, sliced = index.card_classes.statics()
    cls = np.where(carded, classes, 0)
    total_mem, total_cores, total_split = memory[cls], cores_of[cls], split[cls]
    alive = (signature >= 0) & (sliced[cls] | ~carded).all(axis=1)
    free_mem = index.card_mem[slots]
    free_cores = index.card_cores[slots]
    used_slots = index.card_slots[slots]
    computing = index.card_computing[slots]
    idle = index.card_idle[slots]
    pct = index.card_pct[slots]
    exhausted = np.zeros(classes.shape, dtype=bool)
    options = steps.options
    signs = [-1.0 if p == "binpack" else 1.0 for p in options.gpu_policies
             if p in ("binpack", "spread")]  # fmt: skip
    w_slot, w_core, w_mem = options.weights
    head = np.full((len(slots), 2), -1, dtype=np.int64)  # (the step failed at, signature)
    codes = np.full(classes.shape, -1, dtype=np.int64)
    refused = np.zeros(len(slots), dtype=bool)
    last = len(steps.containers) - 1
    for j, r in enumerate(steps.containers):
        usable = carded & ~exhausted
        if r.memory_percentage is not None:
            memory_ok = pct >= r.memory_percentage
        else:
            memory_ok = free_mem >= r.memory_mib
        cores_ok = free_cores >= r.cores
        step, passes = _card_codes(index, cls, carded, r, options, memory_ok, cores_ok,
                                   computing, idle, exhausted)  # fmt: skip
        passes &= usable
        count = passes.sum(axis=1)
        fails = alive & (count < r.count)
        if fails.any():
            step.sort(axis=1)
            head[fails, 0] = j
            head[fails, 1] = signature[fails]
            codes[fails] = step[fails]
            refused |= fails
            alive &= ~fails
        if j == last or not alive.any():
            break
        # the cards this container takes where it fits: the first `count` that pass in the
        # policy's order (HAMi's device score, `placement.device_score`, term by term)
        if signs:
            on_card = (total_mem * r.memory_percentage // 100 if r.memory_percentage is not None
                       else np.full(total_mem.shape, r.memory_mib, dtype=np.int64))
            score = np.zeros(classes.shape, dtype=np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                score += np.where(total_split > 0, w_slot * (1 + used_slots) / total_split, 0.0)
                score += np.where(total_cores > 0,
                                  w_core * (r.cores + (total_cores - free_cores)) / total_cores,
                                  0.0)  # fmt: skip
                score += np.where(total_mem > 0,
                                  w_mem * (on_card + (total_mem - free_mem)) / total_mem, 0.0)
            key = signs[0] * (10.0 * score)
        else:
            key = np.zeros(classes.shape, dtype=np.float64)
        key[~passes] = np.inf
        order = np.argsort(key, axis=1, kind="stable")[:, : r.count]
        taken = np.zeros(classes.shape, dtype=bool)
        np.put_along_axis(taken, order, True, axis=1)
        taken &= alive[:, None]
        charge = (total_mem * r.memory_percentage // 100 if r.memory_percentage is not None
                  else r.memory_mib)  # fmt: skip
        free_mem = np.where(taken, free_mem - charge, free_mem)
        free_cores = np.where(taken, free_cores - r.cores, free_cores)
        used_slots = np.where(taken, used_slots + 1, used_slots)
        idle = idle & ~taken
        computing = np.where(taken, (total_cores == 0) | (free_cores > 0), computing)
        with np.errstate(divide="ignore", invalid="ignore"):
            pct = np.where(taken & (total_mem > 0),
                           np.minimum((100 * (free_mem + 1) - 1) // np.maximum(total_mem, 1),
                                      32767), pct)  # fmt: skip
        exhausted |= taken & (used_slots >= total_split)
    return _grouped(head, codes, refused)
