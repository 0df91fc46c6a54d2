"""Opt-in spill to host memory (tessera.io/gpumem-spill, sealed limits 1.3; docs/elastic.md):
a cuMemAlloc the device cannot hold is served from managed memory that prefers the CPU, charged
to the container's spill account and never to the device; off by default, bounded, and never
moved onto the device behind the limit. On the fake driver, whose managed memory follows CUDA's
documented residency (populated on access; a preferred location of the CPU keeps it on the
host; cuMemPrefetchAsync migrates)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess

import pytest

from tessera import region

from .conftest import SAN, MiB, wait_for

LIMIT = 100 * MiB
SPILL = 150 * MiB
OOM, INVALID_VALUE, NOT_FOUND = 2, 1, 500
MODES = ["direct"] if SAN else ["direct", "dlsym", "procaddr"]


def seal(container, spill: int = SPILL, limit: int = LIMIT):
    return container.seal(region.DeviceLimit("", limit), spill_bytes=spill)


def test_an_allocation_past_the_limit_spills_to_host_memory(container):
    """Past its 100 MiB limit a container that may spill 150 MiB gets its allocation: the
    device's view and the fake GPU's physical memory stay at what is on the card, the spill is
    counted apart, the memory works, and a device access leaves it on the host."""
    seal(container)
    c = container.cuctl()
    assert c("init")["ok"]
    on_card = c(f"alloc plain {80 * MiB}")
    assert on_card["ok"]
    spilled = c(f"alloc plain {60 * MiB}")  # 80 + 60 > 100: beyond the limit
    assert spilled["ok"], spilled
    assert container.used() == 80 * MiB  # the device's account: only what is on the card
    usage = container.usage()
    assert (usage.spilled_bytes, usage.spill_limit_bytes) == (60 * MiB, SPILL)
    assert usage.spilled_peak_bytes == 60 * MiB
    assert [p.spilled_bytes for p in usage.processes] == [60 * MiB]
    assert usage.devices[0].oom_count == 0  # the program got its memory: no OOM to report
    assert c("info")["free"] == LIMIT - 80 * MiB  # what programs read: the card only
    assert c("phys")["phys"] == 80 * MiB
    assert c(f"where {on_card['id']}")["on_dev"] == -1  # plain device memory
    assert c(f"write {spilled['id']} 7")["ok"]  # a device copy into it ...
    assert c(f"check {spilled['id']} 7")["ok"]
    assert c(f"where {spilled['id']}")["on_dev"] == 0  # ... reaches it on the host
    assert c("phys")["phys"] == 80 * MiB
    assert c(f"free {spilled['id']}")["ok"]
    assert container.usage().spilled_bytes == 0
    assert c(f"alloc plain {20 * MiB}")["ok"]  # the device itself is as before
    c.close()


PITCH_WIDTH = 300 * 1024  # cuctl's `alloc pitch`: rows of 300 KiB (a multiple of 512)


@pytest.mark.parametrize("kind", ["pitch", "async", "pool"])
def test_the_other_linear_allocations_spill_too(container, kind):
    """cuMemAllocPitch, cuMemAllocAsync and cuMemAllocFromPoolAsync (a pool the program made)
    past the limit spill as cuMemAlloc does: counted apart, off the card, usable, and given
    back by either free (cuMemFree; cuMemFreeAsync after the stream's work)."""
    seal(container)
    c = container.cuctl()
    assert c("init")["ok"]
    if kind == "pool":
        assert c("pool_create")["ok"]
    assert c(f"alloc {kind} {80 * MiB}")["ok"]
    spilled = c(f"alloc {kind} {60 * MiB}")  # 80 + 60 > 100: beyond the limit
    assert spilled["ok"], (spilled, c.stderr())
    size = 60 * MiB // PITCH_WIDTH * PITCH_WIDTH if kind == "pitch" else 60 * MiB
    assert container.used() <= 81 * MiB  # the device's account: what is on the card
    usage = container.usage()
    assert usage.spilled_bytes == size  # a pitched one: its rows at a 512-byte pitch
    assert usage.devices[0].oom_count == 0
    assert c(f"where {spilled['id']}")["on_dev"] == 0  # managed memory, on the host
    assert c(f"write {spilled['id']} 7")["ok"] and c(f"check {spilled['id']} 7")["ok"]
    assert c(f"where {spilled['id']}")["on_dev"] == 0
    assert c("phys")["phys"] <= 81 * MiB  # the fake card holds only what is on it
    assert c(f"{'free' if kind == 'pitch' else 'freeasync'} {spilled['id']}")["ok"]
    assert container.usage().spilled_bytes == 0
    c.close()


@pytest.mark.parametrize("pool", ["export", f"max {120 * MiB}"], ids=["exportable", "bounded"])
def test_a_pool_the_program_exports_or_bounds_never_spills(container, pool):
    """An exportable pool's pointers must be the pool's (cuMemPoolExportPointer), and a pool
    the program bounded (maxSize) says itself how much it may hold: past the limit, an OOM as
    before, nothing spilled."""
    seal(container)
    c = container.cuctl()
    assert c("init")["ok"]
    assert c(f"pool_create {pool}")["ok"]
    assert c(f"alloc pool {80 * MiB}")["ok"]
    assert c(f"alloc pool {60 * MiB}")["rc"] == OOM
    assert container.usage().spilled_bytes == 0
    assert c(f"alloc async {60 * MiB}")["ok"]  # the device's own pool still spills
    assert container.usage().spilled_bytes == 60 * MiB
    c.close()


def test_a_stream_ordered_free_of_spilled_memory(container):
    """cuMemFreeAsync of a pointer that was spilled: freed once the stream's work is done, and
    given back to the spill account."""
    seal(container)
    c = container.cuctl()
    c("init")
    assert c(f"alloc plain {LIMIT}")["ok"]
    spilled = c(f"alloc plain {SPILL}")
    assert spilled["ok"] and container.usage().spilled_bytes == SPILL
    assert c(f"freeasync {spilled['id']}")["ok"]
    assert container.usage().spilled_bytes == 0
    assert c(f"alloc plain {SPILL}")["ok"]  # the whole bound again
    c.close()


def test_spill_is_off_by_default_and_bounded(container):
    """Without a spill limit an allocation past the limit is an OOM as before; with one, the
    spills of all the container's processes together stay within it."""
    seal(container, spill=0)
    c = container.cuctl()
    c("init")
    assert c(f"alloc plain {80 * MiB}")["ok"]
    assert c(f"alloc plain {60 * MiB}")["rc"] == OOM
    assert container.usage().spilled_bytes == 0
    assert container.usage().devices[0].oom_count == 1
    c.close()
    seal(container)  # a new generation: 150 MiB may spill
    a, b = container.cuctl(), container.cuctl()
    for p in (a, b):
        p("init")
    assert a(f"alloc plain {LIMIT}")["ok"]  # the card's share is full
    assert a(f"alloc plain {100 * MiB}")["ok"]  # spilled
    assert b(f"alloc plain {60 * MiB}")["rc"] == OOM  # 100 + 60 > 150, from another process
    ok = b(f"alloc plain {50 * MiB}")
    assert ok["ok"]
    usage = container.usage()
    assert usage.spilled_bytes == 150 * MiB
    assert sorted(p.spilled_bytes for p in usage.processes) == [50 * MiB, 100 * MiB]
    assert b(f"free {ok['id']}")["ok"]
    assert container.usage().spilled_bytes == 100 * MiB
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["plain", "pitch", "async"])
def test_a_full_card_spills(cluster, kind):
    """The driver's own OOM (a neighbour fills the physical card) spills too."""
    neighbour, spiller = cluster.container("neighbour"), cluster.container("spiller")
    n = neighbour.cuctl(FAKE_GPU_MEM_MB="512")
    n("init")
    assert n(f"alloc plain {450 * MiB}")["ok"]  # no limit: the card itself
    spiller.seal(region.DeviceLimit("", 0), spill_bytes=SPILL)  # no device limit at all
    s = spiller.cuctl(FAKE_GPU_MEM_MB="512")
    s("init")
    r = s(f"alloc {kind} {100 * MiB}")  # 450 + 100 > 512: the driver says no, host memory yes
    assert r["ok"], r
    assert s("phys")["phys"] == 450 * MiB
    size = 100 * MiB // PITCH_WIDTH * PITCH_WIDTH if kind == "pitch" else 100 * MiB
    assert spiller.usage().spilled_bytes == size
    assert s(f"alloc {kind} {60 * MiB}")["ok"]  # still fits the card
    assert s("phys")["phys"] > 500 * MiB
    n.close()
    s.close()


