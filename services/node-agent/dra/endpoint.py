"""The driver's faces: kubelet's plugin registration, the `dra.v1` service, device health, and
the node's ResourceSlice.

- **Registration** (pluginregistration v1): a socket `<kubelet>/plugins_registry/<driver>-reg.sock`
  serving `Registration`; kubelet's plugin watcher finds it, calls `GetInfo` (type `DRAPlugin`,
  the driver name, the DRA socket's path, `v1.DRAPlugin`) and reports back through
  `NotifyRegistrationStatus`. Both sockets are served again when something removes them.
- **DRAPlugin** on `<kubelet>/plugins/<driver>/dra.sock`: NodePrepareResources /
  NodeUnprepareResources, one answer per claim (an error for one claim never fails the others).
- **DRAResourceHealth** (v1alpha1 and v1) on the same socket: NodeWatchResources streams
  every device's health now and at each change.
- **ResourceSlice**: published through the cluster port at start and whenever the devices
  change (health, node configuration), its pool generation moved; an unhealthy GPU is tainted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from pathlib import Path

import grpc

from tessera import dra_names as names
from tessera.cancelling import cancel_and_wait
from tessera.cluster.port import ClusterError, ConflictError, NotFoundError
from tessera.kubeapi import (
    dra,
    dra_grpc,
    drahealth,
    drahealth_grpc,
    drahealth_v1,
    drahealth_v1_grpc,
    reg,
    reg_grpc,
)

from ..state import DeviceState
from . import slices
from .driver import DraDriver, PrepareError
from .pod_watch import watch_ended_pods

log = logging.getLogger("tessera.node_agent.dra")


class DraService(dra_grpc.DRAPluginServicer):
    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver

    async def NodePrepareResources(self, request, context):
        out = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            answer = out.claims[claim.uid]
            try:
                prepared = await self.driver.prepare(claim.namespace, claim.name, claim.uid)
            except PrepareError as exc:
                answer.error = str(exc)
                continue
            except Exception as exc:  # never a crashed call: kubelet retries on an error
                log.exception("prepare failed")
                answer.error = f"preparing {claim.namespace}/{claim.name} failed: {exc}"
                continue
            for record, cdi_id in prepared:
                for device in record.devices:
                    answer.devices.append(dra.Device(
                        request_names=[device.request] if device.request else [],
                        pool_name=self.driver.node, device_name=device.device,
                        cdi_device_ids=[cdi_id],
                    ))  # fmt: skip
        return out

    async def NodeUnprepareResources(self, request, context):
        out = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            answer = out.claims[claim.uid]
            try:
                await self.driver.unprepare(claim.namespace, claim.name, claim.uid)
            except Exception as exc:
                log.exception("unprepare failed")
                answer.error = f"unpreparing {claim.namespace}/{claim.name} failed: {exc}"
        return out


class HealthService(drahealth_grpc.DRAResourceHealthServicer):
    """NodeWatchResources (dra-health v1alpha1): every device's health now and at each change."""

    api = drahealth

    def __init__(self, state: DeviceState, node: str) -> None:
        self.state = state
        self.node = node

    def _entry(self, device, name: str, now: int):
        api = self.api
        return api.DeviceHealth(
            device=api.DeviceIdentifier(pool_name=self.node, device_name=name),
            health=api.HEALTHY if device.healthy else api.UNHEALTHY,
            last_updated_time=now,
        )

    async def NodeWatchResources(self, request, context):
        seen = self.state.version
        devices = self.state.devices()
        while True:
            now = int(time.time())
            yield self.api.NodeWatchResourcesResponse(  # a MIG card: each of its partitions
                devices=[self._entry(d, name, now) for d in slices.published(devices)
                         for name in slices.device_names(d)]
            )  # fmt: skip
            devices, seen = await self.state.wait_change(seen)


class HealthServiceV1(HealthService, drahealth_v1_grpc.DRAResourceHealthServicer):
    """The same stream on dra-health v1, whose entries also say why a GPU is unhealthy."""

    api = drahealth_v1

    def _entry(self, device, name: str, now: int):
        entry = super()._entry(device, name, now)
        if not device.healthy:
            entry.message = "NVML reported a critical XID or ECC error on this GPU"
        return entry


