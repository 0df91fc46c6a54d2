"""Builders for scheduler tests: devices, nodes, pods as Kubernetes JSON."""

from __future__ import annotations

import uuid as uuidlib
from typing import Any

from tessera.models import DeviceInfo, NodeRegistration

GIB = 1024


def device(
    uuid: str = "GPU-0",
    index: int = 0,
    *,
    memory_mib: int = 80 * GIB,
    cores: int = 100,
    split: int = 10,
    type: str = "NVIDIA-H100",
    numa: int = 0,
    healthy: bool = True,
    mode: str = "hami-core",
    links: dict[str, int] | None = None,
) -> DeviceInfo:
    return DeviceInfo(
        uuid=uuid, index=index, type=type, memory_mib=memory_mib, cores=cores, split_count=split,
        numa=numa, healthy=healthy, mode=mode, links=links or {},
    )  # fmt: skip


def node(name: str, gpus: int = 4, **kw: Any) -> NodeRegistration:
    return NodeRegistration(
        node=name, devices=[device(f"GPU-{name}-{i}", i, **kw) for i in range(gpus)]
    )


def container(
    name: str = "main",
    gpus: int | None = 1,
    mem: int | None = None,
    pct: int | None = None,
    cores: int | None = None,
) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    if gpus is not None:
        limits["nvidia.com/gpu"] = gpus
    if mem is not None:
        limits["nvidia.com/gpumem"] = mem
    if pct is not None:
        limits["nvidia.com/gpumem-percentage"] = pct
    if cores is not None:
        limits["nvidia.com/gpucores"] = cores
    return {"name": name, "image": "x", "resources": {"limits": limits}}


def pod(
    *containers: dict[str, Any],
    name: str | None = None,
    namespace: str = "default",
    annotations: dict[str, str] | None = None,
    init: list[dict[str, Any]] | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers) or [container()]}
    if init:
        spec["initContainers"] = init
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name or f"p-{uuidlib.uuid4().hex[:8]}",
            "namespace": namespace,
            "uid": uid or str(uuidlib.uuid4()),
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }
