"""The index built at start-up (rows deferred while both buckets are listed, then built in one
pass from the entries as the codecs read them, usage counted as they were read) must read
exactly as one built node by node from the models as the watches apply later changes: rows,
bounds, scores, expiries, busy marks, cards and the pod maps, on random clusters."""

from __future__ import annotations

import random

import numpy as np
import pytest

from services.scheduler.index import ClusterIndex
from services.scheduler.ledger_codec import LedgerCodec
from services.scheduler.registration_codec import RegistrationCodec
from services.scheduler.wire_fast import LedgerWire
from tessera.codec import encode
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    InFlightClaim,
    MigCapability,
    NodeLedger,
    NodeRegistration,
)

from .factories import GIB, device

NOW = 10_000.0
_BOUNDS = [name for name, _dtype in ClusterIndex._BOUNDS]
_BOUNDS_2D = ["bound_mem_at", "bound_pct_at", "bound_mem_kth"]  # (a row per rung or per k)


def _registration(rng: random.Random, name: str) -> NodeRegistration:
    shape = rng.choice(["h100", "h100", "a10", "mixed", "mig", "tiny"])
    gpus = {"h100": 8, "a10": 4, "mixed": rng.randint(1, 8), "mig": 2, "tiny": 1}[shape]
    devices = []
    for i in range(gpus):
        kw: dict = {}
        if shape == "a10":
            kw = {"memory_mib": 24 * GIB, "type": "NVIDIA-A10", "split": 4}
        elif shape == "mixed":
            kw = {"memory_mib": rng.choice([16, 40, 80]) * GIB, "cores": rng.choice([0, 100]),
                  "split": rng.randint(1, 10), "healthy": rng.random() > 0.15,
                  "mode": rng.choice(["hami-core", "hami-core", "mig", "mps"])}  # fmt: skip
        elif shape == "mig":
            kw = {"type": "NVIDIA A100-SXM4-80GB", "mode": "mig"}
        d = device(f"GPU-{name}-{i}", i, **kw)
        if shape == "mig" and i == 0:
            d = d.model_copy(update={"mig": MigCapability(model="A100-SXM4-80GB")})
        devices.append(d)
    return NodeRegistration(node=name, devices=devices, heartbeat_at=NOW)


def _ledger(rng: random.Random, registration: NodeRegistration) -> NodeLedger:
    name, devices = registration.node, registration.devices
    allocations = {}
    for p in range(rng.randint(0, 20)):
        uid = f"{name}-pod{p}"
        containers = []
        for _c in range(rng.choice([1, 1, 1, 2, 3])):
            picked = rng.sample(devices, rng.randint(1, min(2, len(devices))))
            containers.append([DeviceGrant(uuid=d.uuid, type=d.type,
                                           memory_mib=rng.randint(0, d.memory_mib // 4),
                                           cores=rng.choice([0, 5, 10, 30])) for d in picked])
        state = rng.choice([AllocationState.ALLOCATED] * 4 + [AllocationState.BOUND] * 2 + [
            AllocationState.RESERVED, AllocationState.RELEASED, AllocationState.FAILED])
        kw: dict = {}
        if state == AllocationState.RESERVED:
            kw["expires_at"] = NOW + rng.choice([-30, -1, 5, 60])
        if rng.random() < 0.1:
            kw["preempted_by"] = f"{name}-nominee"
            kw["preempted_until"] = NOW + rng.choice([-10, 20])
        if len(containers) > 1 and rng.random() < 0.3:
            kw["init_count"] = 1
        allocations[uid] = Allocation(
            pod_uid=uid, namespace=rng.choice(["a", "b", f"ns-{name}"]), name=uid, node=name,
            containers=containers, state=state, **kw)  # fmt: skip
    claims = {}
    if rng.random() < 0.2:
        claims["c"] = InFlightClaim(pod_uid="c", namespace="a", name="c", taken_at=NOW - 1,
                                    expires_at=NOW + rng.choice([-5, 10]), holder="r")  # fmt: skip
    return NodeLedger(node=name, allocations=allocations, claims=claims)


def _node_view(index: ClusterIndex, name: str) -> tuple:
    entry = index.entries[name]
    slot = entry.slot
    rows = tuple(getattr(index, a)[slot].tolist() for a in ClusterIndex._ARRAYS)
    bounds = (*(int(getattr(index, b)[slot]) for b in _BOUNDS),
              *(getattr(index, b)[:, slot].tolist() for b in _BOUNDS_2D))  # fmt: skip
    cards = [(c.uuid, c.used_mem, c.used_cores, c.used_slots, c.cordoned, c.healthy)
             for c in entry.cards]  # fmt: skip
    return rows, bounds, entry.score, entry.reserved_until, cards


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_rows_built_at_start_up_equal_rows_built_node_by_node(seed: int) -> None:
    rng = random.Random(seed)
    names = [f"n{seed}-{i}" for i in range(120)]
    registrations = {n: _registration(rng, n) for n in names}
    ledgers = {n: _ledger(rng, registrations[n]) for n in names if rng.random() < 0.9}
    cordons = {n: frozenset(rng.sample([d.uuid for d in registrations[n].devices], 1))
               for n in names if rng.random() < 0.15}  # fmt: skip

    # start-up: both buckets listed with rows deferred, values as the codecs read them
    bulk = ClusterIndex()
    bulk.defer_rebuilds()
    registration_codec, ledger_codec = RegistrationCodec(), LedgerCodec()
    read_ledgers = {n: ledger_codec.read(n, encode(v)) for n, v in ledgers.items()}
    assert any(type(v) is LedgerWire and v.usage is not None for v in read_ledgers.values())
    assert any(type(v) is LedgerWire and v.usage is None for v in read_ledgers.values())
    for n in names:
        bulk.set_registration(n, registration_codec.read(encode(registrations[n])), NOW)
        if n in cordons:
            bulk.set_cordon(n, cordons[n], NOW)
    for revision, (n, value) in enumerate(read_ledgers.items(), 1):
        bulk.set_ledger(n, value, revision, NOW)
    bulk.flush_rebuilds(NOW)

    # the same cluster applied one value at a time, ledgers first for some nodes
    single = ClusterIndex()
    order = names[:]
    rng.shuffle(order)
    for revision, n in enumerate(order, 1):
        if n in ledgers and rng.random() < 0.5:
            single.set_ledger(n, ledgers[n], revision, NOW)
            single.set_registration(n, registrations[n], NOW)
        else:
            single.set_registration(n, registrations[n], NOW)
            if n in ledgers:
                single.set_ledger(n, ledgers[n], revision, NOW)
        if n in cordons:
            single.set_cordon(n, cordons[n], NOW)

    for n in names:
        assert _node_view(bulk, n) == _node_view(single, n), n
    assert bulk.pod_nodes == single.pod_nodes
    assert bulk.pod_uids == single.pod_uids
    assert bulk.sweepable == single.sweepable
    assert np.array_equal(
        np.sort(bulk.scores[: len(bulk.by_slot)]), np.sort(single.scores[: len(single.by_slot)])
    )

    # and the next write of a node read at start-up still counts exactly (usage kept per change)
    for n in list(ledgers)[:30]:
        ledger = ledgers[n]
        changed = dict(list(ledger.allocations.items())[1:])
        later = ledger.model_copy(update={"allocations": changed})
        bulk.set_ledger(n, later, 10_000, NOW + 1)
        single.set_ledger(n, later, 10_000, NOW + 1)
        assert _node_view(bulk, n) == _node_view(single, n), n