class RegistrationService(reg_grpc.RegistrationServicer):
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.registered = asyncio.Event()
        self.last_error = ""

    async def GetInfo(self, request, context):
        return reg.PluginInfo(type=names.PLUGIN_TYPE, name=names.DRIVER_NAME,
                              endpoint=self.endpoint,
                              supported_versions=list(names.DRA_SERVICE_VERSIONS))  # fmt: skip

    async def NotifyRegistrationStatus(self, request, context):
        if request.plugin_registered:
            self.registered.set()
            self.last_error = ""
            log.info("registered with kubelet", extra={"driver": names.DRIVER_NAME})
        else:
            self.registered.clear()
            self.last_error = request.error
            log.warning("kubelet refused the registration", extra={"err": request.error})
        return reg.RegistrationStatusResponse()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


class SlicePublisher:
    """Keeps the node's pool (its ResourceSlices) saying what the devices are."""

    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver
        self._published: list | None = None
        self._generation = 0
        self._node_uid = ""
        self._published_owned = False
        self.publishes = 0

    def _desired(self, generation: int) -> list[dict]:
        dra_settings = self.driver.dra
        return slices.build_slices(
            self.driver.node, self.driver.state.devices(), generation=generation,
            driver_version=dra_settings.driver_version or "0.0.0",
            default_cores=self.driver.settings.default_cores,
            taint_time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            node_uid=self._node_uid,
        )  # fmt: skip

    async def _owner(self) -> None:
        """The Node's uid: the slices are the Node's (a deleted node's slices go with it)."""
        if self._node_uid:
            return
        try:
            node = await self.driver.cluster.get_node(self.driver.node)
        except ClusterError:
            return  # no Node object (yet): published unowned, owned on a later write
        self._node_uid = str((node.get("metadata") or {}).get("uid") or "")

    async def publish(self) -> bool:
        """Write the pool's slices when what they say differs from what was last published
        (every slice at one new generation), and delete the node's slices the pool no longer
        has (fewer MIG partitions, fewer counter sets)."""
        cluster = self.driver.cluster
        await self._owner()
        desired = self._desired(self._generation + 1)
        contents = [_content(s) for s in desired]
        owned = bool(desired[0]["metadata"].get("ownerReferences"))
        if (
            self._published is not None
            and _same(self._published, contents)
            and (owned == self._published_owned)
        ):
            return False
        existing = {
            str((s.get("metadata") or {}).get("name")): s
            for s in await cluster.list_resource_slices(driver=names.DRIVER_NAME,
                                                        node=self.driver.node)
        }  # fmt: skip
        for name in {s["metadata"]["name"] for s in desired} - set(existing):
            with contextlib.suppress(NotFoundError):  # listed late: the write below tells
                existing[name] = await cluster.get_resource_slice(name)
        generation = max([self._generation, *(
            int(((s.get("spec") or {}).get("pool") or {}).get("generation", 0))
            for s in existing.values())]) + 1  # fmt: skip
        desired = self._desired(generation)
        for wanted in desired:
            current = existing.get(wanted["metadata"]["name"])
            if current is None:
                try:
                    await cluster.create_resource_slice(wanted)
                except ConflictError:
                    return False  # made meanwhile: the next round replaces it
            else:
                wanted["metadata"]["resourceVersion"] = current["metadata"].get("resourceVersion")
                await cluster.replace_resource_slice(wanted)
        for name in sorted(set(existing) - {s["metadata"]["name"] for s in desired}):
            labels = (existing[name].get("metadata") or {}).get("labels") or {}
            if labels.get("app.kubernetes.io/managed-by") == "tessera-node-agent":
                with contextlib.suppress(NotFoundError):
                    await cluster.delete_resource_slice(name)
        self._generation = generation
        self._published = contents
        self._published_owned = owned
        self.publishes += 1
        log.info("ResourceSlices published", extra={
            "slices": len(desired), "generation": generation,
            "devices": sum(len(s["spec"].get("devices") or []) for s in desired),
        })  # fmt: skip
        return True


def _content(resource_slice: dict) -> dict:
    spec = resource_slice["spec"]
    return {"devices": spec.get("devices"), "sharedCounters": spec.get("sharedCounters"),
            "count": spec["pool"]["resourceSliceCount"]}  # fmt: skip


