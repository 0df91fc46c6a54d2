"""`tessera.quota.status` bounded to one NATS message: every namespace in pages, one namespace's
charges cut to fit with exact totals, and `tessera quota list` following the pages. (At 10,000
namespaces with a limit each the unpaged reply was 1.28 MB, over nats-server's 1 MiB
max_payload: its publish failed and every caller timed out.)"""

from __future__ import annotations

import asyncio

from quota_testkit import call, unique_namespace
from tessera.quota import status_pages
from typer.testing import CliRunner

from tessera import bus
from tessera.codec import encode
from tessera.models import (
    DeviceQuota,
    QuotaAmount,
    QuotaCharge,
    QuotaReply,
    QuotaRequest,
    QuotaSetRequest,
    QuotaState,
    QuotaStatusRequest,
)
from tessera_cli.app import build_app

MIB = 1 << 20


def test_ten_thousand_namespaces_page_under_max_payload_and_lose_none() -> None:
    states = [QuotaState(namespace=f"team-{i:05d}", source="resourcequota:gpu-quota",
                         limits=QuotaAmount(memory_mib=40960, cores=400, gpus=4))
              for i in range(10_000)]  # fmt: skip
    devices = [DeviceQuota(namespace=f"team-{i:05d}", quota="gpu-quota", hard="4",
                           key="gpu.tessera.io.deviceclass.resource.k8s.io/devices")
               for i in range(0, 10_000, 3)]  # fmt: skip
    assert len(encode(QuotaReply(ok=True, states=states, device_quotas=devices))) > MIB
    budget = status_pages.budget_for(MIB)
    seen: list[str] = []
    quotas: list[DeviceQuota] = []
    after, pages = "", 0
    while True:
        shown, dq, more, left = status_pages.page(states, devices, after=after, budget=budget)
        reply = QuotaReply(ok=True, reason=f"{left} more after {more!r}: ask again with "
                           f"after={more!r}", states=shown, device_quotas=dq,
                           continue_after=more)  # fmt: skip
        assert len(encode(reply)) <= MIB
        seen += [s.namespace for s in shown]
        quotas += dq
        pages += 1
        if not more:
            assert left == 0
            break
        assert more == seen[-1] and left == 10_000 - len(seen)
        after = more
    assert pages >= 2 and seen == [s.namespace for s in states] and quotas == devices
    # at most `limit` namespaces when asked (the service's readiness probe asks 1)
    assert len(status_pages.page(states, devices, limit=1, budget=budget)[0]) == 1


def test_one_namespace_with_too_many_charges_lists_the_newest_and_keeps_exact_totals() -> None:
    charges = {f"pod-{i:06d}": QuotaCharge(pod_uid=f"pod-{i:06d}", name=f"worker-{i}",
                                           memory_mib=1000, cores=10, gpus=1, at=float(i))
               for i in range(20_000)}  # fmt: skip
    state = QuotaState(namespace="big", charges=charges)
    assert len(encode(state)) > MIB
    cut, left = status_pages.bounded(state, status_pages.budget_for(MIB))
    assert len(encode(QuotaReply(ok=True, reason="x" * 200, states=[cut]))) <= MIB
    assert left > 0 and len(cut.charges) + left == 20_000
    assert cut.used() == state.used() and cut.pods() == 20_000
    assert min(c.at for c in cut.charges.values()) > max(
        c.at for u, c in charges.items() if u not in cut.charges)  # the newest kept
    small = QuotaState(namespace="small", charges=dict(list(charges.items())[:3]))
    assert status_pages.bounded(small, MIB) == (small, 0)


async def run_cli(*args: str) -> tuple[int, str]:
    result = await asyncio.to_thread(CliRunner().invoke, build_app(), list(args))
    return result.exit_code, result.output


async def test_status_pages_over_the_wire_and_quota_list_follows_them(
        start_quota, nc, nats_url, monkeypatch):  # fmt: skip
    monkeypatch.setenv("NATS_URL", nats_url)
    monkeypatch.setenv("COLUMNS", "200")
    await start_quota(status_budget=2048)  # a few namespaces a page
    prefix = unique_namespace("pg")
    mine = [f"{prefix}-{i:02d}" for i in range(40)]
    for ns in mine:
        reply = await call(nc, bus.QUOTA_SET, QuotaSetRequest(
            namespace=ns, limits=QuotaAmount(memory_mib=1000 + len(ns))))  # fmt: skip
        assert reply.ok
    seen: list[str] = []
    after = ""
    while True:
        page = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(after=after))
        assert isinstance(page, QuotaReply) and page.ok, page
        seen += [s.namespace for s in page.states]
        if not page.continue_after:
            break
        assert "ask again with after=" in page.reason and page.continue_after == seen[-1]
        after = page.continue_after
    assert [ns for ns in seen if ns.startswith(prefix)] == mine
    assert len(seen) == len(set(seen)) and seen == sorted(seen)

    # one namespace whose charges exceed the budget: the newest listed, the totals exact
    busy = mine[0]
    for i in range(60):
        assert (await call(nc, bus.QUOTA_RESERVE, QuotaRequest(
            namespace=busy, pod_uid=f"uid-{i:03d}", name=f"p{i}", gpus=1))).ok  # fmt: skip
    one = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=busy))
    assert one.ok and "charges listed" in one.reason, one.reason
    assert 0 < len(one.states[0].charges) < 60 and one.states[0].used().gpus == 60

    code, out = await run_cli("quota", "get", busy)
    assert code == 0 and "charges listed" in out and "60" in out, out

    code, out = await run_cli("quota", "list")
    assert code == 0, out
    assert all(ns in out for ns in mine), out
