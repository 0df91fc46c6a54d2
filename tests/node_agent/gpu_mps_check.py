"""MPS with per-pod limits on a real GPU (gpu-check.sh, section 11): two control/server pairs on
GPU 0, side by side, as the node agent runs them for two pods of different sizes
(services/node-agent/mps.py: one daemon per container, each its own pipe directory).

Each daemon gets its own limits through the documented commands (A: 1024 MiB pinned, 30 %
threads; B: 2048 MiB, 60 %). A client of each (cuctl, no libvgpu) whose environment asks for
64 GiB / 100 % must be stopped at its own server's limit: A allocates 768 MiB and is refused
512 MiB more; B, connected while A still holds its memory, allocates 768 + 768 MiB and is
refused 1024 MiB more. get_client_list must show each client on its own daemon. Both daemons
get `quit`. Needs the GPU in the Default compute mode (EXCLUSIVE_PROCESS admits one server).

Usage: gpu_mps_check.py <control binary> <GPU uuid> <cuctl>. Prints one JSON line; exit 0 when
both clients stop where they must.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tessera.node_agent.mps import ControlDaemon, ServerLimits

MiB = 1 << 20


def client(daemon: ControlDaemon, uuid: str, cuctl: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_MPS_", "LD_PRELOAD"))}
    env.update(CUDA_MPS_PIPE_DIRECTORY=str(daemon.pipe_dir), CUDA_VISIBLE_DEVICES=uuid,
               CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=64G", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100")
    return subprocess.Popen([cuctl], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def say(p: subprocess.Popen[str], line: str) -> int:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    answer = p.stdout.readline().strip()
    try:
        return int(json.loads(answer).get("rc", -1))
    except ValueError:
        return -1


def compute_mode(uuid: str) -> str:
    """The GPU's compute mode (two servers need Default), or '' without nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", f"--id={uuid}", "--query-gpu=compute_mode",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()


def main(binary: str, uuid: str, cuctl: str) -> int:
    root = Path(tempfile.mkdtemp(prefix="tsr-mps-"))
    pairs = {"a": (ServerLimits(1024, 30), [768, 512], [0, 2]),
             "b": (ServerLimits(2048, 60), [768, 768, 1024], [0, 0, 2])}
    daemons = {k: ControlDaemon(binary, root, uuid, key=k) for k in pairs}
    result: dict[str, object] = {"compute_mode": compute_mode(uuid)}
    procs: list[subprocess.Popen[str]] = []
    ok = True
    try:
        for k, d in daemons.items():
            d.start()
            d.apply(pairs[k][0])
        for k, d in daemons.items():  # A keeps its memory while B runs: side by side
            p = client(d, uuid, cuctl)
            procs.append(p)
            rcs = [say(p, "init")] + [say(p, f"alloc plain {m * MiB}") for m in pairs[k][1]]
            clients = d.clients()
            result[k] = {"limits": pairs[k][0].__dict__, "rcs": rcs, "clients": clients}
            ok = ok and rcs == [0, *pairs[k][2]] and p.pid in clients
    except Exception as exc:
        result["error"] = str(exc)
        ok = False
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for d in daemons.values():
            try:
                d.quit()
            except Exception as exc:
                result.setdefault("quit_errors", []).append(str(exc))  # type: ignore[union-attr]
    print(json.dumps({"ok": ok, **result}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
