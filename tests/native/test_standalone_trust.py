"""libvgpu used without the lease service (sealed limits, no `lease` flag): the region is the
container's account, and every byte of it is the tenant's to write. A process of the tenant
rewriting its siblings' slots, or truncating the file under a lock holder, must not take the
container past its sealed limit, leave a sibling's count wrong, or hang a process. Each test
fails on the code before its fix (the hostile tenant's rig: tenant_rig.py)."""

from __future__ import annotations

import time

from tessera import region

from .conftest import Cuctl, MiB, wait_for
from .tenant_rig import (
    CHUNK,
    LIMIT,
    HeldLimitsFile,
    HeldStderr,
    dead_slot,
    dev_off,
    slot_off,
    threads_waiting,
)


def slot_of(tenant, pid: int) -> region.ProcessUsage | None:
    u = region.read_region(tenant.region_path)
    return next((s for s in u.processes if s.pid == pid), None) if u else None


def test_a_live_process_whose_start_time_is_rewritten_keeps_its_charge(tenant):
    """A tenant rewrote a live process's start time in its slot: the pid then looked reused, so
    a sibling's charge that did not fit reclaimed that slot (uncharged it) and fitted in the
    memory the live process still held: 1200 MiB of a 1000 MiB slice on the device. Now a
    slot belongs to whoever holds its kernel lock, whatever the slot says."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {2 * CHUNK}")["ok"]  # 900 of 1000 MiB in the container
    mine = slot_of(tenant, a.pid)
    assert mine is not None
    with open(tenant.region_path, "r+b") as f:  # the tenant's write: "a's pid was reused"
        f.seek(slot_off(mine.slot, "start_time"))
        f.write((1).to_bytes(8, "little"))
    assert not b(f"alloc plain {CHUNK}")["ok"], "a live process's charge was reclaimed"
    assert a("phys")["phys"] <= LIMIT
    assert tenant.used() == 3 * CHUNK
    # its pid made another live process's: still a's (no process may take or reclaim it)
    with open(tenant.region_path, "r+b") as f:
        f.seek(slot_off(mine.slot, "pid"))
        f.write(b.pid.to_bytes(4, "little"))
    c = tenant.cuctl()
    assert c("init")["ok"]
    assert not c(f"alloc plain {CHUNK}")["ok"]
    assert a("phys")["phys"] <= LIMIT


def test_a_free_never_writes_into_a_slot_another_process_took(tenant):
    """The tenant marked a live process's slot free (its pid zeroed). A process starting then
    registered into it, and the live process's next free wrote its own count through the slot
    pointer it kept, over the newcomer's: the newcomer's 50 MiB gone from its slot (what NVML
    shows for it, what is uncharged when it dies) until its poll thread put it back. Made
    exact: every poll thread held (the limits file served late) while c registers and a
    frees."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    held = a(f"alloc plain {CHUNK}")
    assert held["ok"]
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {2 * CHUNK}")["ok"]
    c = tenant.cuctl()
    assert c("nvml")["rc"] == 0  # libvgpu started in c (limits read), not yet registered
    limits = None
    try:
        limits = HeldLimitsFile(tenant.base / "sealed")
        polls, _ = wait_for(
            lambda: all(threads_waiting(p, "wait_for_partner") == 1 for p in (a.pid, b.pid)), 10
        )
        assert polls, "the poll threads never reached the limits file"
        i = slot_of(tenant, a.pid).slot
        with open(tenant.region_path, "r+b") as f:  # "free": the tenant zeroes a's pid
            f.seek(slot_off(i, "pid"))
            f.write(bytes(4))
        assert c("init")["ok"]  # registers in a free slot
        assert c(f"alloc plain {50 * MiB}")["ok"]
        assert a(f"free {held['id']}")["ok"]  # a gives its CHUNK back
        mine = slot_of(tenant, c.pid)
        assert mine is not None and mine.used[0] == 50 * MiB, f"c's slot: {mine}"
        assert tenant.used() == 2 * CHUNK + 50 * MiB
        back = slot_of(tenant, a.pid)  # a's free put its own slot right first
        assert back is not None and back.slot == i and back.used[0] == 0
    finally:
        if limits:
            limits.release()
    assert b(f"alloc plain {CHUNK}")["ok"]  # 950 of 1000 MiB
    assert not b(f"alloc plain {CHUNK}")["ok"]
    assert a("phys")["phys"] <= LIMIT