def _same(a: list, b: list) -> bool:
    """Slices equal but for the taints' timeAdded (set when written)."""

    def key(contents: list) -> list:
        out = []
        for c in contents:
            devices = []
            for d in c.get("devices") or []:
                d = dict(d)
                d["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"}
                               for t in d.get("taints") or []]  # fmt: skip
                devices.append(d)
            out.append({**c, "devices": devices})
        return out

    return key(a) == key(b)


class DraEndpoint:
    """Serves the driver on kubelet's sockets and keeps the slice current until `stop`."""

    def __init__(self, driver: DraDriver, poll_s: float = 0.25) -> None:
        self.driver = driver
        kubelet = Path(driver.dra.kubelet_dir)
        self.registry_socket = kubelet / "plugins_registry" / f"{names.DRIVER_NAME}-reg.sock"
        self.dra_socket = kubelet / "plugins" / names.DRIVER_NAME / "dra.sock"
        self.poll_s = poll_s
        self.registration = RegistrationService(str(self.dra_socket))
        self.publisher = SlicePublisher(driver)
        self._servers: list[grpc.aio.Server] = []
        self._inodes: tuple[int | None, int | None] = (None, None)
        self.reconciles = 0  # reconcile passes run (each also hands on what the watch missed)

    async def _serve(self) -> None:
        await self._stop()
        for path in (self.dra_socket, self.registry_socket):
            path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        service = grpc.aio.server()
        dra_grpc.add_DRAPluginServicer_to_server(DraService(self.driver), service)
        drahealth_grpc.add_DRAResourceHealthServicer_to_server(
            HealthService(self.driver.state, self.driver.node), service
        )
        drahealth_v1_grpc.add_DRAResourceHealthServicer_to_server(
            HealthServiceV1(self.driver.state, self.driver.node), service
        )
        service.add_insecure_port(f"unix://{self.dra_socket}")
        await service.start()
        registry = grpc.aio.server()
        reg_grpc.add_RegistrationServicer_to_server(self.registration, registry)
        registry.add_insecure_port(f"unix://{self.registry_socket}")
        await registry.start()  # last: kubelet may call GetInfo the moment the socket appears
        self._servers = [service, registry]
        self._inodes = (_inode(self.dra_socket), _inode(self.registry_socket))

    async def _stop(self) -> None:
        for server in self._servers:
            await server.stop(grace=0.5)
        self._servers = []

    async def _publish(self) -> None:
        try:
            await self.publisher.publish()
        except ClusterError as exc:
            log.warning("ResourceSlice not published", extra={"err": str(exc)})

    async def _announce_mode(self) -> None:
        """The Node says it is in DRA mode: the extender leaves it to the allocator."""
        try:
            await self.driver.cluster.patch_node_annotations(
                self.driver.node, {names.ANN_ALLOCATION_MODE: "dra"}
            )
        except ClusterError as exc:
            log.warning("DRA-mode annotation not written", extra={"err": str(exc)})

    async def _reconcile(self) -> None:
        try:
            await self.driver.reconcile()
        except Exception as exc:  # NATS away: the next round
            log.warning("DRA ledger reconcile failed", extra={"err": str(exc)})
        self.reconciles += 1

    async def run(self, stop: asyncio.Event) -> None:
        await self._announce_mode()
        await self._serve()
        await self._reconcile()
        await self._publish()
        last_check = time.monotonic()
        seen = self.driver.state.version
        # an ended pod's shared claims handed on at once (pod_watch.py); the reconcile below
        # every publish interval stays the fallback
        watch = asyncio.create_task(watch_ended_pods(self.driver, stop, log))
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_s)
                if stop.is_set():
                    break
                if (_inode(self.dra_socket), _inode(self.registry_socket)) != self._inodes:
                    log.info("DRA plugin sockets gone; serving them again")
                    await self._serve()
                interval = self.driver.dra.publish_interval_s
                if self.driver.state.version != seen or time.monotonic() - last_check >= interval:
                    due = time.monotonic() - last_check >= interval
                    seen = self.driver.state.version
                    last_check = time.monotonic()
                    await self._publish()
                    if due:  # a ledger rebuilt without the DRA pods gets them back
                        await self._reconcile()
        finally:
            await cancel_and_wait(watch)  # blocked on the next event: stop cannot end it
            await self._stop()
            for path in (self.registry_socket, self.dra_socket):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
