"""Elastic compute on the fake GPU's timeline (issue 33): idle compute lent to the busy elastic
containers in proportion to their shares, up to each burst limit, and taken back when the others
wake; a noisy neighbour at full burst does not slow a guaranteed container; limits files from
before the burst fields are hard slices. The node agent's lending tick runs beside the containers
(tests/native/elastic.py); shares are read off the device timeline.

Judged like the other compute tests on a loaded 2-core host: a lower bound is lowered by the share
of the window the launchers waited for a CPU (conftest.CpuStarvation); upper bounds never are.
bench/libvgpu_elastic.py records the figures against the issue's targets (±2 points, 100 ms)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time

import pytest

from tessera import region
from tessera.elastic_compute import LendingMember

from .conftest import wait_for
from .elastic import UUID0, LenderThread, run_lend_and_reclaim, run_noisy_neighbour, start_tenants
from .test_layout import _old_limits_file
from .windows import assert_near, show, windows

pytestmark = pytest.mark.timing

TOL = 3.0  # points; the benchmark holds ±2 on a quieter machine
REACTION_S = 0.25  # wake -> the borrower's allowance lowered (a 20 ms tick; a loaded host)


def test_idle_compute_is_lent_and_taken_back_when_the_others_wake(cluster):
    """Shares 10/30/60, each elastic up to the whole card. All busy: each its share. Only the
    10 % one busy: it gets at least 90 % of the card. The others wake: the borrower's allowance
    drops within a lending tick, and from 100 ms after the wake each is back at its share."""
    r = run_lend_and_reclaim(cluster, busy_s=3.0, warmup_s=1.5, alone_s=2.0, wake_s=2.0)
    detail = repr(r)
    for got, want, starved in zip(r.all_busy, (10, 30, 60), r.all_busy_starved, strict=True):
        assert want - TOL - starved <= got <= want + TOL, detail
    assert r.alone >= 90.0 - r.alone_starved, detail
    assert r.lender_reaction_ms is not None and r.lender_reaction_ms <= REACTION_S * 1000, detail
    # Back at the shares: over [wake + 100 ms, wake + 1.1 s) (bench/libvgpu_elastic.py holds
    # ±2 there on a quieter machine), or, on a host loaded enough to delay the tenants' own
    # submissions (a busy CI run: seen settling ~600 ms after the wake), over the last second of
    # the 2 s after the wake: the shares must come back either way.
    def settled(name: str) -> float:
        late = r.late_bins[name][10:]
        return sum(late) / len(late)

    for got, late, want, starved in zip(r.after_wake, (settled(n) for n in "abc"), (10, 30, 60),
                                        r.after_wake_starved, strict=True):
        assert (want - TOL - starved <= got <= want + TOL
                or want - TOL - starved <= late <= want + TOL), detail


def test_a_noisy_neighbour_at_full_burst_does_not_slow_a_guaranteed_container(cluster):
    """A 25 % hard slice alone, then beside an elastic neighbour (10 % guaranteed, bursting to the
    whole card): the slice keeps its 25 % (at most 5 % slower), the neighbour gets the rest."""
    r = run_noisy_neighbour(cluster, seconds=2.5)
    detail = f"{r!r}, slowdown {r.slowdown_pct:.1f} %"
    assert abs(r.guaranteed_alone - 25) <= TOL + r.starved_alone, detail
    assert r.guaranteed_noisy >= 0.95 * r.guaranteed_alone - r.starved_noisy, detail
    assert r.guaranteed_noisy <= 25 + TOL, detail
    assert r.noisy >= 75 - 2 * TOL - r.starved_noisy, detail


def test_a_burst_limit_caps_an_elastic_container_alone(cluster):
    """Alone on the card, an elastic container is lent up to its burst limit, not beyond (the
    burst is the user's own cap, whatever the core policy)."""
    (t,) = start_tenants(cluster, [("capped", 10, 50)])
    with LenderThread([t.member]):
        t.cuctl.send("burnq 3.0 k_2000us 8")
        r = t.cuctl.recv(timeout=60)
    assert r["rc"] == 0, r
    values = windows(cluster, 0, r, [t.pid])
    assert_near(values, 50)
    assert max(values) <= 50 + TOL, show(values)


def test_a_lowered_allowance_is_priced_at_nvmls_figure_once_it_answers(cluster):
    """A container that starts beside a busy neighbour measures its first launches stretched by
    the neighbour's queued kernels (its first, synchronous launch waits behind the whole queue).
    When the agent lowers its allowance, libvgpu prices its launches by a guess from those event
    times until NVML answers; NVML's first figure (own device time per launch: the kernel's 2 ms)
    replaces the guess. Averaged with it 1:2, the launches stayed overpriced for seconds: the
    container was held below its share, then refunded above it (CI's elastic test, the 30 %
    container at 33.1 % while all were busy)."""
    noisy = cluster.container("noisy")  # no limit: a deep queue of 2 ms kernels
    n = noisy.cuctl(preload=False)
    assert n("init 0")["ok"]
    n.send("burnq 3 k_2000us 8")
    k = cluster.container("k")
    k.seal(dataclasses.replace(region.device_limit(UUID0, sm_guarantee_pct=30, sm_burst_pct=100),
                               sm_allow_x100=10000))  # fmt: skip
    c = k.cuctl(LIBCUDA_LOG_LEVEL="4")  # DEBUG: owntime's per-launch figure at each answer
    assert c("init 0")["ok"]
    t0 = time.monotonic_ns()
    c.send("burnq 1.5 k_2000us 8")
    def ran() -> float:  # % of the device its kernels held since it began
        t1 = time.monotonic_ns()
        return cluster.busy(0, t0, t1, t1 - t0, [c.pid])[0]

    launched, _ = wait_for(ran, timeout=30)
    assert launched  # its first launches are measured: now the agent lends it less
    assert region.set_device_flags(k.limits_dir, UUID0, sm_allow_x100=3000)
    assert c.recv(timeout=60)["rc"] == 0
    assert n.recv(timeout=60)["rc"] == 0
    log = c.stderr()
    after = log[log.rindex("limits reloaded"):]
    prices = [int(x) for x in re.findall(r"owntime dev 0: .* (\d+)/launch", after)]
    assert prices, log[-3000:]
    assert 1_400_000 <= prices[0] <= 2_600_000, (prices, log[-3000:])


@pytest.mark.parametrize("minor", [0, 1])
def test_a_limits_file_from_before_the_burst_fields_is_a_hard_slice(cluster, minor):
    """A file sealed by an older agent (minor < 2) whose reserved bytes happen to hold what 1.2
    reads as a burst to 100 % and a full allowance: libvgpu still holds the container to 30 %."""
    k = cluster.container()
    lim = k.seal(region.DeviceLimit(UUID0, 0, 30))
    data = _old_limits_file(lim, minor, junk=True)
    tmp = k.limits_dir / ".old"
    tmp.write_bytes(data)
    os.replace(tmp, k.limits_dir / region.LIMITS_FILE_NAME)
    c = k.cuctl()
    assert c("init 0")["ok"]
    r = c("burn 3.0 k_1000us kernel", timeout=60)
    assert r["rc"] == 0, r
    assert_near(windows(cluster, 0, r, [c.pid]), 30)


@pytest.mark.valgrind
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="no valgrind")
@pytest.mark.skipif(bool(os.environ.get("LIBVGPU_TEST_SAN")), reason="not with ASan")
def test_elastic_paths_are_valgrind_clean(cluster, native):
    """Lent the card, then a neighbour wakes and the allowance drops (the bank dropped, own-time
    pricing assumed, the steady-state clock reset), under valgrind memcheck."""
    k, neighbour = cluster.container("k"), cluster.container("neighbour")
    k.seal(region.device_limit(UUID0, sm_guarantee_pct=10, sm_burst_pct=100))
    neighbour.seal(region.device_limit(UUID0, sm_guarantee_pct=30, sm_burst_pct=100))
    members = [LendingMember("k", k.limits_dir, k.region_path),
               LendingMember("neighbour", neighbour.limits_dir, neighbour.region_path)]
    with LenderThread(members) as lt:
        vg = subprocess.Popen(
            ["valgrind", "--error-exitcode=99", "--leak-check=full",
             "--errors-for-leak-kinds=definite", "--show-leak-kinds=definite", "-q",
             str(native.bin / "cuctl")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=k.env(LIBCUDA_LOG_LEVEL="4"),
        )  # fmt: skip
        vg.stdin.write("init 0\nburnq 6 k_4000us 8\nexit\n")
        vg.stdin.flush()
        def allowances() -> list[int]:
            return [a for _, key, a in lt.changes if key == "k"]

        lent, _ = wait_for(lambda: 10000 in allowances(), timeout=120)  # alone: the whole card
        assert lent, lt.changes
        n = neighbour.cuctl()
        assert n("init 0")["ok"]
        n.send("burnq 2 k_4000us 8")
        assert n.recv(timeout=60)["rc"] == 0
        _, err = vg.communicate(timeout=300)
    assert vg.returncode == 0, err[-4000:]
    after = allowances()
    # taken back (10:30 of the card while both burn; the guarantee once the process is idle)
    assert any(a < 10000 for a in after[after.index(10000):]), lt.changes
    assert "limits reloaded" in err  # libvgpu picked the lowered allowance up
