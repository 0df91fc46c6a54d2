"""Usage sampling from regions written in C, OOM events, contention flags, dynamic limits,
cleanup of gone pods."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

from node_agent_rig import grants, make_pod, running_rig

from tessera import bus
from tessera.codec import decode, encode
from tessera.events import subscribe
from tessera.models import (
    AllocationState,
    LimitsSetReply,
    LimitsSetRequest,
    NodeLedger,
    UsageSample,
)
from tessera.region import SEALED_LIMITS_DIR, read_limits

MIB = 1 << 20


def write_region(writer: Path, path: str, uuid: str, used: int, oom: int, last_ns: int) -> None:
    subprocess.run([str(writer), path, uuid, str(used), str(oom), str(last_ns)], check=True)


async def admitted(rig, name: str, memory_mib: int, cores: int = 30, gpu: int = 0):
    pod = make_pod(name, [("main", 1)])
    allocation = await rig.bind(pod, [grants((rig.gpus[gpu], memory_mib, cores))])
    admission = await rig.kubelet.admit_pod(pod)
    assert admission.ok, admission.error
    container = admission.containers[0]
    region = container.mount("/run/tessera/region").host_path + "/usage"
    return allocation, container, region


async def next_sample(nc, node: str, predicate, timeout: float = 5.0) -> UsageSample:
    sub = await nc.subscribe(bus.usage_subject(node))
    try:
        deadline = time.monotonic() + timeout
        while True:
            msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            sample = decode(msg.data, UsageSample)
            if predicate(sample):
                return sample
    finally:
        await sub.unsubscribe()


async def test_usage_is_read_from_a_region_written_in_c(short_dir, nc, buckets, region_writer):
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu = rig.gpus[0]
        allocation, _, region = await admitted(rig, "sampled", 2000)
        ooms = subscribe(nc, f"tessera.events.oom.{rig.node}")
        write_region(region_writer, region, gpu, 512 * MIB, 0, time.time_ns())

        def has_use(sample: UsageSample) -> bool:
            return any(c.devices[0].used_bytes == 512 * MIB for c in sample.containers)

        sample = await next_sample(nc, rig.node, has_use)
        (usage,) = [c for c in sample.containers if c.pod_uid == allocation.pod_uid]
        assert (usage.namespace, usage.pod, usage.container) == ("team", "sampled", "main")
        device = usage.devices[0]
        assert device.uuid == gpu and device.limit_bytes == 2000 * MIB
        assert device.sm_limit == 30 and device.sm_util == 25.5
        assert device.last_kernel_at and abs(device.last_kernel_at - time.time()) < 10
        host = {d.uuid: d for d in sample.devices}
        assert host[gpu].used_bytes == 512 * MIB and host[gpu].total_bytes == 16000 * MIB
        # The OOM counter moves: one event, with the count.
        write_region(region_writer, region, gpu, 512 * MIB, 2, time.time_ns())
        event = (await asyncio.wait_for(anext(ooms), 5)).event
        await ooms.aclose()
        assert (event.pod_uid, event.container, event.device_uuid) == (
            allocation.pod_uid, "main", gpu
        )
        assert event.oom_count == 2


async def until(check, timeout: float = 10.0) -> None:
    """Poll `check` until true (a sampler pass on a busy host may take a while)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_active_neighbours_are_flagged_contended(short_dir, nc, buckets, region_writer):
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu = rig.gpus[0]
        _, first, first_region = await admitted(rig, "first", 2000)
        _, second, second_region = await admitted(rig, "second", 2000)
        first_dir = first.mount(SEALED_LIMITS_DIR).host_path
        second_dir = second.mount(SEALED_LIMITS_DIR).host_path
        write_region(region_writer, first_region, gpu, MIB, 0, time.time_ns())
        write_region(region_writer, second_region, gpu, MIB, 0, 0)
        # Only the first launches: the second sees an active neighbour, the first none.
        await until(lambda: read_limits(second_dir).device(gpu).contended)
        assert not read_limits(first_dir).device(gpu).contended
        for _ in range(10):
            now = time.time_ns()
            write_region(region_writer, first_region, gpu, MIB, 0, now)
            write_region(region_writer, second_region, gpu, MIB, 0, now)
            await asyncio.sleep(0.3)
            if read_limits(first_dir).device(gpu).contended:
                break
        assert read_limits(first_dir).device(gpu).contended
        assert read_limits(second_dir).device(gpu).contended
        # Both idle for longer than the activity window: the flags clear.
        long_ago = time.time_ns() - 5_000_000_000
        write_region(region_writer, first_region, gpu, MIB, 0, long_ago)
        write_region(region_writer, second_region, gpu, MIB, 0, long_ago)
        await until(lambda: not read_limits(first_dir).device(gpu).contended
                    and not read_limits(second_dir).device(gpu).contended)  # fmt: skip


async def request_limits(nc, node: str, **fields) -> LimitsSetReply:
    reply = await nc.request(
        bus.node_limits_subject(node), encode(LimitsSetRequest(**fields)), timeout=5
    )
    return decode(reply.data, LimitsSetReply)


