"""A test double of a DRA kubelet plugin (not Tessera's driver: that is the node agent's), for
kube-sim's kubelet side: it serves the real plugin-registration and dra.v1 gRPC services on unix
sockets, as a driver built on k8s.io/dynamic-resource-allocation/kubeletplugin does, and writes
one CDI spec per prepared claim (an env var naming the device and the claim, a read-only mount).
It records every call so tests can see what kubelet asked."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tessera.kubeapi import (
    DRA_PLUGIN_SERVICE_V1,
    DRA_PLUGIN_TYPE,
    dra,
    dra_grpc,
    drahealth_v1,
    drahealth_v1_grpc,
    reg,
    reg_grpc,
)


@dataclass
class PluginDouble:
    driver: str
    kubelet_dir: Path  # <kubelet_root>/<node>
    store_get: Any  # (namespace, name) -> ResourceClaim, to read the allocation
    versions: tuple[str, ...] = (DRA_PLUGIN_SERVICE_V1,)
    prepared: list[str] = field(default_factory=list)  # claim names, in call order
    unprepared: list[str] = field(default_factory=list)
    statuses: list[tuple[bool, str]] = field(default_factory=list)
    fail_prepare: str = ""
    server: grpc.aio.Server | None = None
    # (pool, device) -> (dra-health v1 HealthStatus, message); None: no health service at all
    health: dict[tuple[str, str], tuple[int, str]] | None = None
    health_changed: asyncio.Event = field(default_factory=asyncio.Event)

    def set_health(self, pool: str, device: str, status: int, message: str = "") -> None:
        assert self.health is not None
        self.health[(pool, device)] = (status, message)
        self.health_changed.set()

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{self.driver}-reg.sock"

    @property
    def service_socket(self) -> Path:
        return self.kubelet_dir / "plugins" / self.driver / "dra.sock"

    @property
    def cdi_dir(self) -> Path:
        return self.kubelet_dir / "cdi"

    async def start(self) -> None:
        self.registration_socket.parent.mkdir(parents=True, exist_ok=True)
        self.service_socket.parent.mkdir(parents=True, exist_ok=True)
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        server = grpc.aio.server()
        server.add_insecure_port(f"unix:{self.service_socket}")
        registration = grpc.aio.server()
        registration.add_insecure_port(f"unix:{self.registration_socket}")
        reg_grpc.add_RegistrationServicer_to_server(_Registration(self), registration)
        dra_grpc.add_DRAPluginServicer_to_server(_Driver(self), server)
        if self.health is not None:
            drahealth_v1_grpc.add_DRAResourceHealthServicer_to_server(_Health(self), server)
        await server.start()
        await registration.start()
        self.server = server
        self._registration = registration

    async def stop(self) -> None:
        for server in (self._registration, self.server):
            if server is not None:
                await server.stop(None)
        self.registration_socket.unlink(missing_ok=True)

    async def crash(self) -> None:
        """Stop serving as a SIGKILLed plugin does: its registration socket file stays behind
        (gRPC removes the file on a clean stop, so it is moved aside and back around the stop)."""
        aside = self.registration_socket.with_name(f".{self.registration_socket.name}.crashed")
        self.registration_socket.rename(aside)
        for server in (self._registration, self.server):
            if server is not None:
                await server.stop(None)
        aside.rename(self.registration_socket)

    def cdi_id(self, claim_uid: str, device: str) -> str:
        return f"{self.driver}/claim={claim_uid}-{device}"


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: PluginDouble) -> None:
        self.plugin = plugin

    async def GetInfo(self, request: Any, context: Any) -> Any:
        return reg.PluginInfo(type=DRA_PLUGIN_TYPE, name=self.plugin.driver,
                              endpoint=str(self.plugin.service_socket),
                              supported_versions=list(self.plugin.versions))

    async def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.plugin.statuses.append((request.plugin_registered, request.error))
        return reg.RegistrationStatusResponse()


class _Driver(dra_grpc.DRAPluginServicer):
    def __init__(self, plugin: PluginDouble) -> None:
        self.plugin = plugin

    async def NodePrepareResources(self, request: Any, context: Any) -> Any:
        plugin = self.plugin
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            plugin.prepared.append(claim.name)
            entry = response.claims[claim.uid]
            if plugin.fail_prepare:
                entry.error = plugin.fail_prepare
                continue
            stored = plugin.store_get(claim.namespace, claim.name)
            devices = []
            for result in stored["status"]["allocation"]["devices"]["results"]:
                if result["driver"] != plugin.driver:
                    continue
                cdi_id = plugin.cdi_id(claim.uid, result["device"])
                entry.devices.add(request_names=[result["request"]], pool_name=result["pool"],
                                  device_name=result["device"], cdi_device_ids=[cdi_id])
                consumed = result.get("consumedCapacity") or {}
                devices.append({"name": cdi_id.split("=", 1)[1], "containerEdits": {
                    "env": [f"DOUBLE_DEVICE={result['device']}", f"DOUBLE_CLAIM={claim.name}",
                            *(f"DOUBLE_{k.upper()}={v}" for k, v in consumed.items())],
                    "mounts": [{"hostPath": str(plugin.cdi_dir),
                                "containerPath": f"/run/double/{result['device']}",
                                "options": ["ro", "bind"]}]}})
            spec = {"cdiVersion": "0.6.0", "kind": f"{plugin.driver}/claim", "devices": devices}
            (plugin.cdi_dir / f"{claim.uid}.json").write_text(json.dumps(spec))
        return response

    async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            self.plugin.unprepared.append(claim.name)
            (self.plugin.cdi_dir / f"{claim.uid}.json").unlink(missing_ok=True)
            response.claims[claim.uid].error = ""
        return response


class _Health(drahealth_v1_grpc.DRAResourceHealthServicer):
    """dra-health v1: the whole device list now, then again on every change."""

    def __init__(self, plugin: PluginDouble) -> None:
        self.plugin = plugin

    async def NodeWatchResources(self, request: Any, context: Any) -> Any:
        while True:
            self.plugin.health_changed.clear()
            response = drahealth_v1.NodeWatchResourcesResponse()
            for (pool, device), (status, message) in (self.plugin.health or {}).items():
                response.devices.add(device=drahealth_v1.DeviceIdentifier(
                    pool_name=pool, device_name=device), health=status, message=message,
                    last_updated_time=1)
            yield response
            await self.plugin.health_changed.wait()
