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

from .native_steps import NativeSteps
from .row_reduce import row_any, row_counts, row_max
from .rules import (
    CARD_COMPUTE_UNITS_EXHAUSTED,
    CARD_INSUFFICIENT_CORE,
    CARD_INSUFFICIENT_MEMORY,
    CARD_TIME_SLICING_EXHAUSTED,
    EXCLUSIVE_CONFLICT,
)

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
# the reason of each verdict (the check that fails: `rules.card_refusal`'s), and the verdict of
# a class's static check with reason id 0 (`CardClasses.static_refusal`: id i is this + i)
VERDICT_REASONS = {_SLOTS: CARD_TIME_SLICING_EXHAUSTED, _MUTEX: EXCLUSIVE_CONFLICT,
                   _MEMORY: CARD_INSUFFICIENT_MEMORY, _CORES: CARD_INSUFFICIENT_CORE,
                   _EXCLUSIVE: EXCLUSIVE_CONFLICT, _COMPUTE: CARD_COMPUTE_UNITS_EXHAUSTED}
STATIC_BASE = _STATIC + 1


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
        np.putmask(verdict, (cores_of > 0).take(cls) & ~computing, _COMPUTE)
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
        at = static.take(cls)
        verdict = np.where(at > 0, (_STATIC + at).astype(np.int16), verdict)
    takes = carded & (verdict == 0)
    if options.numa_bind:
        verdict = verdict + cls.astype(np.int64) * 4096
    if not sliced.all():
        raw = memory_ok * 8 + cores_ok * 4 + computing * 2 + idle
        if exhausted is not None:
            raw = np.where(exhausted, 16, raw)
        verdict = np.where(sliced.take(cls), verdict, -2 - (cls.astype(np.int64) * 64 + raw))
    codes = verdict
    np.putmask(codes, ~carded, -1)
    return codes, takes


def grouped(head: np.ndarray, codes: np.ndarray, where: np.ndarray
             ) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    """Candidates grouped where `where` by their row of `head` (int64) and the multiset of
    their row of `codes` (in any order): equal rows, one group; (group by candidate, -1 where
    not `where`; each group's key: its first's `head` row and sorted codes, as bytes; each
    group's first candidate). Usually each row packed exactly into one integer (`_packed`);
    else a hash of the sorted rows' words, every row then compared with its group's first,
    so no collision merges two groups."""
    packed = _packed(head, codes, where)
    if packed is not None:
        _unique, first, which = np.unique(packed, return_index=True, return_inverse=True)
        groups = np.where(where, which.reshape(-1), -1)
        firsts = np.sort(codes[first], axis=1)
        keys = [head[i].tobytes() + row.tobytes()
                for i, row in zip(first.tolist(), firsts, strict=True)]  # fmt: skip
        return groups, keys, first
    codes = np.sort(codes, axis=1)
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


_COUNT_BITS = 4  # a code's count in a node's packed multiset (at most 15 cards a row)
_SPAN = 1 << 15  # codes spanning more than this are hashed instead (int16's range)


def _packed(head: np.ndarray, codes: np.ndarray, where: np.ndarray) -> np.ndarray | None:
    """Each row's (`head` row, multiset of `codes` row) as one exact integer (uint64): the
    distinct codes of the call numbered densely, a row's count of each in its own 4 bits,
    the head's columns above them (mixed radix); rows not `where` all the largest value.
    Equal integers <=> equal rows. None when it does not fit in 63 bits (more than 15
    distinct codes, more than 15 cards a row, or heads spanning too far)."""
    rows, width = codes.shape
    if not rows or width > (1 << _COUNT_BITS) - 1:
        return None
    low = int(codes.min())
    span = int(codes.max()) - low + 1
    if span > _SPAN:
        return None
    at = codes - low if low else codes  # (each code's place among the call's codes)
    if span * _COUNT_BITS > 62:  # number the codes present densely
        present = np.bincount(at.reshape(-1), minlength=span) > 0
        dense = np.cumsum(present) - 1
        bits = _COUNT_BITS * (int(dense[-1]) + 1)
        if bits > 62:
            return None
    else:
        dense, bits = np.arange(span), _COUNT_BITS * span
    lut = np.left_shift(np.uint64(1), (dense * _COUNT_BITS).astype(np.uint64))
    counts = lut.take(at)
    packed = counts[:, 0].copy()
    for column in range(1, width):  # (column by column: a reduce along rows is slower)
        packed += counts[:, column]
    radix = 1 << bits
    for column in head.T:
        values = column[where] if not where.all() else column
        if not len(values):
            break
        low = int(values.min())
        span = int(values.max()) - low + 1
        if radix * span >= 1 << 63:
            return None
        packed += (column - low).astype(np.uint64) * np.uint64(radix)
        radix *= span
    packed[~where] = np.uint64((1 << 64) - 1)
    return packed


