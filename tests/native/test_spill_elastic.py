"""Spill beside elastic memory (docs/elastic.md, "Spilling to host memory"): with the node
agent's real lease service as the container's account, a borrow the card cannot lend (a
neighbour's guarantee is booked) spills to host memory instead of failing, and nothing of it is
leased, borrowed or on the fake card; without the opt-in the same allocation is an OOM."""

from __future__ import annotations

import dataclasses

import pytest
from tessera.node_agent.spill_metrics import spill_totals

from tessera import region

from .elastic_rig import ElasticNode, GiB

BORROWER = "c3333333-3333-4333-8333-333333333333"
NEIGHBOUR = "d4444444-4444-4444-8444-444444444444"


def with_spill(pod, spill_bytes: int) -> None:
    """Seal the pod's limits again with a spill bound (what the agent seals from the pod's
    tessera.io/gpumem-spill)."""
    sealed = region.read_limits(pod.cdir.limits_dir)
    region.seal_limits(pod.cdir.limits_dir, dataclasses.replace(sealed, spill_bytes=spill_bytes))


@pytest.mark.parametrize("spill", [True, False], ids=["spill", "no-spill"])
def test_a_borrow_the_card_cannot_lend_spills(node: ElasticNode, spill: bool) -> None:
    pod = node.pod(BORROWER, "burst", guarantee_mib=4096, limit_mib=12288)
    if spill:
        with_spill(pod, 2 * GiB)
    node.book({NEIGHBOUR: 8192})  # a neighbour's 8 GiB guarantee is due on the 16 GiB card
    b = pod.cuctl()
    for _ in range(8):  # its guarantee and the 4 GiB nobody is guaranteed
        r = b(f"alloc plain {GiB}")
        assert r["ok"], (r, node.diagnosis(b))
    assert node.held(pod) == (8 * GiB, 4 * GiB)
    r = b(f"alloc plain {GiB}")  # beyond: the lease service refuses the borrow
    if not spill:
        assert r["rc"] == 2, r
        assert region.read_region(pod.cdir.region_file).spilled_bytes == 0
        assert spill_totals(node.store.all()) == (0, 0, 0)  # the node: nothing promised
        return
    assert r["ok"], (r, node.diagnosis(b))
    usage = region.read_region(pod.cdir.region_file)
    assert usage.spilled_bytes == GiB
    assert usage.devices[0].used_bytes == 8 * GiB
    assert node.held(pod) == (8 * GiB, 4 * GiB)  # no lease, nothing more borrowed
    assert b("phys")["phys"] == 8 * GiB  # the card: only what was leased
    assert b(f"alloc plain {GiB}")["ok"]  # the bound: 2 GiB
    # what the node agent's /metrics says of the node: 2 GiB promised, all of it spilled
    assert spill_totals(node.store.all()) == (2 * GiB, 2 * GiB, 1)
    assert b(f"alloc plain {GiB}")["rc"] == 2
    assert b(f"free {r['id']}")["ok"]
    assert region.read_region(pod.cdir.region_file).spilled_bytes == GiB