def test_a_thread_waiting_on_the_lock_of_a_truncated_region_does_not_hang(tenant):
    """A holds the region's lock (held on its log line, a full stderr pipe) while b's charge
    waits for it; the tenant truncates the file. A's next access faults onto the zero page
    libvgpu maps in the file's place and it releases that page's lock: nobody ever woke b,
    asleep on the file's. Now b waits in slices and sees the truncation: its charge is refused
    at once, and charges resume once the region is repaired. Every poll thread held (the limits
    file served late): b finds out by itself."""
    a_err = HeldStderr()
    a = Cuctl(tenant.native.bin / "cuctl", tenant.env(LIBCUDA_LOG_LEVEL="2"), a_err.path,
              tenant.prefix)  # fmt: skip
    b = tenant.cuctl()
    limits = None
    try:
        assert a("init")["ok"]
        assert a(f"alloc plain {3 * CHUNK}")["ok"]
        assert b("init")["ok"]
        assert b(f"alloc plain {10 * MiB}")["ok"]
        limits = HeldLimitsFile(tenant.base / "sealed")
        polls, _ = wait_for(
            lambda: all(threads_waiting(p, "wait_for_partner") == 1 for p in (a.pid, b.pid)), 10
        )
        assert polls, "the poll threads never reached the limits file"
        dead_slot(tenant, region.MAX_PROCS - 1)
        a_err.fill()
        a.send(f"alloc plain {CHUNK}")  # does not fit: looks for dead slots, logs one, held
        holding, _ = wait_for(lambda: threads_waiting(a.pid, "pipe_write") == 1, 10)
        assert holding, "a never logged the dead slot under the lock"
        waiting_before = threads_waiting(b.pid, "futex")
        b.send(f"alloc plain {10 * MiB}")
        waiting, _ = wait_for(lambda: threads_waiting(b.pid, "futex") > waiting_before, 10)
        assert waiting, "b never waited for the region's lock"
        tenant.truncate_region()
        a_err.drain()
        t0 = time.monotonic()
        assert not b.recv(timeout=5)["ok"], "charged against a truncated region"
        assert time.monotonic() - t0 < 2
        assert not a.recv(timeout=5)["ok"]
        limits.release()
        limits = None
        tenant.write_fresh_region()
        ok, _ = wait_for(lambda: b(f"alloc plain {10 * MiB}")["ok"], timeout=5, step=0.05)
        assert ok, "charges never resumed after the repair"
        assert a("phys")["phys"] <= LIMIT
    finally:
        if limits:
            limits.release()
        a.kill()
        b.kill()
        a_err.close()


