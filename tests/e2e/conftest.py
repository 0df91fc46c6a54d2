"""End-to-end fixtures: the whole local stack (NATS, kube-sim, every service) as processes.

A stack starts once per test module (it costs seconds); tests stay independent by using their
own namespace and deleting their pods. Everything speaks the real protocols: pods are created
through kube-sim's Kubernetes API, which calls the admission webhook over HTTPS, the scheduler
extender over HTTP and the node agents over device-plugin gRPC.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from suite_run import RUN

from tessera.device_kinds.pod_grants import pod_grants_text
from tessera.device_kinds.vendor_models import family_for_model, node_registered
from tessera.hami import decode_pod_devices
from tessera.models import DeviceGrant
from tessera_cli.stack import LocalStack, SimNode, StackPorts, default_services, short_socket_root


class Kube:
    """A small Kubernetes REST client for tests (what kubectl would do)."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=30.0)

    def close(self) -> None:
        self.http.close()

    def create_pod(self, pod: dict[str, Any], namespace: str = "default") -> httpx.Response:
        return self.http.post(f"/api/v1/namespaces/{namespace}/pods", json=pod)

    def create_pod_retrying(
        self, pod: dict[str, Any], namespace: str, timeout_s: float = 30.0
    ) -> dict[str, Any]:
        """Create, retrying 5xx (a webhook being restarted) like a controller would."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self.create_pod(pod, namespace)
            except httpx.HTTPError:
                reply = None
            if reply is not None and reply.status_code in (201, 409):
                return reply.json() if reply.status_code == 201 else self.pod(
                    namespace, pod["metadata"]["name"]
                )
            if reply is not None and 400 <= reply.status_code < 500:
                raise AssertionError(f"create refused: {reply.status_code} {reply.text}")
            if time.monotonic() > deadline:
                raise AssertionError(f"create kept failing: {reply and reply.text}")
            time.sleep(0.2)

    def pod(self, namespace: str, name: str) -> dict[str, Any]:
        reply = self.http.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
        reply.raise_for_status()
        return reply.json()

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        return self.http.get(path).json()["items"]

    def delete_pod(self, namespace: str, name: str) -> None:
        self.http.delete(f"/api/v1/namespaces/{namespace}/pods/{name}")

    def delete_namespace_pods(self, namespace: str) -> None:
        for pod in self.pods(namespace):
            self.delete_pod(namespace, pod["metadata"]["name"])

    def nodes(self) -> list[dict[str, Any]]:
        return self.http.get("/api/v1/nodes").json()["items"]

    def containers(self, node: str) -> list[dict[str, Any]]:
        return self.http.get(f"/kube-sim/v1/nodes/{node}/containers").json()

    def wait_for(
        self, what: str, check: Callable[[], Any], timeout_s: float = 20.0, every_s: float = 0.1,
        progress: bool | Callable[[], None] = False,
    ) -> Any:
        deadline = time.monotonic() + timeout_s
        last_print = 0.0
        while True:
            if progress and time.monotonic() - last_print > 2:
                last_print = time.monotonic()
                phases: dict[str, int] = {}
                for pod in self.pods():
                    bound = "bound" if pod["spec"].get("nodeName") else "unbound"
                    key = f"{pod['status'].get('phase')}/{bound}"
                    phases[key] = phases.get(key, 0) + 1
                print(f"{time.strftime('%H:%M:%S')} {phases}", flush=True)
                stragglers = [p for p in self.pods() if p["status"].get("phase") != "Running"]
                for pod in stragglers[:3] if len(stragglers) <= 5 else []:
                    conditions = pod["status"].get("conditions") or [{}]
                    print(f"   {pod['metadata']['name']}: {conditions[-1].get('message')}")
                if callable(progress):
                    progress()
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(every_s)

    def wait_running(self, namespace: str, name: str, timeout_s: float = 20.0) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            pod = self.pod(namespace, name)
            return pod if pod.get("status", {}).get("phase") == "Running" else None

        return self.wait_for(f"{namespace}/{name} Running", running, timeout_s)


def gpu_pod(
    name: str,
    mem: int | None = None,
    cores: int | None = None,
    count: int | None = 1,
    percentage: int | None = None,
    annotations: dict[str, str] | None = None,
    node: str | None = None,
    init: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A HAMi-style pod: resources under limits, knobs as annotations."""
    limits: dict[str, Any] = {}
    if count is not None:
        limits["nvidia.com/gpu"] = count
    if mem is not None:
        limits["nvidia.com/gpumem"] = mem
    if percentage is not None:
        limits["nvidia.com/gpumem-percentage"] = percentage
    if cores is not None:
        limits["nvidia.com/gpucores"] = cores
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "cuda:12", "resources": {"limits": limits}}],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if init:
        spec["initContainers"] = [{
            "name": "warmup", "image": "cuda:12",
            "resources": {"limits": {f"nvidia.com/{k}": v for k, v in init.items()}},
        }]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": spec,
    }


