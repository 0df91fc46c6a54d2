"""Issue 34: the ledger rebuilt after NATS lost its store may place a running pod on another card
of its node than the one it sealed (a forged annotation moved it, within that card's capacity and
the pod's request). The node agent knows what it sealed: it never seals a grant that would put a
card over its capacity beside that, reports every sealed container the ledger places elsewhere,
and puts the ledger back on the sealed cards. Real NATS, real unix-socket gRPC, the rig's
simulated kubelet."""

from __future__ import annotations

import asyncio

from node_agent_rig import grants, running_rig
from tessera.node_agent import mps

from tessera import bus
from tessera.codec import decode
from tessera.models import NodeLedger, ValueRejectedEvent

CARD_MIB = 16000  # the rig's cards


def sized_pod(name: str, mem: int, cores: int) -> dict:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {
            "nvidia.com/gpu": 1, "nvidia.com/gpumem": mem, "nvidia.com/gpucores": cores,
        }}}]},
    }  # fmt: skip


def sealed_per_card(rig) -> dict[str, int]:
    per_card: dict[str, int] = {}
    for cdir in rig.agent.store.all():
        for uuid, mib in mps.sealed_memory(cdir).items():
            per_card[uuid] = per_card.get(uuid, 0) + mib
    return per_card


async def test_a_ledger_moved_off_what_is_sealed_never_overcommits_a_card(
    short_dir, nc, buckets
):
    async with running_rig(short_dir, nc, buckets) as rig:
        first, other = rig.gpus[0], rig.gpus[1]
        running = sized_pod("running", mem=10000, cores=30)
        await rig.bind(running, [grants((first, 10000, 30))])
        assert (await rig.kubelet.admit_pod(running)).ok
        assert sealed_per_card(rig) == {first: 10000}

        # The store is lost and rebuilt from an annotation forged to name the other card: within
        # that card's capacity and the pod's request, so the rebuild restores it there.
        def moved(ledger: NodeLedger | None) -> NodeLedger:
            assert ledger is not None
            ledger = ledger.model_copy(deep=True)
            allocation = ledger.allocations["uid-running"]
            allocation.containers = [grants((other, 10000, 30))]
            return ledger

        sub = await nc.subscribe(bus.rejected_event_subject("ledger"))
        await bus.cas_update(buckets.ledger, rig.node, NodeLedger, moved)

        # The agent reports the disagreement and puts the ledger back on the sealed card.
        event = decode((await sub.next_msg(timeout=20)).data, ValueRejectedEvent)
        assert event.problem == "sealed_grant_disagrees", event
        assert "team/running" in event.reason and f"10000 MiB on {first}" in event.reason
        assert f"ledger grants it {other}" in event.reason
        deadline = asyncio.get_running_loop().time() + 20
        while (await rig.ledger()).allocations["uid-running"].containers[0][0].uuid != first:
            assert asyncio.get_running_loop().time() < deadline, "the ledger was not repaired"
            await asyncio.sleep(0.1)

        # A scheduler that read the rebuilt ledger before the repair placed a pod on the first
        # card: it is never sealed there beside the running pod.
        newcomer = sized_pod("newcomer", mem=10000, cores=30)
        await rig.bind(newcomer, [grants((first, 10000, 30))])
        admission = await rig.kubelet.admit_pod(newcomer)
        assert not admission.ok
        assert f"would put it at 20000 MiB of {CARD_MIB} MiB" in admission.error, admission.error
        assert sealed_per_card(rig) == {first: 10000}
        while (event := decode((await sub.next_msg(timeout=10)).data,
                               ValueRejectedEvent)).problem != "sealed_over_capacity":
            pass
        assert "newcomer" in event.reason

        # A pod that fits beside what is sealed is still sealed on that card.
        rig.kubelet.remove_pod("uid-newcomer")
        small = sized_pod("small", mem=6000, cores=30)
        await rig.bind(small, [grants((first, 6000, 30))])
        admission = await rig.kubelet.admit_pod(small)
        assert admission.ok, admission.error
        assert sealed_per_card(rig)[first] == 16000
