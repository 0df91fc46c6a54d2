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
from . import names, slices
from .driver import DraDriver, PrepareError

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

    def _entry(self, device, now: int):
        api = self.api
        return api.DeviceHealth(
            device=api.DeviceIdentifier(
                pool_name=self.node, device_name=slices.device_name(device)
            ),
            health=api.HEALTHY if device.healthy else api.UNHEALTHY,
            last_updated_time=now,
        )

    async def NodeWatchResources(self, request, context):
        seen = self.state.version
        devices = self.state.devices()
        while True:
            now = int(time.time())
            yield self.api.NodeWatchResourcesResponse(
                devices=[self._entry(d, now) for d in slices.published(devices)]
            )
            devices, seen = await self.state.wait_change(seen)


class HealthServiceV1(HealthService, drahealth_v1_grpc.DRAResourceHealthServicer):
    """The same stream on dra-health v1, whose entries also say why a GPU is unhealthy."""

    api = drahealth_v1

    def _entry(self, device, now: int):
        entry = super()._entry(device, now)
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
    """Keeps the node's ResourceSlice saying what the devices are."""

    def __init__(self, driver: DraDriver) -> None:
        self.driver = driver
        self._published: list | None = None
        self._generation = 0
        self._node_uid = ""
        self._published_owned = False
        self.publishes = 0

    def _desired(self, generation: int) -> dict:
        dra_settings = self.driver.dra
        return slices.build_slice(
            self.driver.node, self.driver.state.devices(), generation=generation,
            driver_version=dra_settings.driver_version or "0.0.0",
            default_cores=self.driver.settings.default_cores,
            taint_time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            node_uid=self._node_uid,
        )  # fmt: skip

    async def _owner(self) -> None:
        """The Node's uid: the slice is the Node's (a deleted node's slice goes with it)."""
        if self._node_uid:
            return
        try:
            node = await self.driver.cluster.get_node(self.driver.node)
        except ClusterError:
            return  # no Node object (yet): published unowned, owned on a later write
        self._node_uid = str((node.get("metadata") or {}).get("uid") or "")

    async def publish(self) -> bool:
        """Write the slice when its devices differ from what was last published."""
        cluster = self.driver.cluster
        await self._owner()
        desired = self._desired(self._generation + 1)
        devices = desired["spec"]["devices"]
        owned = bool(desired["metadata"].get("ownerReferences"))
        if (
            self._published is not None
            and _same(self._published, devices)
            and (owned == self._published_owned)
        ):
            return False
        name = desired["metadata"]["name"]
        try:
            current = await cluster.get_resource_slice(name)
        except NotFoundError:
            current = None
        if current is None:
            try:
                await cluster.create_resource_slice(desired)
            except ConflictError:
                return False  # made meanwhile: the next round replaces it
        else:
            generation = int(((current.get("spec") or {}).get("pool") or {}).get("generation", 0))
            desired = self._desired(max(generation, self._generation) + 1)
            desired["metadata"]["resourceVersion"] = current["metadata"].get("resourceVersion")
            await cluster.replace_resource_slice(desired)
        self._generation = desired["spec"]["pool"]["generation"]
        self._published = devices
        self._published_owned = owned
        self.publishes += 1
        log.info(
            "ResourceSlice published",
            extra={"slice": name, "devices": len(devices), "generation": self._generation},
        )
        return True


def _same(a: list, b: list) -> bool:
    """Devices equal but for the taints' timeAdded (set when written)."""

    def key(devices: list) -> list:
        out = []
        for d in devices:
            d = dict(d)
            d["taints"] = [{k: v for k, v in t.items() if k != "timeAdded"}
                           for t in d.get("taints") or []]  # fmt: skip
            out.append(d)
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

    async def run(self, stop: asyncio.Event) -> None:
        await self._announce_mode()
        await self._serve()
        await self._reconcile()
        await self._publish()
        last_check = time.monotonic()
        seen = self.driver.state.version
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
            await self._stop()
            for path in (self.registry_socket, self.dra_socket):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