def grants(pod: dict[str, Any]) -> list[list[DeviceGrant]]:
    """The pod's grants from its device families' HAMi records (NVIDIA's hami.io/vgpu-…)."""
    text = pod_grants_text(pod["metadata"].get("annotations") or {})
    return decode_pod_devices(text) if text else []


def gpu_uuid(node: str, index: int) -> str:
    """The static device source's stable UUIDs (uuid5 of node/gpuN)."""
    return f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}/gpu{index}')}"


class RunningStack:
    def __init__(self, stack: LocalStack, nodes: list[SimNode]) -> None:
        self.stack = stack
        self.nodes = nodes
        self.kube = Kube(stack.api_url)

    def print_logs(self, chars: int = 4000) -> None:
        """Each service's log tail, for a test that failed on the stack's behaviour (pytest shows
        a test's output only when it fails)."""
        for service in self.stack.running:
            tail = service.log_path.read_text(errors="replace")[-chars:]
            print(f"==== {service.spec.name} ({service.status})\n{tail}")

    def wait_nodes_registered(self, timeout_s: float = 40.0) -> None:
        wanted = {n.name for n in self.nodes if n.gpus and not n.dra}  # DRA: no device plugin
        models = {n.name: n.gpu_model for n in self.nodes}

        def registered() -> bool:
            names = set()
            for n in self.kube.nodes():
                name = n["metadata"]["name"]
                if family_for_model(models.get(name, "")) != "nvidia":  # a vendor's node
                    if node_registered(n, models[name]):
                        names.add(name)
                elif ("hami.io/node-nvidia-register" in (n["metadata"].get("annotations") or {})
                      and int((n["status"].get("allocatable") or {}).get("nvidia.com/gpu",
                                                                          "0")) > 0):
                    names.add(name)
            return wanted <= names

        self.kube.wait_for("every node agent registered", registered, timeout_s, 0.25)


async def stored_events(js: Any, subject: str, timeout_s: float = 30.0) -> list[bytes]:
    """Every message the event stream holds on `subject` (wildcards allowed), as stored now.

    Reads as many as the stream says it stores, each with a generous deadline: reading until
    a second of silence ends early on a busy host, where an ordered consumer's first delivery
    can take longer than that."""
    from tessera.bus import EVENTS_STREAM

    info = await js.stream_info(EVENTS_STREAM, subjects_filter=subject)
    stored = sum((info.state.subjects or {}).values())
    if not stored:
        return []
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        return [(await sub.next_msg(timeout=timeout_s)).data for _ in range(stored)]
    finally:
        await sub.unsubscribe()


def start_stack(
    nodes: list[SimNode], env: dict[str, str] | None = None, run_containers: bool = False,
    nats_cluster: int = 0,
) -> Iterator[RunningStack]:
    state_dir = Path(tempfile.mkdtemp(prefix="tessera-e2e-"))
    ports = StackPorts.free()
    stack = LocalStack(
        state_dir, default_services(nodes, state_dir, ports, run_containers), ports=ports,
        extra_env={"TESSERA_LOG_LEVEL": "INFO", **(env or {})}, nats_cluster=nats_cluster,
    )
    running = RunningStack(stack, nodes)
    try:
        stack.start()
        stack.wait_ready()
        running.wait_nodes_registered()
        yield running
    except Exception:  # a stack that failed to start: show why
        running.print_logs(3000)
        raise
    finally:
        running.kube.close()
        # Stopping waits seconds for each process: beside the next tests (tests/suite_run.py).
        RUN.teardown_in_background(str(state_dir), lambda: stop_stack(stack, state_dir))


def stop_stack(stack: LocalStack, state_dir: Path) -> None:
    stack.stop()
    shutil.rmtree(short_socket_root(state_dir), ignore_errors=True)
    if os.environ.get("E2E_KEEP_STATE"):
        print(f"kept the stack's state (logs) in {state_dir}")
    else:
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture
def namespace() -> str:
    return f"e2e-{uuid.uuid4().hex[:8]}"
