"""A scheduler extender client speaking kube-scheduler's wire format (`extender/v1`).

kube-scheduler POSTs `ExtenderArgs` to `<urlPrefix>/<verb>`; with `nodeCacheCapable: true` it
sends node names only. Filter answers `ExtenderFilterResult`, prioritize a `HostPriorityList`
(0-10, multiplied by the extender's weight), bind takes `ExtenderBindingArgs` and answers
`ExtenderBindingResult`. None of these Go structs has JSON tags (upstream
`staging/src/k8s.io/kube-scheduler/extender/v1/types.go`), so kube-scheduler writes their field
names as the keys, `{"Pod":{...},"Nodes":null,"NodeNames":[...]}` (the unused pointer as
`null`, compact, as Go's encoder writes it), and reads a reply's keys as Go's decoder does, in
any case (Tessera's replies, `"nodenames"`, `"failedNodes"`, are read so).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any

from tessera.kube_sim.http_client import HttpError, JsonPoster
from tessera.kube_sim.store import KubeObject


class ExtenderError(Exception):
    """The extender could not be called, or answered with an error."""


@dataclass
class FilterResult:
    nodes: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ExtenderConfig:
    """The `extenders[]` entry of a KubeSchedulerConfiguration, as HAMi deploys it."""

    url_prefix: str
    filter_verb: str = "filter"
    prioritize_verb: str = "prioritize"
    bind_verb: str = "bind"
    weight: int = 1
    http_timeout_s: float = 30.0
    node_cache_capable: bool = True
    managed_resources: tuple[str, ...] = ()
    # tlsConfig, as KubeSchedulerConfiguration names it: caFile verifies the extender, and
    # certFile/keyFile are the client certificate an mTLS extender demands.
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def ssl_context(self) -> ssl.SSLContext | None:
        """None for a plain http:// extender."""
        if not self.url_prefix.startswith("https://"):
            return None
        context = ssl.create_default_context(cafile=self.ca_file or None)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file or None)
        return context


def requests_managed_resource(pod: KubeObject, managed: tuple[str, ...]) -> bool:
    """kube-scheduler's IsInterested: any container (init included) names a managed resource."""
    spec = pod.get("spec") or {}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        resources = container.get("resources") or {}
        for section in ("requests", "limits"):
            if any(name in managed for name in resources.get(section) or {}):
                return True
    return False


def go_field(reply: dict[str, Any], name: str) -> Any:
    """The value of the struct field `name` as Go's JSON decoder reads it from an object: every
    key equal to the name in any case sets the field, so the last such key's value (None:
    absent, or null)."""
    folded, found = name.lower(), None
    for key, value in reply.items():
        if isinstance(key, str) and key.lower() == folded:
            found = value
    return found


class ExtenderClient:
    def __init__(self, config: ExtenderConfig) -> None:
        self.config = config
        self._client = JsonPoster(config.url_prefix, config.ssl_context(),
                                  config.http_timeout_s)  # fmt: skip

    async def close(self) -> None:
        await self._client.close()

    async def _post(self, verb: str, body: Any) -> Any:
        try:
            reply = await self._client.post(f"/{verb}", body)
        except HttpError as exc:
            raise ExtenderError(f'Post "{self.config.url_prefix}/{verb}": {exc}') from exc
        if reply.status != 200:
            raise ExtenderError(f"extender {verb}: HTTP {reply.status}: {reply.text[:300]}")
        try:
            return reply.json()
        except ValueError as exc:
            raise ExtenderError(f"extender {verb}: invalid JSON reply") from exc

    def _args(self, pod: KubeObject, nodes: list[str]) -> dict[str, Any]:
        if self.config.node_cache_capable:
            return {"Pod": pod, "Nodes": None, "NodeNames": nodes}
        node_list = {
            "kind": "NodeList",
            "apiVersion": "v1",
            "metadata": {},
            "items": [{"metadata": {"name": name}} for name in nodes],
        }
        return {"Pod": pod, "Nodes": node_list, "NodeNames": None}

    async def filter(self, pod: KubeObject, nodes: list[str]) -> FilterResult:
        result = await self._post(self.config.filter_verb, self._args(pod, nodes))
        if not isinstance(result, dict):
            raise ExtenderError("extender filter: the reply is not an ExtenderFilterResult")
        error = go_field(result, "Error")
        if error:
            raise ExtenderError(str(error))
        if self.config.node_cache_capable:
            names = go_field(result, "NodeNames") or []
        else:
            items = (go_field(result, "Nodes") or {}).get("items") or []
            names = [item.get("metadata", {}).get("name", "") for item in items]
        # The extender may only narrow the candidates down, never add nodes.
        kept = [str(name) for name in names if name in nodes]
        failed = go_field(result, "FailedNodes") or {}
        unresolvable = go_field(result, "FailedAndUnresolvableNodes") or {}
        return FilterResult(
            kept,
            {str(k): str(v) for k, v in failed.items()},
            {str(k): str(v) for k, v in unresolvable.items()},
        )

    async def prioritize(self, pod: KubeObject, nodes: list[str]) -> dict[str, int]:
        result = await self._post(self.config.prioritize_verb, self._args(pod, nodes))
        if not isinstance(result, list):
            raise ExtenderError("extender prioritize: the reply is not a HostPriorityList")
        scores: dict[str, int] = {}
        for entry in result:
            host = go_field(entry, "Host") if isinstance(entry, dict) else None
            if host in nodes:
                scores[str(host)] = int(go_field(entry, "Score") or 0) * self.config.weight
        return scores

    async def bind(self, pod: KubeObject, node: str) -> None:
        meta = pod.get("metadata", {})
        body = {
            "PodName": meta.get("name", ""),
            "PodNamespace": meta.get("namespace", ""),
            "PodUID": meta.get("uid", ""),
            "Node": node,
        }
        result = await self._post(self.config.bind_verb, body)
        error = go_field(result, "Error") if isinstance(result, dict) else None
        if error:
            raise ExtenderError(str(error))