async def test_limits_set_rewrites_the_sealed_limits(short_dir, nc, buckets, region_writer):
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu = rig.gpus[0]
        allocation, container, region = await admitted(rig, "resize", 2000)
        limits_dir = container.mount(SEALED_LIMITS_DIR).host_path
        write_region(region_writer, region, gpu, 1500 * MIB, 0, 0)
        target = {"namespace": "team", "pod": "resize", "container": "main"}
        reply = await request_limits(nc, rig.node, memory_mib=4000, cores=50, **target)
        assert reply.ok, reply.reason
        sealed = read_limits(limits_dir).device(gpu)
        assert (sealed.mem_limit_bytes, sealed.sm_limit_pct) == (4000 * MIB, 50)
        grant = (await rig.ledger()).allocations[allocation.pod_uid].containers[0][0]
        assert (grant.memory_mib, grant.cores) == (4000, 50)
        # Below what the container uses now: refused, nothing changes.
        reply = await request_limits(nc, rig.node, memory_mib=1000, **target)
        assert not reply.ok and "uses 1500 MiB" in reply.reason
        assert read_limits(limits_dir).device(gpu).mem_limit_bytes == 4000 * MIB
        # Past the GPU's capacity: refused by the ledger check.
        reply = await request_limits(nc, rig.node, memory_mib=20000, **target)
        assert not reply.ok and "not enough memory" in reply.reason
        reply = await request_limits(nc, rig.node, cores=10, container="nope", namespace="team",
                                     pod="resize")
        assert not reply.ok and "no container 'nope'" in reply.reason
        garbage = await nc.request(bus.node_limits_subject(rig.node), b"junk", timeout=5)
        assert not decode(garbage.data, LimitsSetReply).ok


async def test_cli_limits_set(short_dir, nc, buckets, nats_url):
    from typer.testing import CliRunner

    from tessera_cli.app import build_app

    async with running_rig(short_dir, nc, buckets) as rig:
        await admitted(rig, "cli", 2000)
        runner = CliRunner()
        args = ["limits", "set", rig.node, "team/cli", "main", "--memory", "3000", "--cores", "40"]
        result = await asyncio.to_thread(
            runner.invoke, build_app(), args, env={"NATS_URL": nats_url}
        )
        assert result.exit_code == 0, result.output
        assert "3000 MiB" in result.output
        result = await asyncio.to_thread(
            runner.invoke, build_app(), [*args[:5], "--memory", "999999"],
            env={"NATS_URL": nats_url},
        )
        assert result.exit_code == 1 and "not enough memory" in result.output


async def test_directories_of_gone_pods_are_removed(short_dir, nc, buckets):
    async with running_rig(short_dir, nc, buckets) as rig:
        allocation, container, _ = await admitted(rig, "gone", 1000)
        pod_dir = Path(container.mount(SEALED_LIMITS_DIR).host_path).parent.parent
        assert pod_dir.is_dir()

        def release(ledger: NodeLedger | None) -> NodeLedger:
            ledger = ledger.model_copy(deep=True)
            ledger.allocations[allocation.pod_uid].state = AllocationState.RELEASED
            return ledger

        await bus.cas_update(buckets.ledger, rig.node, NodeLedger, release)
        sampler = rig.agent.sampler
        assert await sampler.collect_garbage() == []  # kubelet still lists the pod
        assert pod_dir.is_dir()
        rig.kubelet.remove_pod(allocation.pod_uid)
        # this pass removes it, or the agent's own (its sampler collects every GC_EVERY_S, the
        # first one late on a loaded host) did a moment before: gone either way
        assert await sampler.collect_garbage() in ([allocation.pod_uid], [])
        assert not pod_dir.exists()


async def test_a_pod_allocated_while_garbage_is_judged_keeps_its_directory(
    short_dir, nc, buckets
):
    """Garbage collection reads the ledger, then kubelet's list; a pod bound and allocated in
    between is in neither fact it read. Its directory, prepared since, must stay: removing it
    failed the pod's Allocate (a clean-clone run: the prepared.json being renamed in vanished)
    or would leave a started container without its limits."""
    async with running_rig(short_dir, nc, buckets) as rig:
        sampler = rig.agent.sampler
        listing = sampler.pod_listing
        arrived: dict[str, object] = {}
        this_pass = asyncio.current_task()

        async def listed_after_an_allocation() -> set[tuple[str, str]] | None:
            facts = await listing() if listing else None  # kubelet's list, as read first
            # then the pod arrives — in this test's pass only: the agent's sampler collects too
            # (at its start, late on a loaded host, and every GC_EVERY_S), and its pass reads
            # the same listing
            if asyncio.current_task() is this_pass and "pod" not in arrived:
                arrived["pod"] = await admitted(rig, "between", 1000)
            return facts

        sampler.pod_listing = listed_after_an_allocation
        assert await sampler.collect_garbage() == []
        _, container, _ = arrived["pod"]  # type: ignore[misc]
        pod_dir = Path(container.mount(SEALED_LIMITS_DIR).host_path).parent.parent
        assert pod_dir.is_dir() and (pod_dir / f"0-{container.name}" / "prepared.json").is_file()
        sampler.pod_listing = listing
        assert await sampler.collect_garbage() == []  # the next pass sees it bound and listed
        assert pod_dir.is_dir()