@pytest.mark.parametrize("mode", MODES)
def test_spilled_memory_cannot_be_moved_onto_the_device(container, mode):
    """A program cannot prefetch or advise spilled memory onto the card behind its limit: it
    gets CUDA_ERROR_INVALID_VALUE, as for any memory cuMemAlloc returned. Its own managed
    memory (charged to the device in full) still can, on every route."""
    seal(container)
    c = container.cuctl(mode)
    c("init")
    own = c(f"alloc managed {LIMIT // 2}")
    assert own["ok"]
    spilled = c(f"alloc plain {LIMIT}")  # 50 + 100 > 100
    assert spilled["ok"]
    assert container.usage().spilled_bytes == LIMIT
    for line in (f"prefetch {spilled['id']} dev", f"advise {spilled['id']} prefer dev",
                 f"advise {spilled['id']} accessed dev", f"prefetch {spilled['id']} cpu"):
        assert c(line)["rc"] == INVALID_VALUE, line
    if mode == "direct":  # CUDA 13's batch (the fake driver has none: only libvgpu answers)
        assert c(f"prefetchbatch {spilled['id']}")["rc"] == INVALID_VALUE
        assert c(f"prefetchbatch {own['id']}")["rc"] == NOT_FOUND  # passed on to the driver
    assert c(f"where {spilled['id']}")["on_dev"] == 0
    assert c("phys")["phys"] == 0  # managed memory is populated on access: nothing yet
    assert c(f"prefetch {own['id']} dev")["ok"]  # the program's own managed memory
    assert c(f"where {own['id']}")["on_dev"] == LIMIT // 2
    assert c("phys")["phys"] == LIMIT // 2
    assert c(f"prefetch {own['id']} cpu")["ok"]
    assert c("phys")["phys"] == 0
    c.close()


