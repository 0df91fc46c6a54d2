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
For a libvgpu-slices card what counts is only the first of HAMi's checks it fails (its
class's static checks by their reason, slots, mutex, memory, cores, exclusive use, compute
left: `card_codes`), plus its class where the pod binds to one NUMA node: the text counts
reasons and the cards that pass. So nodes with the same multiset of card codes get the same
text. Each call groups its candidates by that multiset (vectorised: a code per card, sorted
per node, hashed, and every node compared with its group's first so no hash collision can
merge two groups), and fits one node per group not yet known for the request
(`RefusalMemo.shapes`, keyed by the exact bytes): a first refusal fits a handful of nodes,
not every one. In a homogeneous cluster the groups are few whatever the usage, because the
codes are verdicts relative to the request.

A pod of several app containers (`PodSteps`: no GPU init container, no NUMA or topology
policy) is fitted container after container, each taking the first `count` of the cards that
pass by HAMi's device score (ties by index) on what the ones before it left: `group_steps`
computes, for every candidate at once, each step's verdicts and pick from the index's arrays
(its used slots per card included) and charges the cards taken as `placement._take` does; a
node is grouped by the step it fails at and its cards' codes against that container then.
Other pods of several containers are grouped by their first container (a node refusing it
refuses the pod with its reasons; the nodes that take it are fitted node by node). Not
shared (per node, as before): nodes with MIG cards, HAMi's pods, a blocked row or cards out
of index order, pods naming GPU UUIDs, and a quota budget (the per-card quota check reads the
budget as it is spent). `tests/scheduler/test_refusal_shapes.py`, `test_refusal_fast.py`,
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
from .native_steps import NativeSteps
from .refusal_steps import PodSteps, card_codes, group_steps, grouped
from .rules import FitContext, card_refusal, check_health, check_type_and_mode, relevant_checks
from .shape_texts import ShapeTexts

UNSHAREABLE = -1  # a card class (or a node's unusable signature) that is never grouped
# The sharing modes whose per-GPU checks read only what a code holds (NVIDIA's libvgpu slices
# and MPS: memory and cores against the request's, slots, health, cordon, type and mode). A
# card of any other mode (MIG: instances; another vendor's kind: its own capacity rules, e.g.
# templates) is never grouped: its node is fitted node by node.
GROUPED_MODES = frozenset({"hami-core", "mps"})
# why a card takes no pod, in HAMi's check order (health, cordon, then slots)
UNHEALTHY, CORDONED, EXHAUSTED = 1, 2, 3


