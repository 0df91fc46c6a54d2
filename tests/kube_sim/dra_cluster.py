"""A whole kube-sim in process (API server over HTTP, scheduler, claim controller, kubelets)
for the DRA tests, with a DRA plugin test double registered on each node."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from tessera.kube_sim.app import KubeSim
from tessera.kube_sim.settings import KubeSimSettings

from kube_sim.dra_plugin_double import PluginDouble
from tessera.settings import TesseraSettings
from tessera_cli.nats_embedded import free_port

DRIVER = "gpu.example.com"
RESOURCE = "/apis/resource.k8s.io/v1"


class Cluster:
    def __init__(self, sim: KubeSim, http: httpx.AsyncClient, root: Path) -> None:
        self.sim = sim
        self.http = http
        self.root = root
        self.plugins: dict[str, PluginDouble] = {}

    async def plugin(self, node: str, driver: str = DRIVER, **options: Any) -> PluginDouble:
        double = PluginDouble(driver, self.root / node,
                              lambda ns, n: self.sim.store.get("ResourceClaim", ns, n),
                              **options)
        await double.start()
        self.plugins[node] = double
        return double

    async def create(self, path: str, obj: dict[str, Any], ok: bool = True) -> httpx.Response:
        response = await self.http.post(path, json=obj)
        if ok:
            assert response.status_code == 201, response.text
        return response

    async def get(self, path: str) -> dict[str, Any]:
        response = await self.http.get(path)
        assert response.status_code == 200, response.text
        return response.json()

    async def pod(self, name: str, namespace: str = "default") -> dict[str, Any]:
        return await self.get(f"/api/v1/namespaces/{namespace}/pods/{name}")

    async def claims(self, namespace: str = "default") -> list[dict[str, Any]]:
        return (await self.get(f"{RESOURCE}/namespaces/{namespace}/resourceclaims"))["items"]

    async def events(self, reason: str, name: str) -> list[str]:
        items = (await self.get("/api/v1/namespaces/default/events"))["items"]
        return [e["message"] for e in items
                if e["reason"] == reason and e["involvedObject"]["name"] == name]

    async def containers(self, node: str) -> list[dict[str, Any]]:
        return (await self.http.get(f"/kube-sim/v1/nodes/{node}/containers")).json()

    async def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            await asyncio.sleep(0.05)

    async def phase(self, name: str) -> str:
        return ((await self.pod(name)).get("status") or {}).get("phase", "")


@contextlib.asynccontextmanager
async def running_cluster(nodes: list[str]) -> AsyncIterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="ksdra-"))
    port = free_port()
    settings = KubeSimSettings(
        listen=f"127.0.0.1:{port}", kubeconfig="", webhook_url="", extender_url="",
        nodes=json.dumps([{"name": n, "gpus": 0} for n in nodes]), kubelet_root=str(root),
        backoff_initial_s=0.1, backoff_max_s=0.5,
    )
    sim = KubeSim(settings, TesseraSettings())
    stop = asyncio.Event()
    task = asyncio.create_task(sim.run(stop))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        cluster = Cluster(sim, http, root)
        try:
            async def ready() -> bool:
                assert not task.done(), task
                with contextlib.suppress(httpx.HTTPError):
                    return (await http.get("/readyz")).is_success and bool(sim.api.kubelets)
                return False

            await cluster.wait_for("kube-sim", ready)
            yield cluster
        finally:
            for double in cluster.plugins.values():
                with contextlib.suppress(Exception):
                    await double.stop()
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 10)
            shutil.rmtree(root, ignore_errors=True)
