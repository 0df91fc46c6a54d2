"""The node agent lends a GPU's idle compute to its busy elastic containers (issue 33): the real
agent (usage sampler + lending loop) against regions written in C, allowances read back from the
sealed limits files it rewrites."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from node_agent_rig import running_rig
from test_agent_metrics import value
from test_usage_and_limits import MIB, admitted, write_region

from tessera import bus
from tessera.codec import decode
from tessera.models import ComputeReclaimEvent
from tessera.region import (
    SEALED_LIMITS_DIR,
    RegionC,
    RegionDeviceC,
    read_limits,
    set_device_flags,
)

LAST_KERNEL = RegionC.dev.offset + RegionDeviceC.last_kernel_ns.offset  # device 0's


class Busy:
    """A container's launches, stamped every 20 ms, as libvgpu stamps them from the tenant's
    process: from a process of its own, so that neither this busy test process (its GIL, the
    agent's event loop in it) nor a loaded CPU makes the container look idle for the lender's
    0.2 s (CI once saw a thread here starved that long, and the lender rightly lent again)."""

    SCRIPT = (
        "import os, sys, time\n"
        "region, offset = sys.argv[1], int(sys.argv[2])\n"
        "while True:\n"
        "    try:\n"
        "        fd = os.open(region, os.O_WRONLY)\n"
        "    except FileNotFoundError:\n"
        "        break  # the container is gone\n"
        "    os.pwrite(fd, time.time_ns().to_bytes(8, 'little'), offset)\n"
        "    os.close(fd)\n"
        "    time.sleep(0.02)\n"
    )

    def __init__(self, region: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, region, str(LAST_KERNEL)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    async def stop(self) -> None:
        self._proc.kill()
        await asyncio.to_thread(self._proc.wait)


async def wait_allowance(limits_dir: str, gpu: str, want: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    got = -1
    while time.monotonic() < deadline:
        got = read_limits(limits_dir).device(gpu).sm_allow_x100
        if got == want:
            return got
        await asyncio.sleep(0.02)
    return got


async def test_idle_compute_is_lent_to_the_busy_elastic_container_and_taken_back(
    short_dir, nc, buckets, region_writer
):
    async with running_rig(short_dir, nc, buckets) as rig:
        gpu = rig.gpus[0]
        _, elastic, elastic_region = await admitted(rig, "elastic", 2000, cores=30)
        _, hard, hard_region = await admitted(rig, "hard", 2000, cores=30)
        elastic_dir = elastic.mount(SEALED_LIMITS_DIR).host_path
        hard_dir = hard.mount(SEALED_LIMITS_DIR).host_path
        # What elmemory's grant will seal: a burst beside the guarantee (here by hand).
        assert set_device_flags(elastic_dir, gpu, sm_burst_pct=100)

        # Only the elastic one busy: it is lent the whole card (its burst).
        write_region(region_writer, elastic_region, gpu, MIB, 0, 0)
        write_region(region_writer, hard_region, gpu, MIB, 0, 0)
        busy_elastic = Busy(elastic_region)
        assert await wait_allowance(elastic_dir, gpu, 10000) == 10000
        # The hard slice wakes: weighted fair share, 30:30, the hard one capped at its 30 %.
        busy_hard = Busy(hard_region)
        t0 = time.monotonic()
        assert await wait_allowance(elastic_dir, gpu, 7000) == 7000
        taken_back = time.monotonic() - t0
        assert taken_back < 2.0, taken_back  # within a sample or two on a loaded machine
        assert read_limits(hard_dir).device(gpu).sm_allow_x100 == 0  # a hard slice: untouched
        # what the agent's metrics say: guaranteed 30, burst 100, allowance 70 (40 lent), and
        # one reclaim (100 -> 70). The lender publishes its view at the end of the tick that
        # rewrote the file, so a scrape may lag the file by that one tick (CI saw it once).
        who = {"namespace": "team", "pod": "elastic", "container": "main", "device_uuid": gpu}
        want = {"guaranteed": 30, "burst_limit": 100, "allowance": 70, "lent": 40}
        deadline = time.monotonic() + 2.0
        while True:
            text = rig.agent.metrics.render()
            figures = {k: value(text, "tessera_node_agent_compute_share_pct", kind=k, **who)
                       for k in want}
            if figures == want or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert figures == want
        assert value(text, "tessera_node_agent_compute_reclaims_total", **who) == 1
        # The elastic one goes idle: back to its guarantee (held for it when it wakes).
        await busy_elastic.stop()
        assert await wait_allowance(elastic_dir, gpu, 3000) == 3000
        await busy_hard.stop()


async def test_a_hard_slice_waking_publishes_coalesced_compute_reclaim_events(
    short_dir, nc, buckets, region_writer
):
    """What an operator sees when lent compute is taken back: a ComputeReclaimEvent on the bus
    and a Normal ComputeReclaimed Event on the pod at the first reclaim, then at most one summary
    per window (here 3 s) however often the neighbour wakes."""
    window_s = 3.0
    async with running_rig(short_dir, nc, buckets,
                           compute_reclaim_event_window_s=window_s) as rig:  # fmt: skip
        gpu = rig.gpus[0]
        js = nc.jetstream()
        sub = await js.subscribe(bus.compute_event_subject(rig.node, "reclaimed"),
                                 ordered_consumer=True)  # fmt: skip
        allocation, elastic, elastic_region = await admitted(rig, "elastic", 2000, cores=30)
        _, _, hard_region = await admitted(rig, "hard", 2000, cores=30)
        elastic_dir = elastic.mount(SEALED_LIMITS_DIR).host_path
        assert set_device_flags(elastic_dir, gpu, sm_burst_pct=100)
        write_region(region_writer, elastic_region, gpu, MIB, 0, 0)
        write_region(region_writer, hard_region, gpu, MIB, 0, 0)
        busy: dict[str, Busy] = {}

        def wake(region: str) -> None:
            busy[region] = Busy(region)

        async def sleep(region: str) -> None:
            await busy.pop(region).stop()

        wake(elastic_region)
        assert await wait_allowance(elastic_dir, gpu, 10000) == 10000
        wake(hard_region)  # the first reclaim: 100 -> 70 %, for the hard slice
        first = decode((await sub.next_msg(timeout=15)).data, ComputeReclaimEvent)
        assert (first.node, first.device_uuid, first.namespace, first.pod, first.container) == (
            rig.node, gpu, "team", "elastic", "main")
        assert first.pod_uid == allocation.pod_uid
        assert (first.reclaims, first.max_taken_pct, first.allowance_pct) == (1, 30, 70)
        assert (first.guarantee_pct, first.burst_limit_pct) == (30, 100)
        assert first.for_pods == ["team/hard"]
        assert first.window_s == window_s
        pod_events = [e for e in rig.cluster.events if e["reason"] == "ComputeReclaimed"]
        assert len(pod_events) == 1
        assert pod_events[0]["type"] == "Normal"
        assert pod_events[0]["involved"]["name"] == "elastic"
        assert "team/hard" in pod_events[0]["message"]
        # The neighbour naps and wakes again within the window: a second reclaim, held.
        await sleep(hard_region)
        assert await wait_allowance(elastic_dir, gpu, 10000) == 10000
        wake(hard_region)
        assert await wait_allowance(elastic_dir, gpu, 7000) == 7000
        # ... reported once the window has ended, as one summary, not before
        second = decode((await sub.next_msg(timeout=15)).data, ComputeReclaimEvent)
        assert second.at >= first.first_at + window_s  # not before the window ended
        assert second.reclaims >= 1 and second.first_at > first.last_at
        assert second.for_pods == ["team/hard"]
        assert len([e for e in rig.cluster.events if e["reason"] == "ComputeReclaimed"]) == 2
        text = rig.agent.metrics.render()
        who = {"namespace": "team", "pod": "elastic", "container": "main", "device_uuid": gpu}
        assert value(text, "tessera_node_agent_compute_reclaims_total", **who) >= (
            first.reclaims + second.reclaims)
        await sleep(hard_region)
        await sleep(elastic_region)
        await sub.unsubscribe()
