"""AdmissionReview payloads for the admission tests, and a quota service test double."""

from __future__ import annotations

import base64
import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonpatch
from nats.aio.client import Client as NatsClient

from tessera import bus
from tessera.codec import decode, encode
from tessera.models import QuotaReply, QuotaRequest

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIORITY = "nvidia.com/priority"


def container(name: str = "main", limits: dict[str, Any] | None = None, **extra: Any) -> dict:
    c: dict[str, Any] = {"name": name, "image": "registry.example/cuda:12"}
    if limits is not None:
        c["resources"] = {"limits": dict(limits)}
    c.update(extra)
    return c


def pod(
    *containers: dict,
    init: list[dict] | None = None,
    name: str = "trainer",
    namespace: str = "team-a",
    annotations: dict[str, str] | None = None,
    **spec: Any,
) -> dict:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())}
    if annotations:
        metadata["annotations"] = dict(annotations)
    body: dict[str, Any] = {"containers": list(containers)}
    if init:
        body["initContainers"] = list(init)
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": body}


def review(
    obj: Any,
    *,
    api_version: str = "admission.k8s.io/v1",
    uid: str | None = None,
    operation: str = "CREATE",
    kind: dict | None = None,
    resource: str = "pods",
    namespace: str | None = None,
    dry_run: bool = False,
) -> dict:
    if namespace is None:
        namespace = (obj.get("metadata") or {}).get("namespace", "team-a") if isinstance(
            obj, dict) else "team-a"
    return {
        "apiVersion": api_version,
        "kind": "AdmissionReview",
        "request": {
            "uid": uid or str(uuid.uuid4()),
            "kind": kind or {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": resource},
            "requestKind": kind or {"group": "", "version": "v1", "kind": "Pod"},
            "name": (obj.get("metadata") or {}).get("name", "") if isinstance(obj, dict) else "",
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": None,
            "dryRun": dry_run,
        },
    }


def patched(original: dict, response: dict) -> dict:
    """Apply the response's JSON patch (as the API server would) and return the new pod."""
    assert response["allowed"] is True, response
    if "patch" not in response:
        return copy.deepcopy(original)
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(original, ops)


def env_of(pod_obj: dict, index: int = 0, section: str = "containers") -> dict[str, str]:
    env = pod_obj["spec"][section][index].get("env") or []
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), f"duplicate env entries: {names}"
    return {e["name"]: e.get("value") for e in env}


def limits_of(pod_obj: dict, index: int = 0, section: str = "containers") -> dict[str, str]:
    return pod_obj["spec"][section][index].get("resources", {}).get("limits", {})


@dataclass
class QuotaServiceDouble:
    """TEST DOUBLE of tessera-quota's reserve endpoint (the real service lives elsewhere).

    Answers QuotaRequest on bus.QUOTA_RESERVE with QuotaReply: a namespace fits while the
    request stays within `limits[namespace]` (memory MiB, cores, GPUs; missing = unlimited).
    `silent` = subscribed but never answering (a hung quota service).
    """

    limits: dict[str, tuple[int | None, int | None, int | None]] = field(default_factory=dict)
    silent: bool = False
    requests: list[QuotaRequest] = field(default_factory=list)

    async def start(self, nc: NatsClient) -> QuotaServiceDouble:
        self._sub = await nc.subscribe(bus.QUOTA_RESERVE, cb=self._answer)
        return self

    async def stop(self) -> None:
        await self._sub.unsubscribe()

    async def _answer(self, msg: Any) -> None:
        request = decode(msg.data, QuotaRequest)
        self.requests.append(request)
        if self.silent:
            return
        memory, cores, gpus = self.limits.get(request.namespace, (None, None, None))
        over = [
            f"{what} {asked} > limit {limit}"
            for what, asked, limit in (
                ("gpumem MiB", request.memory_mib, memory),
                ("gpucores", request.cores, cores),
                ("GPUs", request.gpus, gpus),
            )
            if limit is not None and asked > limit
        ]
        reply = QuotaReply(ok=not over, reason=", ".join(over))
        await msg.respond(encode(reply))