def test_the_spill_of_a_dead_process_is_given_back(container):
    """A process killed while holding spilled memory leaves nothing charged: the next one may
    spill the whole limit again."""
    seal(container)
    a = container.cuctl()
    a("init")
    assert a(f"alloc plain {LIMIT}")["ok"]
    assert a(f"alloc plain {SPILL}")["ok"]
    assert container.usage().spilled_bytes == SPILL
    a.p.send_signal(signal.SIGKILL)
    a.p.wait()
    b = container.cuctl()
    b("init")
    assert b(f"alloc plain {LIMIT}")["ok"]  # the dead process's device share is back too
    r = b(f"alloc plain {SPILL}")
    assert r["ok"], r
    got, _ = wait_for(lambda: container.usage().spilled_bytes == SPILL, timeout=5)
    assert got
    b.close()
    a.close(check=False)


def test_a_gpu_without_concurrent_managed_access_never_spills(container):
    """Where managed memory is created on the device (no concurrent managed access), a spill
    would put memory on the card uncharged: the allocation is an OOM instead."""
    seal(container)
    c = container.cuctl(FAKE_CONCURRENT_MANAGED="0")
    c("init")
    assert c(f"alloc plain {LIMIT}")["ok"]
    assert c(f"alloc plain {10 * MiB}")["rc"] == OOM
    assert container.usage().spilled_bytes == 0
    assert c("phys")["phys"] == LIMIT
    c.close()


def test_an_older_limits_file_never_spills(container, tmp_path):
    """A limits file of minor < 3 (a node agent from before spill) has no spill field: whatever
    its reserved bytes hold, nothing spills."""
    sealed = seal(container)
    path = container.limits_dir / region.LIMITS_FILE_NAME
    raw = bytearray(path.read_bytes())
    c_limits = region.LimitsC.from_buffer(raw)
    c_limits.minor = 2
    c_limits.checksum = region.fnv1a64(bytes(raw[: region.LimitsC.checksum.offset]))
    path.chmod(0o644)
    path.write_bytes(bytes(raw))
    assert region.read_limits(container.limits_dir).spill_bytes == 0
    assert sealed.spill_bytes == SPILL
    c = container.cuctl()
    c("init")
    assert c(f"alloc plain {LIMIT}")["ok"]
    assert c(f"alloc plain {10 * MiB}")["rc"] == OOM
    c.close()


@pytest.mark.valgrind
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="no valgrind")
@pytest.mark.skipif(bool(SAN), reason="not with ASan")
def test_the_spill_path_is_valgrind_clean(container, native):
    """A spill, its use, a refused prefetch and the frees under valgrind memcheck; then a
    pitched and a stream-ordered spill and their frees."""
    seal(container, spill=8 * MiB, limit=8 * MiB)
    script = (f"init\nalloc plain {6 * MiB}\nalloc plain {4 * MiB}\nwrite 1 7\ncheck 1 7\n"
              "prefetch 1 dev\nfree 1\nfree 0\n"
              f"alloc plain {6 * MiB}\nalloc pitch {4 * MiB}\nalloc async {3 * MiB}\n"
              "write 3 5\ncheck 3 5\nfreeasync 4\nfree 3\nfree 2\n")
    out = subprocess.run(
        ["valgrind", "--error-exitcode=99", "--leak-check=full",
         "--errors-for-leak-kinds=definite", "--show-leak-kinds=definite", "-q",
         str(native.bin / "cuctl")],
        input=script, env=container.env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-5000:]
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert [a["ok"] for a in answers] == [True, True, True, True, True, False, True, True,
                                          True, True, True, True, True, True, True, True]
    assert answers[5]["rc"] == INVALID_VALUE
    assert container.usage().spilled_peak_bytes >= 4 * MiB + 3 * MiB - PITCH_WIDTH


def test_tessera_run_spills_when_asked(native, tmp_path):
    """`tessera run --spill` (no Kubernetes): the same spill, and the summary says it."""
    from .test_run import run

    script = f"init\nalloc plain {LIMIT}\nalloc plain {50 * MiB}\n"
    out = run(native, tmp_path, ["--gpumem", str(LIMIT >> 20), "--spill", "64", "--",
                                 str(native.bin / "cuctl")], stdin=script)  # fmt: skip
    assert out.returncode == 0, out.stderr
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert [a["ok"] for a in answers] == [True, True, True]
    assert "0 refused" in out.stderr
    assert "peak 50 MiB spilled to host memory of 64 MiB" in out.stderr, out.stderr
    plain = run(native, tmp_path, ["--gpumem", str(LIMIT >> 20), "--",
                                   str(native.bin / "cuctl")], stdin=script)  # fmt: skip
    assert [json.loads(line)["ok"] for line in plain.stdout.splitlines()] == [True, True, False]
