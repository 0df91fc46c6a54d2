"""Scrub-on-free for pods (issue 19, item 7): the tessera.io/scrub-on-free annotation (carried
by the allocation) or the node agent's own setting seals the flag into the container's limits;
off by default."""

from __future__ import annotations

import pytest
from node_agent_rig import grants, make_pod, running_rig

from tessera import bus
from tessera.models import NodeLedger
from tessera.region import SEALED_LIMITS_DIR, read_limits


async def sealed_scrub(rig, name: str, annotated: bool) -> bool:
    pod = make_pod(name, [("main", 1)])
    allocation = await rig.bind(pod, [grants((rig.gpus[0], 1000, 30))])
    if annotated:  # what the scheduler records for a pod with the annotation

        def mutate(ledger: NodeLedger | None) -> NodeLedger:
            assert ledger is not None
            ledger = ledger.model_copy(deep=True)
            ledger.allocations[allocation.pod_uid].scrub_on_free = True
            return ledger

        await bus.cas_update(rig.buckets.ledger, rig.node, NodeLedger, mutate)
    admission = await rig.kubelet.admit_pod(pod)
    assert admission.ok, admission.error
    limits_dir = admission.containers[0].mount(SEALED_LIMITS_DIR).host_path
    return read_limits(limits_dir).scrub_on_free


@pytest.mark.parametrize(
    ("node_setting", "annotated", "expected"),
    [(False, False, False), (False, True, True), (True, False, True)],
    ids=["off-by-default", "pod-annotation", "node-setting"],
)
async def test_scrub_on_free_is_sealed_into_the_limits(
    short_dir, nc, buckets, node_setting, annotated, expected
):
    async with running_rig(short_dir, nc, buckets, scrub_on_free=node_setting) as rig:
        assert await sealed_scrub(rig, "scrub", annotated) is expected
