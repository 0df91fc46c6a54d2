"""A hostile tenant (tenant_rig.py) racing libvgpu's own threads: each test makes one
interleaving exact, with hold points that exist in the product (a thread held inside a log line
on a full stderr pipe, every poll thread held opening a limits file served late, a program held
in its exit handler), progress seen through the threads' kernel wait channels. Each fails on
the code before its fix."""

from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path

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
    start_time_of,
    threads_waiting,
)


def test_a_slot_taken_while_the_region_was_bad_is_never_kept(tenant):
    """CI caught this once: a process resolved its device while the region was bad and got a
    private stand-in slot; its poll thread repaired the region before the resolver re-checked,
    so the stand-in was kept and every later charge was held to that process's own allocations:
    a fresh budget beside the container's. Here that interleaving is made exact: the poll
    thread is held re-attaching (on the region file's lock) while the allocating thread takes
    its stand-in slot, and the allocating thread is held (on its log line) while the poll
    thread finishes the repair."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    tenant.truncate_region()
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(), held.path, tenant.prefix)
    file_lock = tenant.region_path.open("rb")
    try:
        assert b("init")["ok"]
        assert not b(f"alloc plain {50 * MiB}")["ok"]  # bad: refused
        fcntl.flock(file_lock, fcntl.LOCK_EX)
        tenant.write_fresh_region()
        attaching, _ = wait_for(lambda: threads_waiting(b.pid, "lock_inode_wait") == 1, 10)
        assert attaching, "b's poll thread never tried to re-attach"
        held.fill()
        b.send(f"alloc plain {50 * MiB}")  # resolves its device: the region is still bad
        resolving, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert resolving, "the allocating thread never logged its stand-in slot"
        fcntl.flock(file_lock, fcntl.LOCK_UN)
        repaired, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 2, 10)
        assert repaired, "b's poll thread never logged the repair"
        held.drain()
        if not b.recv()["ok"]:  # begun while bad: refusing it is fine, a private charge is not
            ok, _ = wait_for(lambda: b(f"alloc plain {50 * MiB}")["ok"], timeout=5, step=0.05)
            assert ok
        back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK + 50 * MiB, timeout=5)
        assert back, f"b's charge is not in the container's region: {tenant.used()}"
        assert not b(f"alloc plain {CHUNK}")["ok"]  # 950 + 300 > 1000 MiB: the container's
        assert a("phys")["phys"] <= LIMIT
    finally:
        file_lock.close()
        b.kill()
        held.close()


def test_a_charge_never_fits_against_a_region_truncated_under_it(tenant):
    """A charge that does not fit looks for dead processes' slots, under the region's lock, and
    reads the device's usage again. If the file is truncated in between, that read faults onto
    the zero page libvgpu maps in its place: it used to read 0 and charge, past the container's
    limit. Made exact: every poll thread held (the limits file served late), the charging thread
    held on its "reclaiming" log line (a full stderr pipe) while the tenant truncates."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {3 * CHUNK}")["ok"]
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(LIBCUDA_LOG_LEVEL="2"), held.path,
              tenant.prefix)  # fmt: skip
    limits = None
    try:
        assert b("init")["ok"]
        assert b(f"alloc plain {50 * MiB}")["ok"]  # 950 of 1000 MiB in the container
        limits = HeldLimitsFile(tenant.base / "sealed")
        polls, _ = wait_for(
            lambda: all(threads_waiting(p, "wait_for_partner") == 1 for p in (a.pid, b.pid)), 10
        )
        assert polls, "the poll threads never reached the limits file"
        dead_slot(tenant, region.MAX_PROCS - 1)
        held.fill()
        b.send(f"alloc plain {CHUNK}")  # 950 + 300 > 1000: looks for dead slots, logs one
        reclaiming, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert reclaiming, "the charging thread never logged the dead slot"
        tenant.truncate_region()
        held.drain()
        assert not b.recv()["ok"], "charged against a truncated region"
        limits.release()
        limits = None
        tenant.write_fresh_region()
        back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK + 50 * MiB, timeout=5)
        assert back, f"the container's usage after the repair: {tenant.used()}"
        assert a("phys")["phys"] <= LIMIT
    finally:
        if limits:
            limits.release()
        b.kill()
        held.close()


