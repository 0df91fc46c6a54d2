"""Dynamic MIG wired to the ledger (mig_service.py), against the test NVML (fake_nvml_mig.c, its
profile table generated from tessera/mig.py) and a real nats-server: a pod's instance made at
Allocate and recorded in its grant; NVML's refusal marks the allocation failed with the reason
and says so on the bus; a released pod's instance destroyed at once unless a process holds it
(then retried); after an agent restart instances are adopted, an unclaimed one destroyed only
after the grace period, and a vanished one reported once, never remade."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path

import pynvml
import pytest
from fake_nvml_mig import instance_line
from tessera.node_agent import nvml_mig
from tessera.node_agent.mig_dynamic import MigReconciler
from tessera.node_agent.mig_service import DynamicMig, MigCreateFailed, wanted
from test_nvml_mig import A100, U, nvml  # noqa: F401 (the fixture)

from tessera import bus
from tessera.codec import decode
from tessera.device_kinds.nvidia.mig import visible_devices
from tessera.models import (
    Allocation,
    AllocationEvent,
    AllocationState,
    DeviceGrant,
    MigEvent,
    MigInstanceGrant,
    MigState,
    NodeLedger,
)

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process


def grant(profile: str, start: int, state: MigState = MigState.PLANNED,
          mig_uuid: str = "") -> DeviceGrant:
    p = A100.profile(profile)
    return DeviceGrant(
        uuid=U[0], type="NVIDIA-A100-SXM4-80GB", memory_mib=A100.profile_memory_mib(p),
        cores=A100.profile_cores(p),
        mig=MigInstanceGrant(profile=profile, start=start, size=p.memory_slices,
                             mig_uuid=mig_uuid, state=state))  # fmt: skip


def alloc(uid: str, node: str, *grants: DeviceGrant,
          state: AllocationState = AllocationState.BOUND) -> Allocation:
    return Allocation(pod_uid=uid, namespace="default", name=uid, node=node,
                      containers=[list(grants)], state=state)


@pytest.mark.parametrize(
    ("allocations", "allocating", "expect"),
    [
        # the pod being allocated is due; another bound pod's planned instance is pending
        ([alloc("a", "n", grant("1g.10gb", 6)), alloc("b", "n", grant("3g.40gb", 0))], ["a"],
         [("a", False, False), ("b", False, True)]),
        # created and allocated: its instance must be there (vanished otherwise)
        ([alloc("a", "n", grant("1g.10gb", 6, MigState.CREATED, "MIG-x"),
                state=AllocationState.ALLOCATED)], [], [("a", True, False)]),
        # a planned grant of an allocated pod (a ledger rebuilt before its Allocate): pending
        ([alloc("a", "n", grant("1g.10gb", 6), state=AllocationState.ALLOCATED)], [],
         [("a", False, True)]),
        # vanished / failed grants and released allocations want nothing
        ([alloc("a", "n", grant("1g.10gb", 6, MigState.VANISHED)),
          alloc("b", "n", grant("1g.10gb", 5, MigState.FAILED)),
          alloc("c", "n", grant("1g.10gb", 4), state=AllocationState.RELEASED)], [], []),
    ],
)
def test_wanted_from_the_ledger(allocations, allocating, expect) -> None:
    ledger = NodeLedger(node="n", allocations={a.pod_uid: a for a in allocations})
    got = [(w.pod_uid, w.present_before, w.pending) for w in wanted(ledger, allocating)]
    assert got == expect


def test_the_container_sees_its_mig_uuid() -> None:
    plain = DeviceGrant(uuid="GPU-p", type="t", memory_mib=1, cores=1)
    assert visible_devices([grant("1g.10gb", 6, MigState.CREATED, "MIG-1"), plain]) == [
        "MIG-1", "GPU-p"]


async def _collect(nc, subject: str, model, n: int):
    sub = await nc.subscribe(subject)
    got = []

    async def run():
        async for msg in sub.messages:
            got.append(decode(msg.data, model))
            if len(got) >= n:
                break
        await sub.unsubscribe()
        return got

    return asyncio.ensure_future(run())


class Rig:
    """A DynamicMig over the test NVML's first GPU and the session's ledger bucket."""

    def __init__(self, nc, buckets, node: str, clock: list[float], grace_s: float = 5) -> None:
        self.nc, self.buckets, self.node, self.clock = nc, buckets, node, clock
        self.grace_s = grace_s
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.service = self.restart()

    def restart(self) -> DynamicMig:
        """A new agent: nothing remembered but what NVML and the ledger hold."""
        reconciler = MigReconciler(
            node=self.node, handles={U[0]: (self.handle, 0)},
            list_devices=nvml_mig.list_devices, create=nvml_mig.create,
            destroy=nvml_mig.destroy, js=self.nc.jetstream(), log=logging.getLogger("test"),
            clock=lambda: self.clock[0], grace_s=self.grace_s,
        )
        self.service = DynamicMig(node=self.node, reconciler=reconciler,
                                  ledger_kv=self.buckets.ledger, js=self.nc.jetstream(),
                                  cluster=None, log=logging.getLogger("test"))
        return self.service

    async def put(self, *allocations: Allocation) -> None:
        ledger = NodeLedger(node=self.node, allocations={a.pod_uid: a for a in allocations})
        await bus.cas_update(self.buckets.ledger, self.node, NodeLedger, lambda _old: ledger)

    async def ledger(self) -> NodeLedger:
        current = await bus.read(self.buckets.ledger, self.node, NodeLedger)
        assert current is not None
        return current.value

    def instances(self) -> list[tuple[str, int]]:
        return sorted((d.profile, d.start) for d in nvml_mig.list_devices(self.handle, 0))


def _node() -> str:
    return f"migsvc-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def test_allocate_creates_and_records_and_a_refusal_fails_the_allocation(
        nvml, nc, buckets) -> None:  # noqa: F811
    nvml(instance_line(0, A100, "1g.10gb", 0))  # an operator's instance on slice 0
    rig = Rig(nc, buckets, _node(), [1000.0])
    a = alloc("pa", rig.node, grant("3g.40gb", 4))
    b = alloc("pb", rig.node, grant("2g.20gb", 0))  # slice 0 is the operator's
    await rig.put(a, b)
    created = await _collect(nc, f"tessera.events.mig.{rig.node}.created", MigEvent, 1)
    failed = await _collect(nc, f"tessera.events.alloc.{rig.node}.failed", AllocationEvent, 1)

    done = await rig.service.allocate(a)
    (g,) = done.containers[0]
    assert g.mig.state == MigState.CREATED and g.mig.mig_uuid.startswith("MIG-")
    assert ("3g.40gb", 4) in rig.instances()
    assert (await rig.ledger()).allocations["pa"].containers[0][0].mig.mig_uuid == g.mig.mig_uuid
    (event,) = await asyncio.wait_for(created, 10)
    assert (event.pod_uid, event.mig_uuid, event.profile, event.start) == (
        "pa", g.mig.mig_uuid, "3g.40gb", 4)

    with pytest.raises(MigCreateFailed, match="Insufficient Resources"):
        await rig.service.allocate(b)
    held = (await rig.ledger()).allocations["pb"]
    assert held.state == AllocationState.FAILED and not held.active
    assert "2g.20gb at slice 0" in held.reason and "Insufficient Resources" in held.reason
    assert held.containers[0][0].mig.state == MigState.FAILED
    (event,) = await asyncio.wait_for(failed, 10)
    assert event.pod_uid == "pb" and "Insufficient Resources" in event.reason
    assert ("2g.20gb", 0) not in rig.instances()  # nothing half-made is left

    # the operator's instance sits exactly where a pod's goes: never handed to the pod
    c = alloc("pc", rig.node, grant("1g.10gb", 0))
    await rig.put(c)
    with pytest.raises(MigCreateFailed, match="Insufficient Resources"):
        await rig.service.allocate(c)
    assert (await rig.ledger()).allocations["pc"].state == AllocationState.FAILED


async def test_release_destroys_at_once_unless_a_process_holds_it(
        nvml, nc, buckets, tmp_path: Path) -> None:  # noqa: F811
    nvml()
    rig = Rig(nc, buckets, _node(), [1000.0], grace_s=3600)
    a = alloc("pa", rig.node, grant("1g.10gb", 6))
    await rig.put(a)
    made = (await rig.service.allocate(a)).containers[0][0].mig
    (device,) = nvml_mig.list_devices(rig.handle, 0)
    destroyed = await _collect(nc, f"tessera.events.mig.{rig.node}.destroyed", MigEvent, 1)

    procs = tmp_path / "procs"  # a process runs in the instance
    procs.write_text(f"0 {os.getpid()} 100 1 {device.gi_id} {device.ci_id}\n")
    await rig.put()  # the pod's allocation is released
    out = await rig.service.reconcile_once()
    assert [d.uuid for d in out.busy] == [made.mig_uuid] and rig.instances() == [("1g.10gb", 6)]
    tmp = tmp_path / "procs.tmp"
    tmp.write_text("")
    tmp.rename(procs)
    out = await rig.service.reconcile_once()  # retried: no grace period for a released pod's
    assert [d.uuid for d in out.destroyed] == [made.mig_uuid] and rig.instances() == []
    (event,) = await asyncio.wait_for(destroyed, 10)
    assert event.mig_uuid == made.mig_uuid and (event.profile, event.start) == ("1g.10gb", 6)


async def test_restart_adopts_reports_vanished_once_and_destroys_orphans_after_grace(
        nvml, nc, buckets) -> None:  # noqa: F811
    nvml()
    clock = [1000.0]
    rig = Rig(nc, buckets, _node(), clock, grace_s=10)
    a = alloc("pa", rig.node, grant("3g.40gb", 4))
    b = alloc("pb", rig.node, grant("1g.10gb", 0))
    await rig.put(a, b)
    a = await rig.service.allocate(a)
    b = await rig.service.allocate(b)
    orphan = nvml_mig.create(rig.handle, 0, "1g.10gb", 3)  # made by someone else
    await rig.put(a.model_copy(update={"state": AllocationState.ALLOCATED}),
                  b.model_copy(update={"state": AllocationState.ALLOCATED}))
    vanished = await _collect(nc, f"tessera.events.mig.{rig.node}.>", MigEvent, 2)

    rig.restart()  # the agent restarts; meanwhile b's instance is destroyed behind its back
    nvml_mig.destroy(rig.handle, next(d.gi_id for d in nvml_mig.list_devices(rig.handle, 0)
                                      if d.start == 0))
    out = await rig.service.reconcile_once()
    assert [w.pod_uid for w, _ in out.matched] == ["pa"] and out.created == []
    assert [w.pod_uid for w in out.vanished] == ["pb"]
    assert out.destroyed == []  # the unclaimed instance waits out the grace period
    ledger = await rig.ledger()
    assert ledger.allocations["pb"].containers[0][0].mig.state == MigState.VANISHED
    assert ledger.allocations["pa"].containers[0][0].mig.state == MigState.CREATED

    clock[0] += 11
    out = await rig.service.reconcile_once()
    assert out.vanished == [] and out.created == []  # reported once, never remade
    assert [d.uuid for d in out.destroyed] == [orphan.uuid]
    assert rig.instances() == [("3g.40gb", 4)]
    got = await asyncio.wait_for(vanished, 10)
    assert [(e.action, e.pod_uid) for e in got] == [("vanished", "pb"), ("destroyed", "")]


async def test_kubelet_retrying_allocate_gets_the_same_instance(nvml, nc, buckets) -> None:  # noqa: F811
    nvml()
    rig = Rig(nc, buckets, _node(), [1000.0])
    a = alloc("pa", rig.node, grant("2g.20gb", 4))
    await rig.put(a)
    first = (await rig.service.allocate(a)).containers[0][0].mig.mig_uuid
    again = (await rig.service.allocate(a)).containers[0][0].mig.mig_uuid
    assert first == again and rig.instances() == [("2g.20gb", 4)]


@pytest.mark.parametrize(
    ("profile", "charge", "asked", "ok"),
    [
        ("3g.40gb", None, (35000, 0), True),  # charged the profile, above the ask: its size
        ("7g.80gb", None, (35000, 30), True),  # a larger covering profile (geometry): allowed
        ("1g.10gb", None, (35000, 0), False),  # does not cover the ask
        ("3g.40gb", (81920, 100), (35000, 0), False),  # charged other than the profile's
        ("2g.20gb", None, (15000, 50), False),  # 28 % compute does not cover 50 %
    ],
)
def test_a_mig_grant_is_sealed_only_as_its_profile_covering_the_ask(profile, charge, asked,
                                                                   ok) -> None:
    from tessera.node_agent.grant_check import GrantRefused, check_mig_grant

    from tessera.models import DeviceInfo, MigCapability

    g = grant(profile, A100.profile(profile).starts[0])
    if charge:
        g = g.model_copy(update={"memory_mib": charge[0], "cores": charge[1]})
    card = DeviceInfo(uuid=U[0], index=0, type="NVIDIA-A100-SXM4-80GB", memory_mib=81920,
                      mode="mig", mig=MigCapability(model="A100-SXM4-80GB"))
    if ok:
        check_mig_grant(g, card, *asked, "pod x")
    else:
        with pytest.raises(GrantRefused, match="refusing to seal a forged grant"):
            check_mig_grant(g, card, *asked, "pod x")
    with pytest.raises(GrantRefused, match="does not serve dynamic MIG"):
        check_mig_grant(g, card.model_copy(update={"mig": None}), *asked, "pod x")
