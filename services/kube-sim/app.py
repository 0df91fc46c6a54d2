"""kube-sim wired together: API server, admission chain, scheduler and kubelets in one process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import uvicorn
from tessera.kube_sim.admission import AdmissionWebhook
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.controllers import WorkloadControllers
from tessera.kube_sim.disruption import Disruption
from tessera.kube_sim.dra.claims import ClaimController
from tessera.kube_sim.dra.eviction import DeviceTaintEviction
from tessera.kube_sim.dra.scheduling import DynamicResources
from tessera.kube_sim.dra.validating_webhook import DraValidatingWebhook, validate_url
from tessera.kube_sim.extender import ExtenderClient, ExtenderConfig
from tessera.kube_sim.identity import TokenTable
from tessera.kube_sim.kubeconfig import write_kubeconfigs
from tessera.kube_sim.scheduler import SchedulingLoop
from tessera.kube_sim.settings import KubeSimSettings
from tessera.kube_sim.store import KubeObject, ObjectStore, now_rfc3339

from tessera.device_kinds import registry
from tessera.device_kinds.vendor_models import node_labels
from tessera.embedded_http import EmbeddedUvicorn
from tessera.settings import TesseraSettings
from tessera.simnodes import SimNode

log = logging.getLogger("tessera.kube_sim")


def node_object(node: SimNode) -> KubeObject:
    labels = {
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        **node_labels(node.gpu_model),  # gpu=on, or the vendor's (docs/vendors.md)
        "tessera.io/gpu-model": node.gpu_model.replace(" ", "-")[:63],
        **node.labels,
    }
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110"}
    return {
        "metadata": {"name": node.name, "labels": labels, "annotations": {}},
        "spec": {},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kube-sim kubelet is posting ready status",
                    "lastHeartbeatTime": now_rfc3339(),
                }
            ],
            "nodeInfo": {"kubeletVersion": "v1.31.0-kube-sim", "operatingSystem": "linux"},
        },
    }


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host or "127.0.0.1", int(port)


class KubeSim:
    def __init__(self, settings: KubeSimSettings, tessera: TesseraSettings) -> None:
        self.settings = settings
        self.tessera = tessera
        self.store = ObjectStore()
        self.webhook = (
            AdmissionWebhook(
                settings.webhook_url,
                settings.webhook_ca or None,
                settings.webhook_timeout_s,
                settings.webhook_failure_policy,
            )
            if settings.webhook_url
            else None
        )
        # one token per client (identity.py), kept beside the kubeconfigs across restarts
        self.tokens = (
            TokenTable.load_or_create(Path(f"{settings.kubeconfig}.tokens.json"))
            if settings.kubeconfig
            else TokenTable.legacy()
        )
        self.api = ApiServer(
            self.store,
            self.webhook,
            admit_update=self.webhook.update if self.webhook is not None else None,
            tokens=self.tokens,
        )
        if self.webhook is not None:  # in DRA mode the chart registers /validate too
            self.dra_webhook: AdmissionWebhook | None = AdmissionWebhook(
                validate_url(settings.webhook_url), settings.webhook_ca or None,
                settings.webhook_timeout_s, settings.webhook_failure_policy,
            )  # fmt: skip
            self.api.validate_dra = DraValidatingWebhook(self.dra_webhook)
        else:
            self.dra_webhook = None
        self.disruption = Disruption(self.store, self._stop_processes, lambda: self.api.now())
        self.api.extra_routes += self.disruption.routes()
        self.api.pod_admitters.append(self.disruption.admit_priority)
        self.extender = (
            ExtenderClient(
                ExtenderConfig(
                    url_prefix=settings.extender_url,
                    weight=settings.extender_weight,
                    http_timeout_s=settings.extender_timeout_s,
                    # every device family's names (NVIDIA's and the other vendors')
                    managed_resources=tuple(dict.fromkeys(
                        [*tessera.resource_names(), *registry.resource_map(tessera)])),
                    ca_file=settings.extender_ca,
                    cert_file=settings.extender_cert,
                    key_file=settings.extender_key,
                )
            )
            if settings.extender_url
            else None
        )
        self.scheduler = SchedulingLoop(
            self.api,
            tessera.scheduler_name,
            self.extender,
            settings.backoff_initial_s,
            settings.backoff_max_s,
        )
        self.nodes = settings.sim_nodes()
        self.controllers = WorkloadControllers(self.api)
        # Dynamic Resource Allocation (dra/): the resourceclaim controller, the scheduler's
        # DynamicResources plugin; each kubelet gets its DRA manager (kubelets.py)
        self.claims = ClaimController(self.store)
        self.scheduler.dra = DynamicResources(self.store)
        self.device_taints = DeviceTaintEviction(
            self.store, lambda ns, name, uid: self.api.delete_object("Pod", ns, name, uid))

    async def run(self, stop: asyncio.Event) -> None:
        for node in self.nodes:
            self.store.create("Node", node_object(node))
        host, port = split_listen(self.settings.listen)
        config = uvicorn.Config(
            self.api.app(),
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        server = EmbeddedUvicorn(config)
        server_task = asyncio.create_task(server.serve())
        while not server.started:
            if server_task.done():
                await server_task  # raises the bind error
                raise RuntimeError("kube-sim's API server stopped while starting")
            await asyncio.sleep(0.02)
        advertised = self.settings.advertise_host or host
        if advertised in ("0.0.0.0", "::"):
            advertised = "127.0.0.1"
        if self.settings.kubeconfig:
            write_kubeconfigs(
                Path(self.settings.kubeconfig), f"http://{advertised}:{port}", self.tokens
            )
        kubelets = await self._start_kubelets()
        scheduler_task = asyncio.create_task(self.scheduler.run(stop))
        controllers_task = asyncio.create_task(self.controllers.run(stop))
        claims_task = asyncio.create_task(self.claims.run(stop))
        taints_task = asyncio.create_task(self.device_taints.run(stop))
        dra_retry_task = asyncio.create_task(
            self.scheduler.dra.follow(self.scheduler.move_all_to_active, stop))
        log.info(
            "kube-sim ready",
            extra={"listen": self.settings.listen, "nodes": [n.name for n in self.nodes]},
        )
        try:
            await stop.wait()
        finally:
            for kubelet in kubelets:
                with contextlib.suppress(Exception):
                    await kubelet.stop()
            await scheduler_task
            await controllers_task
            await claims_task
            await taints_task
            await dra_retry_task
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server_task, 3.0)
            await self.disruption.close()
            if self.webhook is not None:
                await self.webhook.close()
            if self.dra_webhook is not None:
                await self.dra_webhook.close()
            if self.extender is not None:
                await self.extender.close()

    async def _stop_processes(self, node: str, uid: str, grace_s: float) -> bool:
        """SIGTERM the pod's processes, SIGKILL at the end of the grace period. False when the
        pod has no process (its containers are not run)."""
        kubelet = self.api.kubelets.get(node)
        processes = getattr(kubelet, "processes", None)
        if processes is None or not processes.running(uid):
            return False
        await processes.stop_pod(uid, grace_s)
        return True

    async def _start_kubelets(self) -> list:  # type: ignore[type-arg]
        from tessera.kube_sim.kubelets import start_kubelets

        return await start_kubelets(self)
