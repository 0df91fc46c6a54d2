"""Issue 34: the ledger rebuilt from the pods after NATS lost it checks what it restores as it
checks live ledger values. Pod annotations edited to grants above the pods' requests and onto
another pod's GPU are cut to the requests; what would put a card over its capacity is not
restored; every forgery is reported (a `rejected.ledger` event and the rebuild's log); and the
node agents' signed records win over unsigned claims."""

from __future__ import annotations

from typing import Any

from tessera import bus, hami, signing
from tessera import bus_permissions as bp
from tessera.bus import Buckets
from tessera.cluster.memory import InMemoryCluster
from tessera.codec import decode
from tessera.models import DeviceGrant, NodeLedger, ValueRejectedEvent
from tessera.restore import RestoreReport, RestoreRules, checked_restore
from tessera.settings import TesseraSettings

from .conftest import MakeService, agent_allocate, register, unique, wait_until
from .factories import GIB, container, node, pod


def per_card(ledger: NodeLedger) -> dict[str, int]:
    out: dict[str, int] = {}
    for allocation in ledger.allocations.values():
        for grant in (g for c in allocation.containers for g in c):
            out[grant.uuid] = out.get(grant.uuid, 0) + grant.memory_mib
    return out


async def test_forged_annotations_restore_no_card_over_capacity_and_are_reported(
    make_service: MakeService, buckets: Buckets, cluster: InMemoryCluster, nc: Any
) -> None:
    name = unique("forge")
    registration = node(name, gpus=2, memory_mib=10 * GIB)
    await register(buckets, registration)
    first = await make_service()
    await wait_until(lambda: first.index.node(name) is not None)
    uids = []
    for i in range(2):  # 6 GiB each: one per card
        spec = cluster.add_pod(pod(container(mem=6 * GIB), name=f"p{i}-{name}"))
        meta = spec["metadata"]
        assert (await first.scheduler.filter(spec, [name])).nodenames == [name]
        assert await first.scheduler.bind(meta["namespace"], meta["name"], meta["uid"], name) == ""
        await agent_allocate(buckets, name, meta["uid"])
        uids.append(meta["uid"])
    ledger = (await bus.read(buckets.ledger, name, NodeLedger)).value
    honest, victim = (ledger.allocations[u] for u in uids)
    victim_gpu = victim.containers[0][0].uuid
    await first.stop()

    # Whoever may write pods/status edits the first pod: 10 GiB (asked 6), on the other's GPU.
    forged = hami.encode_pod_devices([[DeviceGrant(uuid=victim_gpu, type="NVIDIA",
                                                   memory_mib=10 * GIB, cores=100)]])
    edited = cluster.pods[(honest.namespace, honest.name)]
    edited["metadata"]["annotations"] |= {hami.ANN_DEVICES_ALLOCATED: forged,
                                          hami.ANN_DEVICES_TO_ALLOCATE: forged}
    events = await nc.subscribe(bus.rejected_event_subject("ledger"))
    await bus.flush(nc)  # in place before another connection publishes
    await buckets.ledger.purge(name)  # NATS lost the node's ledger
    second = await make_service()
    after = (await bus.read(buckets.ledger, name, NodeLedger)).value
    capacity = {d.uuid: d.memory_mib for d in registration.devices}
    assert all(used <= capacity[uuid] for uuid, used in per_card(after).items()), per_card(after)
    # The victim keeps its grant; the forged claim, cut to 6 GiB, does not fit beside it.
    assert after.allocations[victim.pod_uid].containers == victim.containers
    assert honest.pod_uid not in after.allocations
    problems = []
    while len(problems) < 2:
        event = decode((await events.next_msg(timeout=10)).data, ValueRejectedEvent)
        if event.problem == "restored_grant_refused":
            problems.append(event.reason)
    assert any("cut to its request" in p and honest.name in p for p in problems), problems
    assert any("not restored" in p and honest.name in p for p in problems), problems
    await second.stop()


def test_a_signed_record_wins_and_a_broken_signature_is_reported() -> None:
    """The pure check: node keys given, the agent's signed record is believed even above the
    request (limits.set raised it) and restored first; an edited one is reported."""
    settings = TesseraSettings()
    key = signing.new_key()
    agent = signing.Signer(bp.user_name(bp.NODE_AGENT, "n1"), key)
    rules = RestoreRules(settings, {agent.user: key.public_key()})
    devices = {d.uuid: d for d in node("n1", gpus=1, memory_mib=10 * GIB).devices}
    gpu = next(iter(devices))

    def bound(name: str, mem: int, signed_value: str | None) -> tuple[Any, dict]:
        grants = [[DeviceGrant(uuid=gpu, type="NVIDIA", memory_mib=mem, cores=0)]]
        value = hami.encode_pod_devices(grants)
        spec = pod(container(mem=4 * GIB), name=name)
        spec["metadata"]["uid"] = f"uid-{name}"
        spec["spec"]["nodeName"] = "n1"
        spec["metadata"]["annotations"] = {hami.ANN_DEVICES_ALLOCATED: value}
        if signed_value is not None:
            spec["metadata"]["annotations"][signing.RECORD_ANNOTATION] = \
                signing.record_signature(agent, spec["metadata"]["uid"], signed_value)
        from tessera.restore import allocations_from_pods
        [(allocation, claim)] = allocations_from_pods(
            [spec], quota_held=False, now=0.0, claim_ttl_s=0.0, report=RestoreReport())["n1"]
        return (allocation, claim), spec

    raised, raised_pod = bound("raised", 7 * GIB, hami.encode_pod_devices(
        [[DeviceGrant(uuid=gpu, type="NVIDIA", memory_mib=7 * GIB, cores=0)]]))
    edited, edited_pod = bound("edited", 9 * GIB, "something else")
    report = RestoreReport()
    accepted = checked_restore(
        "n1", [edited, raised], {p["metadata"]["uid"]: p for p in (raised_pod, edited_pod)},
        devices, [], rules, report,
    )  # fmt: skip
    assert [a.name for a, _ in accepted] == ["raised"]  # 7 GiB, signed: believed, first
    assert accepted[0][0].containers[0][0].memory_mib == 7 * GIB
    assert any("edited" in f and "not what the node's agent signed" in f for f in report.forged)
    assert any("edited" in r and "would hold" in r for r in report.refused)  # 7 + 4 > 10