def test_a_lock_word_the_tenant_forged_is_waited_for_a_bounded_time(tenant):
    """The tenant wrote a lock word naming a thread that will never release it: every charge
    used to wait on it for ever. Now one waits TV_REGION_LOCK_WAIT_MS and is refused (never
    fails open), and the process's other work goes on."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    lock = region.RegionC.lock.offset
    with open(tenant.region_path, "r+b") as f:  # glibc's lock word: owner tid 1, waiters
        f.seek(lock)
        f.write((1 | 0x80000000).to_bytes(4, "little"))
    t0 = time.monotonic()
    assert not a(f"alloc plain {CHUNK}", timeout=10)["ok"]
    assert time.monotonic() - t0 < 5
    assert a("info")["rc"] == 0
    assert a("phys")["phys"] <= LIMIT


def test_a_forked_childs_slot_is_reclaimed_when_it_ends_before_its_parent(tenant):
    """A slot is held by its process's own description of the region file. A forked child
    inherits its parent's: it must open one of its own before it registers, or its slot's lock
    would live on in the parent after the child ended (never reclaimed by any other process: a
    slot lost for every worker a program forks) and the parent's in the child after the parent
    ended. Every poll thread held: b's charge is what looks for dead slots."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    assert a("forkinfo")["ok"]  # a child registers at its first call, then _exit()s
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {2 * CHUNK}")["ok"]
    limits = None
    try:
        limits = HeldLimitsFile(tenant.base / "sealed")
        polls, _ = wait_for(
            lambda: all(threads_waiting(p, "wait_for_partner") == 1 for p in (a.pid, b.pid)), 10
        )
        assert polls, "the poll threads never reached the limits file"
        assert len(region.read_region(tenant.region_path).processes) == 3
        assert not b(f"alloc plain {CHUNK}")["ok"]  # does not fit: looks for dead slots
        pids = sorted(s.pid for s in region.read_region(tenant.region_path).processes)
        assert pids == sorted((a.pid, b.pid)), "the ended child's slot was kept"
    finally:
        if limits:
            limits.release()
    assert tenant.used() == 3 * CHUNK


def test_counters_the_tenant_zeroed_make_no_room_beside_what_processes_hold(tenant):
    """The tenant zeroes a sibling's count and the device's total: a charge then read room that
    the sibling still held, and took it before any poll thread put the counters back (a tick:
    here every poll thread held): 1,550 MiB of a 1,000 MiB slice on the device. Now every byte
    charged is also a byte its process holds locked in the region file (kacct.c): what the
    processes hold leaves no room, whatever the counters say."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {2 * CHUNK}")["ok"]
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {50 * MiB}")["ok"]
    limits = None
    try:
        limits = HeldLimitsFile(tenant.base / "sealed")
        polls, _ = wait_for(
            lambda: all(threads_waiting(p, "wait_for_partner") == 1 for p in (a.pid, b.pid)), 10
        )
        assert polls, "the poll threads never reached the limits file"
        i = slot_of(tenant, a.pid).slot
        with open(tenant.region_path, "r+b") as f:  # a's count and the total: nothing
            f.seek(slot_off(i, "used"))
            f.write(bytes(8))
            f.seek(dev_off("used_bytes"))
            f.write(bytes(8))
        assert not b(f"alloc plain {3 * CHUNK}")["ok"], "charged in room a still holds"
        assert a("phys")["phys"] <= LIMIT
        assert b(f"alloc plain {CHUNK}")["ok"]  # what is really left: 350 MiB
        assert a("phys")["phys"] <= LIMIT
    finally:
        if limits:
            limits.release()
    back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK + 50 * MiB, timeout=5)
    assert back, f"the total was never put back: {tenant.used()}"


def test_the_locked_account_fills_every_gap_a_freeing_process_leaves(tenant):
    """The account in file locks holds byte ranges: two processes allocating in turn hold
    interleaved ones, and when one frees everything (in no order), the other's next charge must
    find the room in the twenty gaps it left, exactly up to the limit and not a byte past it."""
    a, b = tenant.cuctl(), tenant.cuctl()
    assert a("init")["ok"] and b("init")["ok"]
    piece = LIMIT // 40
    ids = []
    for _ in range(20):
        got = a(f"alloc plain {piece}")
        assert got["ok"]
        ids.append(got["id"])
        assert b(f"alloc plain {piece}")["ok"]
    assert not a(f"alloc plain {MiB}")["ok"]  # the slice is full
    for i in ids[1::2] + ids[::2]:
        assert a(f"free {i}")["ok"]
    assert b(f"alloc plain {LIMIT // 2}")["ok"], "the gaps a left were not found"
    assert not b(f"alloc plain {MiB}")["ok"]
    assert not a(f"alloc plain {MiB}")["ok"]
    assert tenant.used() == LIMIT
    assert a("phys")["phys"] <= LIMIT
