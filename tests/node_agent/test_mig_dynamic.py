"""Dynamic MIG on the node (mig_dynamic.py): instances created for allocations, orphans destroyed
after a grace period unless a process runs in them, a vanished instance reported; events on the
bus. Against the test NVML and a real nats-server."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pynvml
import pytest
from fake_nvml_mig import instance_line
from tessera.node_agent import nvml_mig
from tessera.node_agent.mig_dynamic import MigReconciler, Wanted, plan
from tessera.node_agent.nvml_mig import MigDevice
from test_nvml_mig import A100, U, nvml  # noqa: F401 (the fixture)

from tessera.codec import decode
from tessera.models import MigEvent

# It maps a driver library into the test process (tests/process_state.py): by path only.
pytestmark = pytest.mark.driver_library_in_process


def _dev(uuid: str, profile: str, start: int, gpu: str = "GPU-a") -> MigDevice:
    return MigDevice(gpu, 0, uuid, profile, gi_id=start + 1, ci_id=0, start=start, memory_mib=1)


@pytest.mark.parametrize(
    ("wanted", "existing", "orphans", "now", "create", "destroy", "vanished"),
    [
        # a new allocation's instance is made; one already there is left alone
        ([Wanted("p1", "GPU-a", "1g.10gb", 6)], [], {}, 0, ["p1"], [], []),
        ([Wanted("p1", "GPU-a", "1g.10gb", 6, mig_uuid="MIG-1")], [_dev("MIG-1", "1g.10gb", 6)],
         {}, 0, [], [], []),
        # someone else's instance at that place is not the pod's: creating there is tried
        # (NVML refuses), the stranger is an orphan
        ([Wanted("p1", "GPU-a", "1g.10gb", 6)], [_dev("MIG-9", "1g.10gb", 6)], {}, 0, ["p1"],
         [], []),
        # the recorded instance replaced by another at the same place: vanished
        ([Wanted("p1", "GPU-a", "1g.10gb", 6, present_before=True, mig_uuid="MIG-1")],
         [_dev("MIG-2", "1g.10gb", 6)], {}, 0, [], [], ["p1"]),
        # an allocated pod whose instance is gone: reported, not remade under it
        ([Wanted("p1", "GPU-a", "1g.10gb", 6, present_before=True)], [], {}, 0, [], [], ["p1"]),
        # same profile elsewhere is not it
        ([Wanted("p1", "GPU-a", "1g.10gb", 6)], [_dev("MIG-1", "1g.10gb", 5)], {}, 0, ["p1"],
         [], []),
        # orphans wait out the grace period (10 s here)
        ([], [_dev("MIG-1", "1g.10gb", 6)], {}, 100, [], [], []),
        ([], [_dev("MIG-1", "1g.10gb", 6)], {"MIG-1": 95}, 100, [], [], []),
        ([], [_dev("MIG-1", "1g.10gb", 6)], {"MIG-1": 90}, 100, [], ["MIG-1"], []),
    ],
)
def test_plan(wanted, existing, orphans, now, create, destroy, vanished) -> None:
    result = plan(wanted, existing, orphans, now, grace_s=10)
    assert [w.pod_uid for w in result.create] == create
    assert [d.uuid for d in result.destroy] == destroy
    assert [w.pod_uid for w in result.vanished] == vanished
    assert set(result.orphans) == {d.uuid for d in existing} - {d.uuid for _, d in result.matched}


async def _events(nc, node: str, n: int) -> list[MigEvent]:
    sub = await nc.subscribe(f"tessera.events.mig.{node}.>")
    got: list[MigEvent] = []

    async def collect() -> list[MigEvent]:
        async for msg in sub.messages:
            got.append(decode(msg.data, MigEvent))
            if len(got) >= n:
                break
        return got

    return sub, asyncio.ensure_future(collect())


async def test_instances_made_and_destroyed_through_nvml_with_events(
        nvml, nc, buckets, tmp_path: Path) -> None:  # noqa: F811
    nvml(instance_line(0, A100, "3g.40gb", 0))
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    clock = [1000.0]
    node = f"mig-{os.getpid()}"
    reconciler = MigReconciler(
        node=node, handles={U[0]: (handle, 0)}, list_devices=nvml_mig.list_devices,
        create=nvml_mig.create, destroy=nvml_mig.destroy, js=nc.jetstream(),
        log=logging.getLogger("test"), clock=lambda: clock[0], grace_s=5,
    )
    sub, events = await _events(nc, node, 3)
    (pre,) = reconciler.existing()  # made by an operator: an orphan for dynamic MIG

    # two pods' instances; the second asks a placement the 3g instance holds: refused
    out = await reconciler.reconcile([Wanted("p1", U[0], "1g.10gb", 6),
                                      Wanted("p2", U[0], "2g.20gb", 2)])
    [(w, made)] = out.created
    assert w.pod_uid == "p1" and made.uuid.startswith("MIG-") and made.start == 6
    [(bad, reason)] = out.failed
    assert bad.pod_uid == "p2" and "Insufficient Resources" in reason
    assert out.destroyed == []  # the orphan waits out its grace period

    # a process runs in the orphan: kept; once it is gone, destroyed
    procs = tmp_path / "procs"
    procs.write_text(f"0 {os.getpid()} 100 1 {pre.gi_id} {pre.ci_id}\n")
    clock[0] += 6
    out = await reconciler.reconcile([Wanted("p1", U[0], "1g.10gb", 6, present_before=True)])
    assert [d.uuid for d in out.busy] == [pre.uuid] and out.destroyed == []
    tmp = tmp_path / "procs.tmp"
    tmp.write_text("")
    tmp.rename(procs)
    out = await reconciler.reconcile([Wanted("p1", U[0], "1g.10gb", 6, present_before=True)])
    assert [d.uuid for d in out.destroyed] == [pre.uuid]
    assert [d.uuid for d in reconciler.existing()] == [made.uuid]

    # someone removes p1's instance behind our back: reported as vanished
    nvml_mig.destroy(handle, made.gi_id)
    out = await reconciler.reconcile([Wanted("p1", U[0], "1g.10gb", 6, present_before=True)])
    assert [w.pod_uid for w in out.vanished] == ["p1"] and out.created == []

    got = await asyncio.wait_for(events, 10)
    await sub.unsubscribe()
    assert [(e.action, e.profile, e.start) for e in got] == [
        ("created", "1g.10gb", 6), ("destroyed", "3g.40gb", 0), ("vanished", "1g.10gb", 6)]
    assert got[0].mig_uuid == made.uuid and got[0].pod_uid == "p1"
