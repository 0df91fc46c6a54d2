"""A refused pod of several containers read per node shape, and the card codes shapes are
made of (pure, numpy; `refusal_shapes.py` says why a refusal is read per shape).

`placement.fit_pod` fits a pod's app containers in order, each taking the first `count` of
the cards that pass by HAMi's device score (ties by index) on what the ones before it left;
the first that finds too few cards refuses the node with its reasons counted on the cards as
they stand then. `group_steps` computes every step's verdicts and pick for every candidate
at once from the index's per-card arrays and charges the cards taken as `placement._take`
does (libvgpu slices only), so that a node is grouped by the step it fails at and its cards'
codes against that container then (`card_codes`); one fit of the whole pod per group finds
the text. `tests/scheduler/test_refusal_fast.py` compares every reason with fitting each
node (GPU policies, weights, mutex, percentages, 2-3 containers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tessera.hami import ContainerRequest

_MIX = np.uint64(0x9E3779B97F4A7C15)


class PodSteps:
    """A pod of several app containers (no GPU init container), each picking its cards by the
    GPU policy's order among those that pass, after the ones before it took theirs: grouped by
    the container it fails at and how the cards stand against that one then (`group_steps`)."""

    __slots__ = ("containers", "options")

    def __init__(self, containers: list[ContainerRequest], options: Any) -> None:
        self.containers, self.options = containers, options


# a card's verdict against a container, in HAMi's check order (`rules.FIT_CHECKS`): 0 takes it
_SLOTS, _MUTEX, _MEMORY, _CORES, _EXCLUSIVE, _COMPUTE, _STATIC = range(1, 8)  # (+ reason id)


def card_codes(
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


def grouped(head: np.ndarray, codes: np.ndarray, where: np.ndarray
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


def group_steps(index: Any, slots: np.ndarray, steps: PodSteps) -> tuple[np.ndarray, list[bytes],
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
    cls = np.maximum(classes, 0)
    total_mem, total_cores, total_split = memory.take(cls), cores_of.take(cls), split.take(cls)
    alive = signature >= 0
    if not sliced.all():
        alive &= (sliced.take(cls) | ~carded).all(axis=1)
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
        step, passes = card_codes(index, cls, carded, r, options, memory_ok, cores_ok,
                                   computing, idle, exhausted)  # fmt: skip
        passes &= usable
        count = np.count_nonzero(passes, axis=1)
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
        later = steps.containers[j + 1 :]
        if signs:
            with np.errstate(divide="ignore", invalid="ignore"):
                # (ints as doubles, exact: the same correctly rounded quotients as Python's)
                score = (used_slots + 1.0) * w_slot / total_split
                if not (split > 0).all():
                    score[total_split == 0] = 0.0
                term = w_core * (r.cores + (total_cores - free_cores)) / total_cores
                if not (cores_of > 0).all():
                    term[total_cores == 0] = 0.0
                score += term
                on_card = (total_mem * r.memory_percentage // 100
                           if r.memory_percentage is not None else r.memory_mib)  # fmt: skip
                term = w_mem * (on_card + (total_mem - free_mem)) / total_mem
                if not (memory > 0).all():
                    term[total_mem == 0] = 0.0
                score += term
            score *= 10.0 * signs[0]  # (sign · (10 · score): the same double either way)
            key = score
        else:
            key = np.zeros(classes.shape, dtype=np.float64)
        key[~passes] = np.inf
        if r.count == 1:  # (the first smallest: argmin's first occurrence, ties by index)
            order = np.argmin(key, axis=1)[:, None]
        else:
            order = np.argsort(key, axis=1, kind="stable")[:, : r.count]
        taken = np.zeros(classes.shape, dtype=bool)
        np.put_along_axis(taken, order, True, axis=1)
        taken &= alive[:, None]
        # charged as `placement._take` charges them (the gathers are this call's copies)
        charge = (total_mem * r.memory_percentage // 100 if r.memory_percentage is not None
                  else r.memory_mib)  # fmt: skip
        free_mem -= taken * charge
        free_cores -= taken * r.cores
        used_slots += taken
        idle &= ~taken
        if any(x.cores == 0 for x in later):  # (read only by the compute check)
            np.copyto(computing, (total_cores == 0) | (free_cores > 0), where=taken)
        if any(x.memory_percentage is not None for x in later):
            np.copyto(pct, np.minimum((100 * (free_mem + 1) - 1) // np.maximum(total_mem, 1),
                                      32767), where=taken & (total_mem > 0))  # fmt: skip
        exhausted |= taken & (used_slots >= total_split)
    return grouped(head, codes, refused)
