"""A kubelet stand-in speaking the real device-plugin and pod-resources gRPC protocols.

    kubelet = SimKubelet(socket_dir, pod_resources_socket)
    await kubelet.start()                      # Registration server on <socket_dir>/kubelet.sock
    await kubelet.wait_registered("nvidia.com/gpu")
    admission = await kubelet.admit_pod(pod)   # Allocate per container, then PreStartContainer
    admission.ok, admission.containers[0].envs, admission.containers[0].mounts
    await kubelet.restart()                    # deletes every socket in socket_dir, like kubelet

Register is answered as kubelet's device-plugin server answers it: the plugin's endpoint is
dialled before Register returns (retrying for up to `DIAL_TIMEOUT_S`, so a plugin may register
just before it serves; an endpoint that never accepts fails the Register call); a plugin already
connected on the same socket is left as it is (a no-op, "client already connected"), one on
another socket is refused. Then it keeps the device list the ListAndWatch stream reports; when
that stream ends, the connection is dropped and the resource's devices turn Unhealthy until the
plugin registers again, as in kubelet.

It follows kubelet's order: on admission, one Allocate per container that requests a
device resource (init containers first), reusing an init container's devices for the
containers after it first (any of them when more are reusable than asked; the kube-sim README
states the rules), choosing the rest through GetPreferredAllocation when the plugin
offers it, and records the assignment (visible in pod-resources List right away);
then, container by container, PreStartContainer with the same device IDs just before starting it.
As kubelet's pod manager does, pod-resources List shows a pod from the moment its admission
starts, its containers without devices until each one's Allocate returned
(`lists_admitting=False` models a kubelet whose List shows a pod only once it holds devices).
A pod asking for a device resource that no plugin registered, or that has too few healthy
devices, is refused with kubelet's admission error instead of starting without devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from tessera.kube_sim.podresources import (
    PodResourcesServer,
    PodResourcesService,
    PodResourcesStore,
)

from tessera.cancelling import cancel_and_wait
from tessera.kubeapi import (
    DEVICE_PLUGIN_VERSION,
    HEALTHY,
    KUBELET_SOCKET_NAME,
    PRE_START_TIMEOUT_S,
    UNHEALTHY,
    dp,
    dp_grpc,
)

log = logging.getLogger("tessera.kube_sim.kubelet")
T = TypeVar("T")
RPC_TIMEOUT_S = 10.0
# kubelet gives a freshly registered plugin this long to accept the connection.
DIAL_TIMEOUT_S = 10.0
# A plugin socket that is not there yet is retried quickly, not with gRPC's 1 s+ backoff.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class DeviceNode:
    """A device node Allocate asked for (DeviceSpec): container path, host path, cgroup perms."""

    container_path: str
    host_path: str
    permissions: str


@dataclass
class ContainerAdmission:
    name: str
    init: bool
    resource: str = ""
    device_ids: list[str] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    devices: list[DeviceNode] = field(default_factory=list)
    # CDI device IDs of the DRA claims the container uses (dra/kubelet.py applied their edits)
    cdi_devices: list[str] = field(default_factory=list)
    started: bool = False
    error: str = ""

    def mount(self, container_path: str) -> Mount | None:
        return next((m for m in self.mounts if m.container_path == container_path), None)


@dataclass
class PodAdmission:
    uid: str
    namespace: str
    name: str
    containers: list[ContainerAdmission] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def container(self, name: str) -> ContainerAdmission:
        return next(c for c in self.containers if c.name == name)


@dataclass
class PluginConnection:
    """One registered device plugin and the devices its ListAndWatch stream last reported."""

    resource: str
    endpoint: str
    pre_start_required: bool
    preferred_allocation: bool
    channel: grpc.aio.Channel
    stub: dp_grpc.DevicePluginStub
    registered_at: float = field(default_factory=time.monotonic)
    devices: dict[str, dp.Device] = field(default_factory=dict)
    updates: int = 0
    streaming: bool = False
    task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        """kubelet still holds this client (its ListAndWatch has not ended)."""
        return self.task is not None and not self.task.done()

    def healthy(self) -> list[str]:
        return [i for i, d in self.devices.items() if d.health == HEALTHY]

    def mark_unhealthy(self) -> None:
        """The stream ended: kubelet keeps the devices but can no longer hand them out."""
        self.devices = {
            i: dp.Device(ID=d.ID, health=UNHEALTHY, topology=d.topology)
            for i, d in self.devices.items()
        }


def requested(container: dict[str, Any], resource: str) -> int:
    """How many of `resource` a container asks (limits, else requests)."""
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get(resource)
        if value is not None:
            return int(str(value))
    return 0


class _Registration(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: SimKubelet) -> None:
        self.kubelet = kubelet

    async def Register(self, request, context):
        if request.version != DEVICE_PLUGIN_VERSION:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unsupported device plugin API version {request.version!r}",
            )
        if not request.resource_name or not request.endpoint or "/" in request.endpoint:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad resource name or endpoint")
        try:
            await self.kubelet._connect(request)
        except RegistrationError as exc:
            # kubelet returns a plain Go error here, which gRPC sends as UNKNOWN.
            await context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        return dp.Empty()


class SimKubelet:
    """The device-manager half of kubelet, for tests and the local stack."""

    def __init__(
        self,
        socket_dir: str | Path,
        pod_resources_socket: str | Path,
        *,
        on_change: Callable[[], None] | None = None,
        device_resources: Iterable[str] = (),
        dial_timeout_s: float = DIAL_TIMEOUT_S,
        rng: random.Random | None = None,
        lists_admitting: bool = True,
        node: str = "",
    ) -> None:
        self.socket_dir = Path(socket_dir)
        self.node = node  # named in the log lines, so a stalled node's plugin history shows
        self.lists_admitting = lists_admitting
        # Resources this node expects a device plugin for (the node's extended resources):
        # a pod asking for one is refused while no plugin serves it. Any resource a plugin
        # registered counts too; other extended resources (HAMi's gpumem/gpucores) are left
        # to the scheduler, as kubelet leaves resources no device plugin manages.
        self.device_resources = set(device_resources)
        self.dial_timeout_s = dial_timeout_s
        self.rng = rng or random.Random()
        self.pod_resources = PodResourcesStore()
        self.plugins: dict[str, PluginConnection] = {}
        self.registrations: list[tuple[str, str, float]] = []
        self._on_change = on_change
        self._changed = asyncio.Condition()
        self._registering = asyncio.Lock()
        self._server: grpc.aio.Server | None = None
        self._pr_server = PodResourcesServer(
            pod_resources_socket, PodResourcesService(self.pod_resources, self._allocatable)
        )

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / KUBELET_SOCKET_NAME

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._start_registration()
        await self._pr_server.start()

    async def _start_registration(self) -> None:
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = grpc.aio.server()
        dp_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        await self._stop_registration()
        await self._pr_server.stop()

    async def _stop_registration(self) -> None:
        for plugin in list(self.plugins.values()):
            await self._close(plugin)
        self.plugins.clear()
        if self._server is not None:
            await self._server.stop(grace=0.5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    async def restart(self) -> None:
        """What a kubelet restart looks like to plugins: every socket in the dir is deleted."""
        await self._stop_registration()
        for sock in self.socket_dir.glob("*.sock"):
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
        await self._start_registration()

    # --- plugins --------------------------------------------------------------------------------

    async def _connect(self, request: dp.RegisterRequest) -> None:
        """kubelet's connectClient: dial before answering, keep a live client as it is."""
        async with self._registering:
            current = self.plugins.get(request.resource_name)
            if current is not None and current.connected:
                if current.endpoint != request.endpoint:
                    raise RegistrationError(
                        f"the device plugin {request.resource_name} already registered with a "
                        f"different socket path {current.endpoint}"
                    )
                log.info("client already connected with the same socket path",
                         extra={"node": self.node, "resource": request.resource_name,
                                "endpoint": request.endpoint})
                return
            channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_dir / request.endpoint}", options=_CHANNEL_OPTIONS
            )
            try:
                await asyncio.wait_for(channel.channel_ready(), self.dial_timeout_s)
            except TimeoutError:
                await channel.close()
                log.warning("device plugin never accepted the connection",
                            extra={"node": self.node, "resource": request.resource_name,
                                   "endpoint": request.endpoint,
                                   "timeout_s": self.dial_timeout_s})
                raise RegistrationError(
                    f"failed to dial device plugin {request.resource_name} at "
                    f"{request.endpoint}: context deadline exceeded"
                ) from None
            if current is not None:  # its stream had ended: replaced by the new client
                self.plugins.pop(request.resource_name, None)
                await self._close(current)
            plugin = PluginConnection(
                resource=request.resource_name,
                endpoint=request.endpoint,
                pre_start_required=request.options.pre_start_required,
                preferred_allocation=request.options.get_preferred_allocation_available,
                channel=channel,
                stub=dp_grpc.DevicePluginStub(channel),
            )
            plugin.task = asyncio.create_task(self._watch(plugin))
            self.plugins[request.resource_name] = plugin
            self.registrations.append((request.resource_name, request.endpoint, time.monotonic()))
            log.info("plugin registered",
                     extra={"node": self.node, "resource": request.resource_name})
        await self._notify()

    async def _close(self, plugin: PluginConnection) -> None:
        if plugin.task is not None:
            await cancel_and_wait(plugin.task)
        await plugin.channel.close()

    async def _watch(self, plugin: PluginConnection) -> None:
        """Follow ListAndWatch until it ends; from then on the client is dropped and its
        devices are Unhealthy until the plugin registers again."""
        try:
            async for response in plugin.stub.ListAndWatch(dp.Empty()):
                plugin.devices = {d.ID: d for d in response.devices}
                plugin.updates += 1
                plugin.streaming = True
                await self._notify()
            log.info("ListAndWatch ended by the plugin",
                     extra={"node": self.node, "resource": plugin.resource})
        except grpc.aio.AioRpcError as exc:
            log.info("ListAndWatch ended", extra={"node": self.node, "resource": plugin.resource,
                                                  "err": exc.details()})
        finally:
            plugin.streaming = False
            plugin.mark_unhealthy()
            with contextlib.suppress(Exception):
                await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        if self._on_change:
            self._on_change()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(predicate), timeout)

    async def wait_registered(
        self, resource: str, *, after: int = 0, timeout: float = 10.0
    ) -> PluginConnection:
        """The plugin for `resource` once it registered more than `after` times in total and
        its first device list arrived."""

        def ready() -> bool:
            count = sum(1 for r, _, _ in self.registrations if r == resource)
            plugin = self.plugins.get(resource)
            return count > after and plugin is not None and plugin.updates > 0

        await self.wait_for(ready, timeout)
        return self.plugins[resource]

    def registration_count(self, resource: str) -> int:
        return sum(1 for r, _, _ in self.registrations if r == resource)

    def _allocatable(self) -> dict[str, list[str]]:
        return {r: list(p.devices) for r, p in self.plugins.items()}

    # --- admission ------------------------------------------------------------------------------

    async def allocate_pod(self, pod: dict[str, Any]) -> PodAdmission:
        """Allocate for every container that asks a plugin's resource, init containers first."""
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        admission = PodAdmission(meta.get("uid", ""), meta.get("namespace", "default"),
                                 meta.get("name", ""))
        ordered = [(c, True) for c in spec.get("initContainers") or []]
        ordered += [(c, False) for c in spec.get("containers") or []]
        if self.lists_admitting and any(self._device_resources_of(c) for c, _ in ordered):
            # kubelet's List reports app containers and native sidecars, not plain init ones.
            self.pod_resources.begin(admission.uid, admission.namespace, admission.name, [
                c.get("name", "") for c, init in ordered
                if not init or c.get("restartPolicy") == "Always"
            ])  # fmt: skip
        # kubelet's device reuse (see the README): a finished init container's devices are
        # handed to the containers after it before new ones are taken; a sidecar (restartable
        # init container) and every app container keep theirs, so they leave the pool.
        reusable: dict[str, list[str]] = {}
        for container, init in ordered:
            entry = ContainerAdmission(name=container.get("name", ""), init=init)
            admission.containers.append(entry)
            for resource in self._device_resources_of(container):
                count = requested(container, resource)
                if count <= 0:
                    continue
                entry.resource = resource
                pool = reusable.setdefault(resource, [])
                try:
                    plugin = self.plugins.get(resource)
                    if plugin is None:
                        raise AdmissionError(
                            f"resource {resource} is not registered: no device plugin serves it"
                        )
                    await self._allocate(admission, entry, plugin, count, pool)
                except (AdmissionError, grpc.aio.AioRpcError) as exc:
                    entry.error = _message(exc)
                    admission.error = f"container {entry.name}: {entry.error}"
                    # A rejected pod is no longer active: List stops showing it (devices it
                    # was given before the failure stay recorded until remove_pod).
                    self.pod_resources.drop_if_empty(admission.uid)
                    return admission
                if init and container.get("restartPolicy") != "Always":
                    pool.extend(d for d in entry.device_ids if d not in pool)
                else:
                    pool[:] = [d for d in pool if d not in entry.device_ids]
        return admission

    def _device_resources_of(self, container: dict[str, Any]) -> list[str]:
        resources = container.get("resources") or {}
        names = set((resources.get("limits") or {}) | (resources.get("requests") or {}))
        return sorted(n for n in names if n in self.plugins or n in self.device_resources)

    async def _allocate(
        self, admission: PodAdmission, entry: ContainerAdmission, plugin: PluginConnection,
        count: int, reusable: list[str],
    ) -> None:
        # kubelet takes reusable devices from a Go set: any of them, in no fixed order.
        reused = self.rng.sample(reusable, min(count, len(reusable)))
        in_use = self.pod_resources.in_use(plugin.resource)
        available = [d for d in plugin.healthy() if d not in in_use]
        if len(reused) + len(available) < count:
            if not plugin.healthy():
                raise AdmissionError(
                    "no healthy devices present; cannot allocate unhealthy devices "
                    f"{plugin.resource}"
                )
            raise AdmissionError(
                f"requested number of devices unavailable for {plugin.resource}. "
                f"Requested: {count}, Available: {len(reused) + len(available)}"
            )
        chosen = reused + available[: count - len(reused)]
        if len(reused) < count and plugin.preferred_allocation:
            reply = await unless_channel_closed(plugin.stub.GetPreferredAllocation(
                dp.PreferredAllocationRequest(container_requests=[
                    dp.ContainerPreferredAllocationRequest(
                        available_deviceIDs=reused + available,
                        must_include_deviceIDs=reused,
                        allocation_size=count,
                    )
                ]),
                timeout=RPC_TIMEOUT_S,
            ))
            preferred = list(reply.container_responses[0].deviceIDs)
            if (len(preferred) == count and set(reused) <= set(preferred)
                    and set(preferred) <= set(available) | set(reused)):
                chosen = preferred
        reply = await unless_channel_closed(plugin.stub.Allocate(
            dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(
                devices_ids=chosen
            )]),
            timeout=RPC_TIMEOUT_S,
        ))
        response = reply.container_responses[0]
        entry.device_ids = list(chosen)
        entry.envs = dict(response.envs)
        entry.mounts = [Mount(m.container_path, m.host_path, m.read_only) for m in response.mounts]
        entry.devices = [DeviceNode(d.container_path, d.host_path, d.permissions)
                         for d in response.devices]
        self.pod_resources.assign(
            admission.uid, admission.namespace, admission.name, entry.name, plugin.resource,
            chosen,
        )

    async def start_pod(self, admission: PodAdmission) -> PodAdmission:
        """Start containers in order: PreStartContainer (same IDs) just before each one."""
        if not admission.ok:
            return admission
        for entry in admission.containers:
            plugin = self.plugins.get(entry.resource) if entry.resource else None
            if plugin is not None and entry.device_ids and plugin.pre_start_required:
                try:
                    await unless_channel_closed(plugin.stub.PreStartContainer(
                        dp.PreStartContainerRequest(devices_ids=entry.device_ids),
                        timeout=PRE_START_TIMEOUT_S,
                    ))
                except (AdmissionError, grpc.aio.AioRpcError) as exc:
                    entry.error = _message(exc)
                    admission.error = f"container {entry.name} failed to start: {entry.error}"
                    return admission
            entry.started = True
        return admission

    async def admit_pod(self, pod: dict[str, Any]) -> PodAdmission:
        """Admission then start, as kubelet does for a pod bound to its node."""
        return await self.start_pod(await self.allocate_pod(pod))

    def remove_pod(self, uid: str) -> None:
        """The pod is gone: its devices are free again."""
        self.pod_resources.remove(uid)


class AdmissionError(Exception):
    """kubelet refuses the pod (UnexpectedAdmissionError in a real cluster)."""


class RegistrationError(Exception):
    """kubelet refuses a Register call (the plugin is expected to register again)."""


async def unless_channel_closed(call: Awaitable[T]) -> T:
    """Await a plugin RPC. grpc.aio ends a call whose channel is closed under it (kubelet
    restarted, or the plugin's stream ended and it registered again, so its old connection is
    closed) with CancelledError in the caller,
    though the caller's task is not being cancelled: that is a failed RPC, which the
    admission retries on the new connection, not a reason to stop admitting pods."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # this task is being cancelled (kube-sim stopping): let it end
        raise AdmissionError(
            "UNAVAILABLE: the device plugin's connection was closed during the call "
            "(kubelet restarted or the plugin registered again)"
        ) from None


def _message(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
