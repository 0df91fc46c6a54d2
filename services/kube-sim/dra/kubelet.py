"""kubelet's DRA manager for one simulated node.

Plugin registration as kubelet's plugin watcher does it: a plugin places a socket in
`<kubelet dir>/plugins_registry/` (names starting with `.` are ignored); kubelet dials it, calls
`Registration.GetInfo`, accepts a `DRAPlugin` whose name is a DNS subdomain and whose
`supported_versions` list `v1.DRAPlugin`, then answers `NotifyRegistrationStatus` (registered,
or not with the error). The DRA service is served on `PluginInfo.endpoint` (the registration
socket when empty). A socket that disappears deregisters the driver; a new one replaces it. A
socket recreated on the same path (a plugin killed without removing its socket, then restarted:
upstream's watcher sees fsnotify's create event) is a new registration: the file's identity
(inode, ctime) is kept, and a change deregisters the old plugin and registers the new one, whose
health stream is followed from then on.

Before a pod's containers start: every claim the pod uses must be allocated and reserved for
the pod; the claims are prepared with one `NodePrepareResources` per driver (a claim already
prepared for another pod is not prepared again); each container gets the CDI devices of the
claims (and requests) it names in `resources.claims`, or, for its extended resources, of the
requests `pod.status.extendedResourceClaimStatus.requestMappings` maps to it; the CDI spec
files turn those IDs into env, mounts and device nodes. A failure is a
`FailedPrepareDynamicResources` event and a retry (the pod stays Pending). When the pod is gone,
`NodeUnprepareResources` for each claim no other pod on the node still uses, then the claims
are released.

Device health (KEP-4680): a driver serving `DRAResourceHealth.NodeWatchResources` (dra-health v1,
else v1alpha1) streams its devices' health; each container's status carries
`allocatedResourcesStatus` (`name: claim:<pod claim>[/<request>]`, `resources[]` with
`resourceID: <driver>/<pool>/<device>`, `health: Healthy|Unhealthy|Unknown`, `message`), updated
when the health changes; a driver whose stream ends has its devices `Unknown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from tessera.kube_sim.dra import cdi
from tessera.kube_sim.dra.claims import pod_claim_names
from tessera.kube_sim.dra.health import resource_statuses, watch_health
from tessera.kube_sim.kubelet import ContainerAdmission, DeviceNode, Mount, PodAdmission
from tessera.kube_sim.store import KubeObject, ObjectStore, StoreError
from tessera.kube_sim.validation import DNS1123_SUBDOMAIN

from tessera.kubeapi import (
    DRA_PLUGIN_SERVICE_V1,
    DRA_PLUGIN_TYPE,
    PLUGINS_REGISTRY_DIR,
    dra,
    dra_grpc,
    reg,
    reg_grpc,
)

log = logging.getLogger("tessera.kube_sim.dra.kubelet")

RPC_TIMEOUT_S = 30.0
UNPREPARE_ATTEMPTS = 8  # ~6 s of backoff
WATCH_INTERVAL_S = 0.2
CDI_DIR = "cdi"  # <kubelet dir>/cdi: where this node's drivers write CDI specs


@dataclass
class DraPlugin:
    driver: str
    registration_socket: Path
    endpoint: str
    channel: grpc.aio.Channel
    stub: dra_grpc.DRAPluginStub
    health_task: asyncio.Task[None] | None = None


@dataclass
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    drivers: list[str]
    devices: list[tuple[str, Any]] = field(default_factory=list)  # (driver, dra.Device)
    pods: set[str] = field(default_factory=set)


def _channel(path: str) -> grpc.aio.Channel:
    target = path if path.startswith("unix:") else f"unix:{path}"
    return grpc.aio.insecure_channel(target)


def used_claims(pod: KubeObject) -> list[str]:
    names = [n for n in pod_claim_names(pod).values() if n]
    extended = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {})
    if extended.get("resourceClaimName"):
        names.append(extended["resourceClaimName"])
    return names


def without_dra_resources(pod: KubeObject) -> KubeObject:
    """The pod as the device manager sees it: extended resources DRA serves (the scheduler's
    extended-resource claim maps them) are not the device plugins' to allocate."""
    mapped = ((pod.get("status") or {}).get("extendedResourceClaimStatus") or {}).get(
        "requestMappings") or []
    if not mapped:
        return pod
    copy_ = {**pod, "spec": dict(pod.get("spec") or {})}
    for section in ("initContainers", "containers"):
        containers = []
        for container in copy_["spec"].get(section) or []:
            names = {m.get("resourceName") for m in mapped
                     if m.get("containerName") == container.get("name")}
            resources = dict(container.get("resources") or {})
            for key in ("limits", "requests"):
                resources[key] = {k: v for k, v in (resources.get(key) or {}).items()
                                  if k not in names}
            containers.append({**container, "resources": resources})
        if section in copy_["spec"]:
            copy_["spec"][section] = containers
    return copy_


