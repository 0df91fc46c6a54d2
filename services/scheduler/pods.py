"""What the engine reads from a pod object: its identity, request, options and container names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera import hami
from tessera.hami import PodRequest
from tessera.models import Allocation, AllocationState
from tessera.settings import TesseraSettings

from .rules import PodOptions, parse_pod_options


class BadRequestError(ValueError):
    """The call itself is malformed (HTTP 400)."""


@dataclass(frozen=True)
class PodIdentity:
    uid: str
    namespace: str
    name: str

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodIdentity:
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
            raise BadRequestError("pod.metadata.name is required")
        uid = meta.get("uid") or ""
        namespace = meta.get("namespace") or "default"
        if not isinstance(uid, str) or not isinstance(namespace, str):
            raise BadRequestError("pod.metadata.uid and namespace must be strings")
        return cls(uid, namespace, meta["name"])


def parse_pod(pod: dict[str, Any], settings: TesseraSettings) -> tuple[PodRequest, PodOptions]:
    """The pod's GPU request and placement options; raises hami.RequestError."""
    return hami.parse_pod_request(pod, settings), parse_pod_options(pod, settings)


def container_names(pod: dict[str, Any]) -> list[str]:
    """Init containers first, then app containers: the order of Allocation.containers."""
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return [str(c.get("name", "")) for c in containers]


def allocation_live(allocation: Allocation, now: float) -> bool:
    """Active, and not a reservation past its expiry."""
    return allocation.active and not (
        allocation.state == AllocationState.RESERVED
        and allocation.expires_at is not None
        and allocation.expires_at <= now
    )
