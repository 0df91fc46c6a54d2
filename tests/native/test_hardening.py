"""Issue 19, in-process: every symbol route into the driver ends at libvgpu, graph memory is
charged for as long as the driver keeps it, one unmap of many mappings uncharges them all, and a
process without a limit never takes the throttled path."""

from __future__ import annotations

import pytest

from tessera import region

from .conftest import MiB

LIMIT = 1000 * MiB
CHUNK = 300 * MiB
NOT_SUPPORTED = 801  # CUDA_ERROR_NOT_SUPPORTED
INVALID_VALUE = 1

# Routes that find cuMemAlloc_v2 and must hand out libvgpu's (charged, limited) function.
SWAPPED = [
    "dlsym",  # dlopen("libcuda.so.1") + dlsym
    "dlsym_default",  # RTLD_DEFAULT
    "dlsym_next",  # RTLD_NEXT
    "dlvsym_dlsym",  # glibc's dlsym through dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34")
    "dlvsym_dlsym_old",  # ... "GLIBC_2.2.5"
    "dlvsym_next_dlsym",  # ... dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34")
    "dlsym_dlsym",  # dlsym(libc handle, "dlsym")
    "path",  # dlopen of the driver by its path
    "copy",  # a second copy of the driver's file, dlopen'ed RTLD_LOCAL
]


@pytest.mark.parametrize("how", SWAPPED)
def test_every_lookup_route_hands_out_the_hooked_function(container, how):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl(mode="dlsym")
    assert c("init")["ok"]
    got = [c(f"route {how} {CHUNK}") for _ in range(4)]
    assert all(g["found"] and g["ours"] for g in got), got
    assert [g["ok"] for g in got] == [True, True, True, False]  # the limit holds
    assert container.used() == 3 * CHUNK
    assert c("phys")["phys"] <= LIMIT
    c.close()


def test_versioned_lookup_in_the_driver_is_no_way_around(container):
    """dlvsym on the driver's handle: the driver has no symbol versions, so glibc finds nothing;
    were it found, it would be ours like every other route."""
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl(mode="dlsym")
    assert c("init")["ok"]
    got = c(f"route dlvsym {4 * CHUNK}")
    assert not got["ok"] and (not got["found"] or got["ours"]), got
    assert c("phys")["phys"] == 0
    c.close()


@pytest.mark.parametrize("how", ["legacy", "procaddr_legacy"])
def test_legacy_entry_points_are_denied(container, how):
    """The 32-bit v1 cuMemAlloc (by name, or by cuGetProcAddress with an old version) would
    allocate behind the hooks: lookups get a stub that answers NOT_SUPPORTED."""
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl(mode="dlsym")
    assert c("init")["ok"]
    got = c(f"route {how} {CHUNK}")
    assert got["found"] and got["ours"] and not got["ok"], got
    assert got["rc"] == NOT_SUPPORTED
    assert c("phys")["phys"] == 0
    c.close()


def test_dlmopen_into_a_new_namespace_is_refused(container):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl(mode="dlsym")
    assert c("init")["ok"]
    got = c(f"route dlmopen {CHUNK}")
    assert not got["found"] and not got["ok"]
    assert "refused" in got["err"]
    assert c("phys")["phys"] == 0
    c.close()


# ---- graph memory nodes ---------------------------------------------------------------------

GiB = 1 << 30


@pytest.mark.parametrize("mode", ["direct", "dlsym", "procaddr"])
def test_graph_allocation_outlives_its_graph_and_stays_charged(container, mode):
    """The issue's program: graph + allocation node, instantiate, launch, destroy exec and graph,
    eight times. CUDA keeps each allocation until it is freed, so only one fits under 1 GiB and
    cuMemGetInfo shows the GiB as used."""
    container.seal(region.DeviceLimit("", GiB))
    c = container.cuctl(mode=mode)
    assert c("init")["ok"]
    got = [c(f"graphmem {GiB}") for _ in range(8)]
    assert [g["ok"] for g in got] == [True] + [False] * 7
    assert c("phys")["phys"] == GiB  # what the (fake) driver really holds
    assert container.used() == GiB
    info = c("info")
    assert info["total"] == GiB and info["free"] == 0
    assert c(f"free {got[0]['id']}")["ok"]  # cuMemFree of the graph allocation
    assert container.used() == 0 and c("phys")["phys"] == 0
    assert c("info")["free"] == GiB
    assert c(f"graphmem {GiB}")["ok"]
    c.close()


def test_graph_allocation_freed_by_a_free_node_or_never_launched(container):
    container.seal(region.DeviceLimit("", GiB))
    c = container.cuctl()
    assert c("init")["ok"]
    g = c(f"graphmem {512 * MiB}")
    assert g["ok"] and container.used() == 512 * MiB
    assert c(f"graphfree {g['id']}")["ok"]  # another graph frees it at its launch
    assert container.used() == 0 and c("phys")["phys"] == 0
    # a graph that is never launched allocates nothing lasting: uncharged with the graph
    assert c(f"alloc graphnode {768 * MiB}")["ok"]
    assert container.used() == 768 * MiB
    assert c("free 1")["ok"]  # cuGraphDestroy
    assert container.used() == 0
    c.close()


def test_graph_relaunch_auto_free_charges_once(container):
    container.seal(region.DeviceLimit("", GiB))
    c = container.cuctl()
    assert c("init")["ok"]
    g = c(f"graphmem {600 * MiB} autofree 5")  # each launch frees the previous allocation
    assert g["ok"], g
    assert container.used() == 600 * MiB and c("phys")["phys"] == 600 * MiB
    # without auto-free a relaunch while the allocation lives is the driver's error
    bad = c(f"graphmem {300 * MiB} plain 2")
    assert not bad["ok"] and bad["rc"] == INVALID_VALUE
    assert c("phys")["phys"] <= container.used() <= GiB
    c.close()


# ---- VMM: one unmap over many mappings --------------------------------------------------------


def test_one_unmap_over_more_than_64_mappings_uncharges_them_all(container):
    container.seal(region.DeviceLimit("", LIMIT))
    c = container.cuctl()
    assert c("init")["ok"]
    vmm = c(f"alloc vmm {2 * MiB}")
    assert vmm["ok"]
    m = c(f"mapmany {vmm['id']} 100 {2 * MiB}")
    assert m["ok"]
    assert c(f"free {vmm['id']}")["ok"]  # released, still mapped 100 times: still charged
    assert container.used() == 2 * MiB
    assert c(f"free {m['id']}")["ok"]  # one cuMemUnmap over all 100
    assert container.used() == 0
    c.close()


# ---- launches without a limit ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["kernel", "ex", "coop", "graph"])
def test_first_launch_without_limit_takes_the_fast_path(container, path):
    """No limit: not even the first launch asks the driver which device its stream is on."""
    c = container.cuctl()
    assert c("init")["ok"]
    before = c("stats")
    assert c(f"burn 0.02 k_10us {path}")["rc"] == 0
    after = c("stats")
    assert after["stream_getctx"] == before["stream_getctx"]
    assert after["launches"] + after["ex"] + after["coop"] + after["graph"] > 0
    c.close()