class DraKubelet:
    def __init__(
        self, store: ObjectStore, node: str, kubelet_dir: Path,
        cdi_dirs: list[Path] | None = None,
        release: Callable[[KubeObject], None] | None = None,
    ) -> None:
        self.store = store
        self.node = node
        self.registry_dir = kubelet_dir / PLUGINS_REGISTRY_DIR
        self.cdi_dirs = [*(cdi_dirs or []), kubelet_dir / CDI_DIR]
        self.release = release
        self.plugins: dict[str, DraPlugin] = {}
        self._sockets: dict[Path, str] = {}  # registration socket -> driver ("" refused)
        self._identities: dict[Path, tuple[int, int]] = {}  # socket -> (inode, ctime ns)
        self.prepared: dict[str, PreparedClaim] = {}  # claim uid
        self.pod_devices: dict[str, dict[str, list[str]]] = {}  # pod uid -> container -> CDI
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        # (driver, pool, device) -> (Healthy|Unhealthy|Unknown, message), from NodeWatchResources
        self.health: dict[tuple[str, str, str], tuple[str, str]] = {}
        self.pod_keys: dict[str, tuple[str, str]] = {}  # pod uid -> namespace, name

    # --- registration ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        (self.registry_dir.parent / CDI_DIR).mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for plugin in list(self.plugins.values()):
            await self._close(plugin)
        self.plugins.clear()

    @staticmethod
    async def _close(plugin: DraPlugin) -> None:
        if plugin.health_task is not None:
            plugin.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await plugin.health_task
        await plugin.channel.close()

    async def _watch(self) -> None:
        while True:
            present = self._present_sockets()
            for path in [p for p in self._sockets
                         if present.get(p) != self._identities.get(p)]:
                await self._deregister(path)  # gone, or recreated: registered again below
            for path in sorted(set(present) - set(self._sockets)):
                self._identities[path] = present[path]
                self._sockets[path] = await self._register(path)
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _present_sockets(self) -> dict[Path, tuple[int, int]]:
        """The registry's sockets with their file identity (what a create event would tell)."""
        found: dict[Path, tuple[int, int]] = {}
        try:
            entries = list(self.registry_dir.iterdir())
        except OSError:
            return found
        for path in entries:
            if path.name.startswith("."):
                continue
            try:
                info = path.stat()
            except OSError:
                continue
            if stat.S_ISSOCK(info.st_mode):
                found[path] = (info.st_ino, info.st_ctime_ns)
        return found

    async def _register(self, path: Path) -> str:
        channel = _channel(str(path))
        try:
            stub = reg_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(reg.InfoRequest(), timeout=5.0)
            error = ""
            if info.type != DRA_PLUGIN_TYPE:
                return ""  # another kind of plugin (CSI, device plugin): not the DRA manager's
            if not DNS1123_SUBDOMAIN.match(info.name) or len(info.name) > 253:
                error = f"invalid DRA driver name {info.name!r}: must be a DNS subdomain"
            elif DRA_PLUGIN_SERVICE_V1 not in info.supported_versions:
                error = (f"none of the versions supported by the plugin "
                         f"{list(info.supported_versions)} are supported: "
                         f"[{DRA_PLUGIN_SERVICE_V1}]")
            if error:
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=False, error=error), timeout=5.0)
                log.warning("DRA plugin refused", extra={"node": self.node, "error": error})
                return ""
            endpoint = info.endpoint or str(path)
            old = self.plugins.pop(info.name, None)
            if old is not None:
                await self._close(old)
            service = _channel(endpoint)
            plugin = DraPlugin(info.name, path, endpoint, service,
                               dra_grpc.DRAPluginStub(service))
            plugin.health_task = asyncio.create_task(self._watch_health(plugin))
            self.plugins[info.name] = plugin
            await stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=5.0)
            log.info("DRA plugin registered", extra={"node": self.node, "driver": info.name})
            self.changed.set()
            return info.name
        except grpc.aio.AioRpcError as exc:
            log.warning("DRA plugin registration failed",
                        extra={"node": self.node, "socket": str(path), "error": exc.details()})
            return ""
        finally:
            await channel.close()

    async def _deregister(self, path: Path) -> None:
        driver = self._sockets.pop(path, "")
        self._identities.pop(path, None)
        plugin = self.plugins.get(driver)
        if plugin is not None and plugin.registration_socket == path:
            del self.plugins[driver]
            await self._close(plugin)
            self._set_health(driver, {})
            log.info("DRA plugin deregistered", extra={"node": self.node, "driver": driver})

    # --- device health (KEP-4680) ---------------------------------------------------------------

    async def _watch_health(self, plugin: DraPlugin) -> None:
        await watch_health(plugin.channel,
                           lambda devices: self._set_health(plugin.driver, devices))

    def _set_health(self, driver: str, devices: dict[tuple[str, str], tuple[str, str]]) -> None:
        before = {k: v for k, v in self.health.items() if k[0] == driver}
        for key in before:
            self.health[key] = ("Unknown", "")
        for (pool, device), value in devices.items():
            self.health[(driver, pool, device)] = value
        if {k: v for k, v in self.health.items() if k[0] == driver} != before:
            self._publish_health()

    def resource_statuses(self, pod: KubeObject) -> dict[str, list[dict[str, Any]]]:
        return resource_statuses(pod, self.prepared.values(), self.health)

    def annotate(self, pod: KubeObject, status: dict[str, Any]) -> None:
        """Put each container's allocatedResourcesStatus into a status being written."""
        by_container = self.resource_statuses(pod)
        for section in ("initContainerStatuses", "containerStatuses"):
            for container_status in status.get(section) or []:
                found = by_container.get(container_status.get("name", ""))
                if found:
                    container_status["allocatedResourcesStatus"] = found

    def _publish_health(self) -> None:
        for uid, (namespace, name) in list(self.pod_keys.items()):
            def update(obj: KubeObject, uid: str = uid) -> None:
                if obj["metadata"].get("uid") != uid:
                    raise StoreError(409, "Conflict", "the pod was replaced")
                self.annotate(obj, obj.setdefault("status", {}))

            with contextlib.suppress(StoreError):
                self.store.mutate("Pod", namespace, name, update)

    async def wait_registered(self, driver: str, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while driver not in self.plugins:
                self.changed.clear()
                await self.changed.wait()

    # --- pods ------------------------------------------------------------------------------------

    @staticmethod
    def uses(pod: KubeObject) -> bool:
        return bool(used_claims(pod)) or bool((pod.get("spec") or {}).get("resourceClaims"))

    def _claims(self, pod: KubeObject) -> list[KubeObject]:
        uid = pod["metadata"].get("uid", "")
        namespace = pod["metadata"].get("namespace", "")
        if any(n is None for n in pod_claim_names(pod).values()):
            raise StoreError(409, "Conflict", "a ResourceClaim of the pod is not created yet")
        claims = []
        for name in used_claims(pod):
            claim = self.store.get("ResourceClaim", namespace, name)
            status = claim.get("status") or {}
            if not status.get("allocation"):
                raise StoreError(409, "Conflict", f'resource claim "{name}" is not allocated')
            if not any(r.get("uid") == uid for r in status.get("reservedFor") or []):
                raise StoreError(409, "Conflict", f'pod "{pod["metadata"]["name"]}" is not '
                                 f'allowed to use resource claim "{name}"')
            claims.append(claim)
        return claims

    async def prepare(self, pod: KubeObject) -> str | None:
        """Prepare the pod's claims; None when done, else the error (retried by the caller)."""
        pod_uid = pod["metadata"].get("uid", "")
        try:
            claims = self._claims(pod)
        except StoreError as exc:
            return exc.message
        by_driver: dict[str, list[KubeObject]] = {}
        for claim in claims:
            uid = claim["metadata"]["uid"]
            if uid in self.prepared:
                self.prepared[uid].pods.add(pod_uid)
                continue
            results = claim["status"]["allocation"].get("devices", {}).get("results") or []
            for driver in sorted({r.get("driver", "") for r in results}):
                by_driver.setdefault(driver, []).append(claim)
        for driver, driver_claims in by_driver.items():
            plugin = self.plugins.get(driver)
            if plugin is None:
                return f"DRA driver {driver} is not registered"
            request = dra.NodePrepareResourcesRequest(claims=[
                dra.Claim(namespace=c["metadata"]["namespace"], uid=c["metadata"]["uid"],
                          name=c["metadata"]["name"]) for c in driver_claims])
            try:
                response = await plugin.stub.NodePrepareResources(request,
                                                                  timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                return f"NodePrepareResources failed for driver {driver}: {exc.details()}"
            for claim in driver_claims:
                uid = claim["metadata"]["uid"]
                if uid not in response.claims:
                    return (f"NodePrepareResources skipped claim {claim['metadata']['name']} "
                            f"(driver {driver})")
                result = response.claims[uid]
                if result.error:
                    return (f"prepare resource claim {claim['metadata']['name']} failed: "
                            f"{result.error}")
                entry = self.prepared.setdefault(uid, PreparedClaim(
                    claim["metadata"]["namespace"], claim["metadata"]["name"], uid, []))
                entry.drivers.append(driver)
                entry.devices.extend((driver, d) for d in result.devices)
                entry.pods.add(pod_uid)
        self.pod_devices[pod_uid] = self._container_devices(pod, claims)
        self.pod_keys[pod_uid] = (pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
        return None

    def _container_devices(self, pod: KubeObject, claims: list[KubeObject]) -> dict[
            str, list[str]]:
        by_name = {c["metadata"]["name"]: c for c in claims}
        entries = pod_claim_names(pod)
        extended = (pod.get("status") or {}).get("extendedResourceClaimStatus") or {}
        found: dict[str, list[str]] = {}
        spec = pod.get("spec") or {}
        for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
            ids: list[str] = []
            for ref in (container.get("resources") or {}).get("claims") or []:
                claim = by_name.get(entries.get(ref.get("name", "")) or "")
                if claim is not None:
                    ids += self._ids(claim, ref.get("request") or "")
            claim = by_name.get(extended.get("resourceClaimName") or "")
            for mapping in extended.get("requestMappings") or []:
                if claim is not None and mapping.get("containerName") == container.get("name"):
                    ids += self._ids(claim, mapping.get("requestName") or "")
            if ids:
                found[container.get("name", "")] = list(dict.fromkeys(ids))
        return found

    def _ids(self, claim: KubeObject, request: str) -> list[str]:
        prepared = self.prepared.get(claim["metadata"]["uid"])
        ids: list[str] = []
        for _, device in prepared.devices if prepared else []:
            names = list(device.request_names)
            if request and names and not any(n == request or n.split("/")[0] == request
                                              for n in names):
                continue
            ids += list(device.cdi_device_ids)
        return ids

    def apply(self, pod: KubeObject, admission: PodAdmission) -> None:
        """Give each container its CDI devices' edits (raises cdi.CdiError)."""
        for container, ids in self.pod_devices.get(pod["metadata"].get("uid", ""), {}).items():
            edits = cdi.resolve(ids, self.cdi_dirs)
            entry = next((c for c in admission.containers if c.name == container), None)
            if entry is None:
                init = any(c.get("name") == container
                           for c in (pod.get("spec") or {}).get("initContainers") or [])
                entry = ContainerAdmission(container, init)
                admission.containers.append(entry)
            entry.cdi_devices = list(ids)
            entry.envs.update(edits.env)
            entry.mounts.extend(Mount(c, h, ro) for c, h, ro in edits.mounts)
            entry.devices.extend(DeviceNode(p, h, perms) for p, h, perms in edits.device_nodes)

    async def _unprepare_claim(self, driver: str, entry: PreparedClaim) -> None:
        """NodeUnprepareResources for one claim, retried as kubelet retries it: the plugin is
        looked up again each try (a driver that crashed registers a new one on its socket), and
        a call cut off because its plugin's channel closed under it (deregistration) is a failed
        try, not a cancellation of the pod's worker. Given up after ~6 s, logged."""
        request = dra.NodeUnprepareResourcesRequest(claims=[dra.Claim(
            namespace=entry.namespace, uid=entry.uid, name=entry.name)])
        for attempt in range(UNPREPARE_ATTEMPTS):
            plugin = self.plugins.get(driver)
            if plugin is None:
                error = f"DRA driver {driver} is not registered"
            else:
                try:
                    response = await plugin.stub.NodeUnprepareResources(
                        request, timeout=RPC_TIMEOUT_S)
                    error = response.claims[entry.uid].error if (
                        entry.uid in response.claims) else "claim missing in the response"
                except grpc.aio.AioRpcError as exc:
                    error = exc.details() or str(exc.code())
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise  # our own cancellation
                    error = "the plugin's connection closed during the call"
            if not error:
                return
            log.warning("NodeUnprepareResources failed", extra={
                "node": self.node, "claim": entry.name, "error": error,
                "attempt": attempt + 1})
            await asyncio.sleep(min(1.0, 0.2 * (attempt + 1)))

    async def unprepare(self, pod: KubeObject) -> None:
        """NodeUnprepareResources for the claims only this pod used, then release them."""
        pod_uid = pod["metadata"].get("uid", "")
        self.pod_devices.pop(pod_uid, None)
        self.pod_keys.pop(pod_uid, None)
        done = [c for c in self.prepared.values() if pod_uid in c.pods]
        for entry in done:
            entry.pods.discard(pod_uid)
            if entry.pods:
                continue
            for driver in entry.drivers:
                await self._unprepare_claim(driver, entry)
            del self.prepared[entry.uid]
        if self.release is not None:
            self.release(pod)