class CardClasses:
    """Interned static classes of cards and signatures of a node's cards that take no pod."""

    def __init__(self) -> None:
        self._classes: dict[tuple, int] = {}
        self._signatures: dict[tuple, int] = {(): 0}
        self._of: dict[int, tuple[Any, Any]] = {}  # id(devices) -> (devices, `_facts`)
        self._rep: list[Any] = []  # by class: its first device (static checks of a pod's steps)
        self._statics: tuple[np.ndarray, ...] | None = None
        self._sans_numa: np.ndarray | None = None  # (`sans_numa`)
        self._texts_for: list[bool] = []  # by class: libvgpu slices (`shared_key`)
        self._reason_ids: dict[str, int] = {}  # a static check's reason -> its id
        self._reason_names: list[str] = []  # (by id)
        self._rep_cards: list[Card] = []  # `_rep` as cards (static checks only read them)
        # (request, id(options)) -> (options, `static_refusal`): the checks read only the
        # request's family and count and the options' selections (`rules.check_health`,
        # `check_type_and_mode`); a new class makes it longer, so asked again
        self._static: dict[tuple, tuple[Any, np.ndarray]] = {}
        # a shape's text whatever the request (`shared_texts`, `shared_key`): (text, reason
        # names), or None where the shape takes the container
        self.texts: dict[tuple, dict[tuple, tuple[str, tuple[str, ...]] | None]] = {}

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

    def sans_numa(self) -> np.ndarray:
        """By class: a number equal for classes that differ only in their NUMA node."""
        if self._sans_numa is None or len(self._sans_numa) != max(1, len(self._rep)):
            found: dict[tuple, int] = {}
            self._sans_numa = np.asarray(
                [found.setdefault((d.type, d.mode, d.memory_mib, d.cores, d.split_count,
                                   d.healthy), len(found)) for d in self._rep] or [0],
                dtype=np.int64)  # fmt: skip
        return self._sans_numa

    def static_refusal(self, request: ContainerRequest, options: Any) -> np.ndarray:
        """By class: 0 when a card of it passes the checks that read only what it is (family,
        type and mode against the pod's selection, the kind's cards per container), else 1 +
        the id of the reason it fails with (`static_reasons`)."""
        key = (request, id(options))
        kept = self._static.get(key)
        if kept is not None and kept[0] is options and len(kept[1]) == max(1, len(self._rep)):
            return kept[1]
        ctx = FitContext(options)
        checks = [c for c in relevant_checks(request, ctx)
                  if c in (check_health, check_type_and_mode)]  # fmt: skip
        if len(self._rep_cards) < len(self._rep):
            self._rep_cards += [Card.from_device(d) for d in self._rep[len(self._rep_cards):]]
        found = []
        for card in self._rep_cards:
            reason = card_refusal(card, request, ctx, checks)
            if reason is None:
                found.append(0)
                continue
            known = self._reason_ids.get(reason)
            if known is None:
                known = self._reason_ids[reason] = len(self._reason_ids)
                self._reason_names.append(reason)
            found.append(1 + known)
        array = np.asarray(found or [0], dtype=np.int64)
        if len(self._static) > 256:
            self._static.clear()
        self._static[key] = (options, array)  # (the options object kept: its id stays its own)
        return array

    def static_reason(self, reason_id: int) -> str | None:
        """The reason of a static check by its id (`static_refusal`), None for no such id."""
        names = self._reason_names
        return names[reason_id] if 0 <= reason_id < len(names) else None

    def shared_texts(
        self, steps: PodSteps
    ) -> dict[tuple, tuple[str, tuple[str, ...]] | None] | None:
        """The shapes' texts shared by every request whose pod reads them alike (`shared_key`
        within), for this pod's steps: a shape's text is the same for every request when every
        class the index knows is libvgpu slices, so each card's code is its verdict (the first
        of HAMi's checks it fails: the same check, the same reason, whatever the request) and
        the text is HAMi's count of those reasons over the node's cards, with the cards that
        pass counted as too few against the failing container's `count`. The pod's
        selections, mutex, NUMA binding and whether it has several containers decide the
        static checks and the wording: one table each (hashed once a call, not once a shape).
        A shape the table does not hold yet is worded from its key where the key says it all
        (`shape_texts.ShapeTexts`: its `in` words it), else fitted by the caller. None where
        codes are raw inputs (another card kind)."""
        if len(self._texts_for) != len(self._rep):
            self._texts_for = [bool(x) for x in self.statics()[3]]
        if not all(self._texts_for):
            return None
        options = steps.options
        alike = (options.selections, options.mutex, options.numa_bind, len(steps.containers) > 1)
        found = self.texts.get(alike)
        if found is None or len(found) > 65_536:
            if len(self.texts) > 256:
                self.texts.clear()
            found = self.texts[alike] = ShapeTexts(self.static_reason, alike[3], alike[2])
        return found

    @staticmethod
    def shared_key(steps: PodSteps, key: bytes) -> tuple | None:
        """A shape's key (`group`'s, of a pod's steps) in its `shared_texts` table: the failing
        container's family and count (its static checks and the count the text compares
        with), and the key; None where the key names no step of this pod."""
        containers = steps.containers
        step = 0 if len(containers) == 1 else int.from_bytes(key[:8], "little", signed=True)
        if not 0 <= step < len(containers):
            return None
        r = containers[step]
        return (r.family, r.count, key)

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
    ) and max(options.weights) <= _EXACT_WEIGHT:  # fmt: skip
        return PodSteps(steps, options), None  # type: ignore[return-value]
    return steps[0], PodRequest(containers=[steps[0]])


# The largest scoring weight whose device scores a pod's steps compute exactly as Python's
# (`group_steps`: int64 products, doubles; `placement.device_score`: Python's ints, a correctly
# rounded quotient): a weight times a card's memory in MiB stays below 2^53 for cards of up to
# 2^32 MiB. A pod weighing more (HAMi takes any integer) is grouped by its first container.
_EXACT_WEIGHT = 1 << 20