def test_a_process_whose_main_thread_ended_keeps_its_charges(tenant):
    """A program may end its main thread (pthread_exit) and go on in others: /proc then shows
    its thread group leader as a zombie (state Z, PF_EXITING) although the process lives and
    holds its memory. Another process's charge that did not fit took it for dead, reclaimed its
    slot, and fitted in the memory the live process still holds: the container past its limit.
    No timing involved: the charge looks for dead slots itself, at once."""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    assert a("mainexit")["ok"]
    zombie, _ = wait_for(
        lambda: Path(f"/proc/{a.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 10
    )
    assert zombie, "the main thread did not end"
    assert a(f"alloc plain {CHUNK}")["ok"]  # alive, and served by its other thread
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {CHUNK}")["ok"]  # 900 of 1000 MiB
    assert not b(f"alloc plain {CHUNK}")["ok"]  # 1200 > 1000, however a's leader looks
    assert tenant.used() == 3 * CHUNK
    assert a("phys")["phys"] <= LIMIT


def test_a_live_process_reclaimed_puts_its_charges_back(tenant):
    """A live process's slot freed as a sweep frees a dead one's (its pid and count zeroed, its
    share taken off the device's total) is taken back by the process; its charges used to come
    back into its slot only, not into the device's total while that total was still above the
    process's own share: the container's total then missed them for good. (A sweep itself no
    longer frees a live process's slot, whatever its start time says: test_standalone_trust.py;
    here the tenant writes what a sweep would.)"""
    a = tenant.cuctl()
    assert a("init")["ok"]
    assert a(f"alloc plain {CHUNK}")["ok"]
    b = tenant.cuctl()
    assert b("init")["ok"]
    assert b(f"alloc plain {2 * CHUNK}")["ok"]
    slots = [s for s in region.read_region(tenant.region_path).processes if s.pid == a.pid]
    assert len(slots) == 1
    i = slots[0].slot
    with open(tenant.region_path, "r+b") as f:
        f.seek(slot_off(i, "used"))
        f.write(bytes(8))
        f.seek(slot_off(i, "pid"))
        f.write(bytes(4))
        f.seek(dev_off("used_bytes"))
        f.write((2 * CHUNK).to_bytes(8, "little"))
    back, _ = wait_for(lambda: tenant.used() == 3 * CHUNK, timeout=5)
    assert back, f"the container's total misses a's charges: {tenant.used()}"
    taken = [s for s in region.read_region(tenant.region_path).processes if s.pid == a.pid]
    assert [s.slot for s in taken] == [i] and taken[0].used[0] == CHUNK
    assert not b(f"alloc plain {CHUNK}")["ok"]
    assert a("phys")["phys"] <= LIMIT


def test_a_region_truncated_while_it_is_reattached_stays_refused(tenant):
    """The poll thread re-attaches a repaired region: maps it, takes a slot, writes this
    process's charges back, then lets charges resume. A truncation in between faulted onto the
    zero page libvgpu maps in the file's place, and charges then resumed against that page: a
    budget of the whole limit while the file was truncated. Made exact: every process slot of
    the repaired file held by a live process, so the re-attach logs "region full" and is held
    there (a full stderr pipe) while the tenant truncates; then every poll thread is held (the
    limits file served late) while the process asks for memory."""
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(), held.path, tenant.prefix)
    holder = subprocess.Popen([*tenant.prefix, "sleep", "60"], env=tenant.env())
    limits = None
    try:
        assert b("init")["ok"]
        assert b(f"alloc plain {50 * MiB}")["ok"]
        tenant.truncate_region()
        bad, _ = wait_for(lambda: held.seen("was truncated"), 10)
        assert bad, "b never noticed the truncation"
        full = tenant.base / "gpu" / "full"
        region.prepare_region_file(full)
        with open(full, "r+b") as f:
            for i in range(region.MAX_PROCS):  # every slot: a live process holding nothing
                f.seek(slot_off(i, "pid"))
                f.write(holder.pid.to_bytes(4, "little"))
                f.seek(slot_off(i, "start_time"))
                f.write(start_time_of(holder.pid).to_bytes(8, "little"))
        held.fill()
        rewrite = tenant.python(
            f"data = open('{full}', 'rb').read()\n"
            f"f = open('{tenant.region_path}', 'r+b'); f.write(data)\n"
        )
        assert rewrite.returncode == 0, rewrite.stderr
        full_log, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert full_log, "b's poll thread never logged the full region"
        tenant.truncate_region()
        limits = HeldLimitsFile(tenant.base / "sealed")
        held.drain()
        polls, _ = wait_for(lambda: threads_waiting(b.pid, "wait_for_partner") == 1, 10)
        assert polls, "b's poll thread never reached the limits file"
        assert not b(f"alloc plain {CHUNK}")["ok"], "charged while the region is truncated"
        limits.release()
        limits = None
        tenant.write_fresh_region()
        ok, _ = wait_for(lambda: b(f"alloc plain {CHUNK}")["ok"], timeout=5, step=0.05)
        assert ok, "charges never resumed after the repair"
        assert tenant.used() == 50 * MiB + CHUNK
    finally:
        holder.kill()
        holder.wait()
        if limits:
            limits.release()
        b.kill()
        held.close()