def group_steps(index: Any, slots: np.ndarray, steps: PodSteps, ties: np.ndarray | None = None
                ) -> tuple[np.ndarray, list[bytes], np.ndarray]:
    """`group` for a pod of several app containers: the candidates grouped by the step each
    fails at and its cards' codes then (`step_arrays`; in C where `native_steps` applies,
    the same arrays; grouped there too, the same groups and keys), `ties` set as
    `step_arrays` says."""
    native = NativeSteps.load()
    found = native.steps(index, slots, steps, ties) if native is not None else None
    if found is None:
        found = step_arrays(index, slots, steps, ties)
    failed_at, failed_sig, codes, refused = found
    head = np.stack([failed_at, failed_sig], axis=1)
    done = native.group(head, codes, refused) if native is not None else None
    return done if done is not None else grouped(head, codes, refused)


def step_arrays(index: Any, slots: np.ndarray, steps: PodSteps, ties: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(the step each candidate fails at, -1 for none; its signature there, -1; its cards'
    codes then, -1 elsewhere; whether it is refused), in numpy. `placement.fit_pod` fits a
    pod's containers in order;
    the first that finds too few cards refuses the node with its reasons counted on the
    cards as the containers before it left them (`pick_cards` takes the first `count` of
    those that pass, by the policy's device score, ties by index). Each step's verdicts and
    pick are computed here for every candidate at once from the index's per-card arrays
    (libvgpu slices only: memory, cores, slots, idle, still computing; a class's static
    checks asked of its first device), the cards taken charged as `_take` charges them; a
    node refusing at step j is grouped by (j, its cards' classes and verdict inputs against
    that container then), whose text one fit of the whole pod finds. Nodes that take every
    container are not grouped (the walk fits them).

    `ties` (bool by candidate, set here): where a container's pick had to choose by card
    index between cards that stand differently (a passing card left out with the same key as
    the last card taken, and the cards of that key not all alike), the only place the order
    of a node's cards matters: a node whose cards are the same multiset in another order may
    then be grouped otherwise (`refusal_states.py`)."""
    classes = index.card_class.take(slots, axis=0)
    carded = classes >= 0
    signature = index.unusable_sig.take(slots, axis=0)
    memory, cores_of, split, sliced = index.card_classes.statics()
    cls = np.maximum(classes, 0)
    total_mem, total_cores, total_split = memory.take(cls), cores_of.take(cls), split.take(cls)
    alive = signature >= 0
    if not sliced.all():
        alive &= (sliced.take(cls) | ~carded).all(axis=1)
    free_mem = index.card_mem.take(slots, axis=0)
    free_cores = index.card_cores.take(slots, axis=0)
    used_slots = index.card_slots.take(slots, axis=0)
    computing = index.card_computing.take(slots, axis=0)
    idle = index.card_idle.take(slots, axis=0)
    pct = index.card_pct.take(slots, axis=0)
    exhausted = np.zeros(classes.shape, dtype=bool)
    options = steps.options
    signs = [-1.0 if p == "binpack" else 1.0 for p in options.gpu_policies
             if p in ("binpack", "spread")]  # fmt: skip
    w_slot, w_core, w_mem = options.weights
    failed_at = np.full(len(slots), -1, dtype=np.int64)  # the step each node fails at
    failed_sig = np.full(len(slots), -1, dtype=np.int64)  # and its signature
    codes = np.full(classes.shape, -1, dtype=np.int64)
    refused = np.zeros(len(slots), dtype=bool)
    rows: np.ndarray | None = None  # the candidates the arrays below hold (None: all)
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
        fails = alive & (row_counts(passes) < r.count)
        if fails.any():
            if rows is None:
                np.putmask(failed_at, fails, j)
                np.copyto(failed_sig, signature, where=fails)
                np.copyto(codes, step, where=fails[:, None])
                refused |= fails
            else:  # (rows kept: their places among the candidates)
                at = rows[fails]
                failed_at[at] = j
                failed_sig[at] = signature[fails]
                codes[at] = step[fails]
                refused[at] = True
            alive &= ~fails
        if j == last or not alive.any():
            break
        left = np.flatnonzero(alive)
        if 2 * len(left) < len(alive):  # the later steps read only the nodes still fitting
            rows = left if rows is None else rows[left]
            (cls, carded, total_mem, total_cores, total_split, free_mem, free_cores, used_slots,
             computing, idle, pct, exhausted, signature, passes) = (
                a.take(left, axis=0) for a in (
                    cls, carded, total_mem, total_cores, total_split, free_mem, free_cores,
                    used_slots, computing, idle, pct, exhausted, signature, passes))  # fmt: skip
            alive = np.ones(len(left), dtype=bool)
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
            key = np.zeros(cls.shape, dtype=np.float64)
        key[~passes] = np.inf
        taken = first_smallest(key, r.count)
        taken &= alive[:, None]
        if ties is not None:
            # (used slots matter to the pick's key where the slot term weighs, else only
            # where this pod's containers could still run a card out of slots)
            used = (used_slots if w_slot and signs else
                    np.where(used_slots + (last - j + 1) >= total_split, used_slots, -1))
            # (a class's NUMA node is read only under NUMA binding, never grouped in steps:
            # libvgpu slices' codes are verdicts, so classes apart from it pick alike)
            # (the free % is the free memory's on the class's memory: not compared)
            kind = index.card_classes.sans_numa().take(cls) if sliced.all() else cls
            state = (free_mem, free_cores, used, computing, idle)
            _mark_ties(ties, rows, key, taken, passes,
                       state if int(kind.min()) == int(kind.max()) else (kind, *state))
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
    return failed_at, failed_sig, codes, refused


def _mark_ties(ties: np.ndarray, rows: np.ndarray | None, key: np.ndarray, taken: np.ndarray,
               passes: np.ndarray, state: tuple[np.ndarray, ...]) -> None:
    """Set `ties` (by candidate) where this pick chose by index among cards that differ: a
    passing card not taken whose key equals the largest key taken, while the cards of that
    key are not all alike (on every per-card value a later step or the codes read)."""
    last = row_max(np.where(taken, key, -np.inf))
    boundary = key == last[:, None]
    left_out = row_any(boundary & passes & ~taken)
    if not left_out.any():
        return
    at = np.flatnonzero(left_out)
    edge = boundary[at]
    pick = np.argmax(edge, axis=1)
    rows_at = np.arange(len(at))
    differ = np.zeros(len(at), dtype=bool)
    for values in state:
        values = values.take(at, axis=0)
        differ |= row_any(edge & (values != values[rows_at, pick][:, None]))
    if differ.any():
        ties[at[differ] if rows is None else rows[at[differ]]] = True


def first_smallest(key: np.ndarray, count: int) -> np.ndarray:
    """Each row's `count` smallest keys (doubles, +inf allowed), ties by index: a stable
    sort's first `count`, as a mask. One or two: argmin's first occurrence, the first taken
    key then put past every other (a sort of each row is slower for those: 0.45 ms at 5,000
    rows of 8 against 0.06 / 0.36); more: the sort's."""
    taken = np.zeros(key.shape, dtype=bool)
    if count >= key.shape[1]:
        taken[:] = True
        return taken
    if count > 2:
        order = np.argsort(key, axis=1, kind="stable")[:, :count]
        np.put_along_axis(taken, order, True, axis=1)
        return taken
    left = np.where(np.isinf(key), _PAST, key) if count > 1 else key
    starts = np.arange(0, key.size, key.shape[1])  # (each row's first place, flat)
    flat_taken, flat_left = taken.reshape(-1), left.reshape(-1)  # (views)
    for _ in range(count):
        at = np.argmin(left, axis=1)
        at += starts
        flat_taken[at] = True
        if count > 1:
            flat_left[at] = np.inf
    return taken


_PAST = np.finfo(np.float64).max  # (an infinite key: after every finite one, before taken)