_DISTINCT_FROM = 64  # candidates from which each distinct row (`RowStates`) is read once


def group(index: Any, slots: np.ndarray, r: ContainerRequest | PodSteps
          ) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    """The candidates grouped by what their refusal of `r` (a container, or a pod's steps
    with its options: `first_step`) depends on: (group by candidate, -1 where not grouped;
    each group's exact key; each group's first candidate).

    Each distinct row (`refusal_states.RowStates`: the same card states and signature) is
    read once, its candidates given its group; a pod's steps that chose between unlike cards
    by index on a row (`group_steps`' ties) read that row's other candidates one by one."""
    if len(slots) < _DISTINCT_FROM:
        return _group(index, slots, r)
    distinct = index.row_states.distinct(index, slots)
    if distinct is None:  # (few alike: read as they are)
        return _group(index, slots, r)
    reps, of_rep = distinct  # (each candidate's distinct row, by its place in `reps`)
    steps = isinstance(r, PodSteps) and len(r.containers) > 1
    ties = np.zeros(len(reps), dtype=bool) if steps else None
    rep_groups, keys, rep_first = _group(index, slots[reps], r, ties)
    groups = rep_groups[of_rep]
    first = reps[rep_first]
    if ties is None or not ties.any():
        return groups, keys, first
    apart = ties[of_rep]
    apart[reps] = False  # (the distinct rows themselves were read as they are)
    at = np.flatnonzero(apart)
    if not len(at):
        return groups, keys, first
    more_groups, more_keys, more_first = _group(index, slots[at], r)
    known = {key: g for g, key in enumerate(keys)}
    first = first.tolist()
    renumber = np.full(len(more_keys) + 1, -1, dtype=np.int64)  # (the last: not grouped)
    for g, key in enumerate(more_keys):
        found = known.get(key)
        position = int(at[more_first[g]])
        if found is None:
            found = known[key] = len(keys)
            keys.append(key)
            first.append(position)
        elif position < first[found]:
            first[found] = position
        renumber[g] = found
    groups[at] = renumber[more_groups]  # (-1 indexes the last entry: not grouped)
    return groups, keys, np.asarray(first, dtype=np.int64)


def _group(index: Any, slots: np.ndarray, r: ContainerRequest | PodSteps,
           ties: np.ndarray | None = None) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    """`group` of every candidate as it is (`ties`: `group_steps`')."""
    options = None
    if isinstance(r, PodSteps):
        if len(r.containers) > 1:
            return group_steps(index, slots, r, ties)
        native = NativeSteps.load()  # (the codes and groups in C: the same, see below)
        found = native.steps(index, slots, r, None, every_row=True) if native else None
        if found is not None:
            signature = index.unusable_sig.take(slots, axis=0)
            done = native.group(signature[:, None].astype(np.int64), found[2],  # type: ignore[union-attr]
                                signature >= 0, np.int16)  # fmt: skip
            if done is not None:
                return done
        options, r = r.options, r.containers[0]
    signature = index.unusable_sig.take(slots, axis=0)
    classes = index.card_class.take(slots, axis=0)
    carded = classes >= 0
    if r.memory_percentage is not None:
        memory_ok = index.card_pct.take(slots, axis=0) >= r.memory_percentage
    else:
        memory_ok = index.card_mem.take(slots, axis=0) >= r.memory_mib
    cores_ok = index.card_cores.take(slots, axis=0) >= r.cores
    computing, idle = index.card_computing.take(slots, axis=0), index.card_idle.take(slots, axis=0)
    if options is not None:
        codes, _passes = card_codes(index, np.where(carded, classes, 0), carded, r, options,
                                     memory_ok, cores_ok, computing, idle)  # fmt: skip
    else:
        codes = classes.astype(np.int64) * 16
        codes += memory_ok * 8
        codes += cores_ok * 4
        codes += computing * 2
        codes += idle
        codes[~carded] = -1
    return grouped(signature[:, None].astype(np.int64), codes, signature >= 0)
