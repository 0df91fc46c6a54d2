"""Running a pod's containers as local processes (optional: `TESSERA_KUBE_SIM_RUN_CONTAINERS`).

A container with a `command` runs as a child process with the env kubelet would give it: the
container's own `env` values plus what Allocate returned, with paths of the returned mounts
rewritten to their host side (there is no mount namespace), libvgpu preloaded through
`LD_PRELOAD` (the stand-in for the mounted `/etc/ld.so.preload`) and the sealed limits
directory named by `TESSERA_LIMITS_DIR`. So on a GPU machine libvgpu enforces the slice for real.
Init containers run to completion first, in order; the pod then Succeeds or Fails by exit codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera.kube_sim.kubelet import PodAdmission
from tessera.kube_sim.store import KubeObject, now_rfc3339

log = logging.getLogger("tessera.kube_sim.processes")

LIBVGPU_CONTAINER_PATH = "/usr/local/vgpu/libvgpu.so"
SEALED_LIMITS_CONTAINER_DIR = "/run/tessera/limits"
PASSED_THROUGH = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "PYTHONPATH",
    "VIRTUAL_ENV",
)

OnExit = Callable[[KubeObject, str, list[dict[str, Any]]], None]


def container_env(
    container: dict[str, Any], envs: dict[str, str], mounts: list[Any]
) -> dict[str, str]:
    """The process env of one container on the host."""
    env = {k: os.environ[k] for k in PASSED_THROUGH if k in os.environ}
    for item in container.get("env") or []:
        if isinstance(item, dict) and "value" in item:
            env[str(item["name"])] = str(item["value"])
    by_container_path = {m.container_path: m.host_path for m in mounts}
    for key, value in envs.items():
        for container_path, host_path in by_container_path.items():
            if value.startswith(container_path):
                value = host_path + value[len(container_path) :]
        env[key] = value
    library = by_container_path.get(LIBVGPU_CONTAINER_PATH)
    if library and Path(library).is_file():
        env["LD_PRELOAD"] = library
    limits_dir = by_container_path.get(SEALED_LIMITS_CONTAINER_DIR)
    if limits_dir:
        env["TESSERA_LIMITS_DIR"] = limits_dir
    return env


class ContainerProcesses:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._pods: dict[str, list[asyncio.subprocess.Process]] = {}
        self._waiters: dict[str, asyncio.Task[None]] = {}

    async def _spawn(
        self, uid: str, pod_name: str, container: dict[str, Any], env: dict[str, str]
    ) -> asyncio.subprocess.Process:
        argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{pod_name}_{container.get('name', 'c')}.log"
        with log_path.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                cwd=container.get("workingDir") or None,
                start_new_session=True,
            )
        self._pods.setdefault(uid, []).append(proc)
        return proc

    async def start_pod(self, pod: KubeObject, admission: PodAdmission, on_exit: OnExit) -> None:
        spec = pod.get("spec") or {}
        uid = pod["metadata"].get("uid", "")
        name = pod["metadata"].get("name", "")
        by_name = {c.name: c for c in admission.containers}

        def env_of(container: dict[str, Any]) -> dict[str, str]:
            entry = by_name.get(container.get("name", ""))
            return container_env(
                container, entry.envs if entry else {}, entry.mounts if entry else []
            )

        runnable = [c for c in spec.get("containers") or [] if c.get("command")]
        inits = [c for c in spec.get("initContainers") or [] if c.get("command")]
        if not runnable and not inits:
            return
        for container in inits:
            proc = await self._spawn(uid, name, container, env_of(container))
            if await proc.wait() != 0:
                on_exit(pod, "Failed", [])
                return
        procs = [(c, await self._spawn(uid, name, c, env_of(c))) for c in runnable]
        if procs:
            self._waiters[uid] = asyncio.create_task(self._wait(pod, procs, on_exit))

    async def _wait(
        self,
        pod: KubeObject,
        procs: list[tuple[dict[str, Any], asyncio.subprocess.Process]],
        on_exit: OnExit,
    ) -> None:
        codes = [await proc.wait() for _, proc in procs]
        finished = now_rfc3339()
        statuses = [
            {
                "name": c.get("name", ""),
                "ready": False,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": code,
                        "finishedAt": finished,
                        "reason": "Completed" if code == 0 else "Error",
                    }
                },
            }
            for (c, _), code in zip(procs, codes, strict=True)
        ]
        on_exit(pod, "Succeeded" if all(code == 0 for code in codes) else "Failed", statuses)

    def running(self, uid: str) -> bool:
        """Has the pod a process that has not exited?"""
        return any(proc.returncode is None for proc in self._pods.get(uid, []))

    async def stop_pod(self, uid: str, grace_s: float = 5.0) -> None:
        """SIGTERM to every container's process group, SIGKILL after `grace_s`."""
        waiter = self._waiters.pop(uid, None)
        if waiter is not None:
            waiter.cancel()
        for proc in self._pods.pop(uid, []):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), grace_s)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()

    async def stop_all(self) -> None:
        for uid in list(self._pods):
            await self.stop_pod(uid)
