"""An MPS client is held to the limits its server was given through the control daemon.

The node agent's own daemon driver (tessera.node_agent.mps.ControlDaemon) starts the fake
control daemon (tests/node_agent/fake_mps_control.py) and sets the server's limits with the
documented commands; a CUDA program on the fake driver (fakes/fake_mps.c: a client of the server
its daemon answers for, as NVIDIA documents) then allocates. Its environment asking for more
(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) changes nothing; asking
for less lowers its own limit, as documented.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tessera.node_agent.mps import ControlDaemon, ServerLimits

MiB = 1 << 20
FAKE = Path(__file__).resolve().parents[1] / "node_agent" / "fake_mps_control.py"
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


@pytest.fixture
def daemon() -> Iterator[ControlDaemon]:
    root = Path(tempfile.mkdtemp(prefix="tsr-mps-"))  # short: the socket path is bounded
    d = ControlDaemon(str(FAKE), root, "GPU-fake-0")
    d.start()
    try:
        yield d
    finally:
        if d.pid():
            d.quit()
        shutil.rmtree(root, ignore_errors=True)


def test_client_stopped_at_its_server_side_limit_whatever_its_env_asks(cluster, daemon) -> None:
    daemon.apply(ServerLimits(memory_mib=1024, thread_pct=30))
    greedy = cluster.container().cuctl(
        preload=False, CUDA_MPS_PIPE_DIRECTORY=str(daemon.pipe_dir),
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=64G", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
    )
    assert greedy("init")["rc"] == 0
    assert greedy(f"alloc plain {768 * MiB}")["rc"] == 0
    assert greedy(f"alloc plain {512 * MiB}")["rc"] == OOM  # 1280 MiB > the server's 1024
    assert greedy(f"alloc plain {256 * MiB}")["rc"] == 0  # exactly up to the limit
    assert str(greedy.pid) in daemon.command(f"get_client_list {daemon.servers()[0]}").split()


def test_a_client_may_only_lower_its_limit(cluster, daemon) -> None:
    daemon.apply(ServerLimits(memory_mib=1024, thread_pct=30))
    modest = cluster.container().cuctl(
        preload=False, CUDA_MPS_PIPE_DIRECTORY=str(daemon.pipe_dir),
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=256M",
    )
    assert modest("init")["rc"] == 0
    assert modest(f"alloc plain {512 * MiB}")["rc"] == OOM
    assert modest(f"alloc plain {256 * MiB}")["rc"] == 0


def test_without_a_daemon_a_program_runs_without_mps(cluster, daemon) -> None:
    daemon.quit()
    plain = cluster.container().cuctl(preload=False,
                                      CUDA_MPS_PIPE_DIRECTORY=str(daemon.pipe_dir))
    assert plain("init")["rc"] == 0
    assert plain(f"alloc plain {2048 * MiB}")["rc"] == 0  # only the card's memory bounds it


def test_the_gpu_checks_two_servers_side_by_side_pass_on_the_fakes(cluster) -> None:
    """gpu-check.sh step 11 (tests/node_agent/gpu_mps_check.py) against the fake daemon and
    driver: two pods' daemons on one card, each client stopped at its own server's limit — so
    the script a GPU machine runs is known to work before one is lent."""
    import json
    import sys

    script = Path(__file__).resolve().parents[1] / "node_agent" / "gpu_mps_check.py"
    done = cluster.container().run(
        [sys.executable, str(script), str(FAKE), "GPU-fake-0", str(cluster.native.bin / "cuctl")],
        timeout=90, preload=False, FAKE_GPU_COUNT="1")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and result["ok"], (done.stdout, done.stderr[-2000:])
    assert (result["a"]["rcs"], result["b"]["rcs"]) == ([0, 0, 2], [0, 0, 0, 2])