def test_a_process_exiting_while_its_poll_thread_repairs_does_not_crash(tenant):
    """The poll thread saw this process's slot tampered with and went to repair it; meanwhile the
    process began to exit and gave its slot up (libvgpu's exit handler). The repair then took
    the slot that was no more (NULL): a crash at exit (SIGSEGV) while the program's own work at
    exit (a runtime's teardown) ran. Made exact: the poll thread held on its "restored" log line
    (a full stderr pipe) until the slot is given up, the program held in its exit handler."""
    held = HeldStderr()
    b = Cuctl(tenant.native.bin / "cuctl", tenant.env(), held.path, tenant.prefix)
    try:
        assert b("exitwait")["ok"]
        assert b("init")["ok"]
        assert b(f"alloc plain {50 * MiB}")["ok"]
        slots = [s for s in region.read_region(tenant.region_path).processes if s.pid == b.pid]
        assert len(slots) == 1
        held.fill()
        with open(tenant.region_path, "r+b") as f:  # the tenant zeroes b's own count
            f.seek(slot_off(slots[0].slot, "used"))
            f.write(bytes(8))
        repairing, _ = wait_for(lambda: threads_waiting(b.pid, "pipe_write") == 1, 10)
        assert repairing, "b's poll thread never logged the tampered slot"
        b.send("exit")
        assert b.recv()["exiting"]  # libvgpu's exit handler has given the slot up
        held.drain()
        done, _ = wait_for(
            lambda: b.p.poll() is not None or threads_waiting(b.pid, "nanosleep") == 1, 10
        )
        assert done, "b's poll thread never went back to sleep"
        if b.p.poll() is None:
            b.send("go")
        rc = b.p.wait(timeout=10)
        assert rc == 0, f"b died at exit: {rc}"
        assert all(s.pid != b.pid for s in region.read_region(tenant.region_path).processes)
    finally:
        b.kill()
        held.close()


def test_a_forked_child_never_takes_its_parents_charges_off(tenant):
    """Every process slot held (here by the tenant's live bogus entries): a process is counted
    in a slot of its own memory (the overflow slot), its charges in the device total. A child
    it forked copied that slot with the parent's charges in it; the child's first CUDA call
    registered it there and "corrected" the copy to the child's own (nothing), taking the
    parent's charges off the total until the parent's poll thread put them back. Made exact:
    every poll thread held (the limits file served late) while the child registers and a
    sibling allocates."""
    holder = subprocess.Popen([*tenant.prefix, "sleep", "60"], env=tenant.env())
    limits = None
    try:
        start = start_time_of(holder.pid)
        with open(tenant.region_path, "r+b") as f:
            for i in range(region.MAX_PROCS):
                f.seek(slot_off(i, "pid"))
                f.write(holder.pid.to_bytes(4, "little"))
                f.seek(slot_off(i, "start_time"))
                f.write(start.to_bytes(8, "little"))
        a = tenant.cuctl()
        assert a("init")["ok"]
        assert a(f"alloc plain {3 * CHUNK}")["ok"]
        assert tenant.used() == 3 * CHUNK
        b = tenant.cuctl()
        assert b("init")["ok"]
        assert b("info")["rc"] == 0  # libvgpu started in b: its limits read, its poll thread
        limits = HeldLimitsFile(tenant.base / "sealed")
        polls, _ = wait_for(
            lambda: all(threads_waiting(p, "wait_for_partner") == 1 for p in (a.pid, b.pid)), 10
        )
        assert polls, "the poll threads never reached the limits file"
        assert a("forkinfo")["ok"]
        assert tenant.used() == 3 * CHUNK, "the child took its parent's charges off the total"
        assert not b(f"alloc plain {CHUNK}")["ok"]
        assert a("phys")["phys"] <= LIMIT
    finally:
        if limits:
            limits.release()
        holder.kill()
        holder.wait()
