"""The Kubernetes adapter of the cluster port, on the official `kubernetes` client.

It speaks the API server's REST paths directly through the client's `ApiClient` (so auth,
TLS, in-cluster token rotation and kubeconfig handling are the client's) and hands back the
JSON exactly as the server sent it: no generated models, which would drop fields they do not
know. Blocking client calls run in worker threads. Every request first takes a token from a
QPS/burst bucket (client-go's defaults are far too low for a scheduler, so ours are 50/100;
events take theirs from a bucket of their own, as kube-scheduler's event client does), and
429, 5xx and connection failures are retried with jittered exponential backoff, honouring
`Retry-After`.

Watches behave like an informer's reflector: list (paginated) and replay it as ADDED, then
watch from the list's resourceVersion with bookmarks; a stream that ends is resumed from the
last resourceVersion seen; a 410 Gone (as an HTTP status or as an ERROR event in the stream)
relists, and objects that vanished while we were not watching come out as DELETED.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import quote

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tessera.cluster.port import (
    ClusterError,
    ConflictError,
    DisruptionRefusedError,
    KubeObject,
    NotFoundError,
    ObjectRef,
    WatchEvent,
    WebhookKind,
)
from tessera.cluster.resources_port import KubernetesResources
from tessera.cluster.slim_pods import Listed, Need, SlimReader, decode_pod_page

log = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
EVENT_MESSAGE_LIMIT = 1024

Sleep = Callable[[float], Awaitable[None]]


class KubeClientSettings(BaseSettings):
    """How the adapter uses the API server (`TESSERA_KUBE_*`)."""

    model_config = SettingsConfigDict(
        env_prefix="TESSERA_KUBE_", extra="ignore", populate_by_name=True
    )

    qps: float = Field(50.0, ge=0, description="sustained requests per second (0: unlimited)")
    burst: int = Field(100, ge=1, description="requests allowed at once above qps")
    max_attempts: int = Field(6, ge=1, description="tries per request on 429/5xx/network errors")
    backoff_initial_s: float = Field(0.2, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    watch_timeout_s: int = Field(300, ge=1, description="server-side timeout of one watch call")
    page_size: int = Field(500, ge=1, description="items per list page")
    kubeconfig: str | None = Field(
        None,
        validation_alias="TESSERA_KUBECONFIG",
        description="kubeconfig path (default: in-cluster config, else $KUBECONFIG)",
    )
    context: str | None = None
    component: str = Field("tessera", description="event source component")


class TokenBucket:
    """Client-side rate limit: `qps` tokens a second, at most `burst` saved up."""

    def __init__(
        self,
        qps: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._qps = qps
        self._burst = float(burst)
        self._tokens = float(burst)
        self._clock = clock
        self._sleep = sleep
        self._updated = clock()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        if self._qps <= 0:
            return
        # The lock makes waiters take tokens in arrival order instead of racing for each refill.
        async with self._lock:
            while True:
                now = self._clock()
                elapsed = max(0.0, now - self._updated)
                self._tokens = min(self._burst, self._tokens + elapsed * self._qps)
                self._updated = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return
                await self._sleep((1.0 - self._tokens) / self._qps)


@dataclass
class _Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    payload: Any = None  # the decoded JSON of a successful reply
    stream: urllib3.BaseHTTPResponse | None = None


class _GoneError(ClusterError):
    """The resourceVersion or continue token is too old: start again with a fresh list."""


class _TransientError(ClusterError):
    """No usable answer (connection refused or dropped, a broken stream): worth another try."""


def _status_message(body: bytes, fallback: str) -> str:
    try:
        status = json.loads(body)
    except ValueError:
        return fallback
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return fallback


def _error_for(status: int, message: str) -> ClusterError:
    if status == 404:
        return NotFoundError(message, status)
    if status == 409:
        return ConflictError(message, status)
    if status == 410:
        return _GoneError(message, status)
    return ClusterError(message, status)


def _is_transient(error: ClusterError) -> bool:
    return isinstance(error, _TransientError) or error.status in RETRYABLE_STATUSES


def _retry_after(headers: dict[str, str]) -> float | None:
    value = headers.get("Retry-After") or headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _object_key(obj: KubeObject) -> str:
    meta = obj.get("metadata", {})
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _resource_version(obj: KubeObject) -> str | None:
    version = obj.get("metadata", {}).get("resourceVersion")
    return str(version) if version else None


def _quote(segment: str) -> str:
    return quote(segment, safe="")


def _split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Complete lines of a chunked watch body (a JSON event may span chunks)."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        yield from (line for line in lines if line.strip())
    if pending.strip():
        yield pending


class KubernetesCluster(KubernetesResources):
    """`ClusterPort` (and `ResourcePort`: resources_port.py) on a real API server."""

    def __init__(
        self,
        api_client: k8s_client.ApiClient,
        settings: KubeClientSettings | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self._api = api_client
        self._settings = settings or KubeClientSettings()
        self._sleep = sleep
        self._bucket = TokenBucket(self._settings.qps, self._settings.burst, sleep=sleep)
        # Events have a bucket of their own, as kube-scheduler records them through a client
        # of their own (same qps/burst, its own limiter): a burst of events never queues the
        # writes that bind pods behind it.
        self._event_bucket = TokenBucket(self._settings.qps, self._settings.burst, sleep=sleep)

    @classmethod
    def from_environment(cls, settings: KubeClientSettings | None = None) -> KubernetesCluster:
        """In-cluster service account when running in a pod, else the kubeconfig."""
        settings = settings or KubeClientSettings()
        configuration = k8s_client.Configuration()
        if settings.kubeconfig:
            k8s_config.load_kube_config(
                config_file=settings.kubeconfig,
                context=settings.context,
                client_configuration=configuration,
            )
        else:
            try:
                k8s_config.load_incluster_config(client_configuration=configuration)
            except ConfigException:
                k8s_config.load_kube_config(
                    context=settings.context, client_configuration=configuration
                )
        return cls.from_configuration(configuration, settings)

    @classmethod
    def from_configuration(
        cls, configuration: k8s_client.Configuration, settings: KubeClientSettings | None = None
    ) -> KubernetesCluster:
        # Our retry loop decides about retries; urllib3's own would multiply them.
        configuration.retries = False
        return cls(k8s_client.ApiClient(configuration), settings)

    def close(self) -> None:
        self._api.close()

    # --- requests -----------------------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None,
        body: Any,
        content_type: str,
        timeout: float | tuple[float, float],
        stream: bool,
        decode: Callable[[bytes], Any] = json.loads,
    ) -> _Reply:
        """One HTTP exchange, in a worker thread (the client is blocking)."""
        # Serialised per attempt so a rotated service-account token is picked up.
        method, url, headers, body, _ = self._api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params={"Accept": JSON, "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._api.call_api(method, url, headers, body, _request_timeout=timeout).response
        reply_headers = dict(response.headers)
        if stream and 200 <= response.status < 300:
            return _Reply(response.status, reply_headers, b"", stream=response)
        data = response.data
        response.release_conn()
        reply = _Reply(response.status, reply_headers, data)
        if 200 <= response.status < 300 and data:
            # Decoded here, off the event loop: a big list is tens of megabytes.
            reply.payload = decode(data)
        return reply

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, self._settings.backoff_max_s)
        ceiling = min(
            self._settings.backoff_max_s, self._settings.backoff_initial_s * 2 ** (attempt - 1)
        )
        return random.uniform(ceiling / 2, ceiling)

    async def _request(
        self,
        method: str,
        path: str,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = JSON,
        stream: bool = False,
        timeout: float | tuple[float, float] | None = None,
        on_retry: Callable[[], None] | None = None,
        final_statuses: frozenset[int] = frozenset(),
        decode: Callable[[bytes], Any] = json.loads,
        bucket: TokenBucket | None = None,
    ) -> _Reply:
        """A request with rate limiting (`bucket`, else the client's) and retries; raises
        ClusterError when it fails."""
        settings = self._settings
        what = f"{method} {path}"
        for attempt in range(1, settings.max_attempts + 1):
            await (bucket or self._bucket).acquire()
            retry_after: float | None = None
            try:
                reply = await asyncio.to_thread(
                    self._send,
                    method,
                    path,
                    query,
                    body,
                    content_type,
                    timeout or settings.request_timeout_s,
                    stream,
                    decode,
                )
            except ApiException as exc:  # the client's wrapper for TLS and request-shape errors
                raise ClusterError(f"{what}: {exc.reason}", exc.status or None) from exc
            except (urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                error = _TransientError(f"{what}: {exc}")
            else:
                if 200 <= reply.status < 300:
                    return reply
                message = _status_message(reply.body, f"HTTP {reply.status}")
                error = _error_for(reply.status, f"{what}: {message}")
                if not _is_transient(error) or reply.status in final_statuses:
                    raise error
                retry_after = _retry_after(reply.headers)
            if attempt == settings.max_attempts:
                raise error
            delay = self._backoff(attempt, retry_after)
            log.warning(
                "kubernetes request failed, retrying",
                extra={"request": what, "status": error.status, "attempt": attempt, "delay": delay},
            )
            if on_retry is not None:
                on_retry()
            await self._sleep(delay)
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _get_json(
        self, path: str, query: list[tuple[str, str]] | None = None,
        decode: Callable[[bytes], Any] = json.loads,
    ) -> Any:  # fmt: skip
        return (await self._request("GET", path, query, decode=decode)).payload

    # --- pods ---------------------------------------------------------------------------------

    @staticmethod
    def _pods_path(namespace: str | None) -> str:
        if namespace:
            return f"/api/v1/namespaces/{_quote(namespace)}/pods"
        return "/api/v1/pods"

    @staticmethod
    def _pod_selector(node_name: str | None) -> str | None:
        return f"spec.nodeName={node_name}" if node_name else None

    async def get_pod(self, namespace: str, name: str) -> KubeObject:
        pod: KubeObject = await self._get_json(f"{self._pods_path(namespace)}/{_quote(name)}")
        return pod

    async def list_pods(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> list[KubeObject]:
        items, _ = await self._list_all(
            self._pods_path(namespace), self._pod_selector(node_name), "Pod"
        )
        return items

    async def list_pods_slim(self, need: Need | None = None) -> Listed:
        """Every pod, holding only the fields `tessera.cluster.slim_pods` keeps (no kind or
        apiVersion either), those `need` does not want left out undecoded; page by page."""
        reader = SlimReader(need)
        items, _ = await self._list_all(
            self._pods_path(None), None, "Pod", decode_pod_page, reader
        )
        return Listed(items, reader.skipped)

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str | None] | None = None,
        labels: dict[str, str | None] | None = None,
    ) -> KubeObject:
        metadata: dict[str, Any] = {}
        if annotations:
            metadata["annotations"] = annotations
        if labels:
            metadata["labels"] = labels
        path = f"{self._pods_path(namespace)}/{_quote(name)}"
        if not metadata:
            return await self.get_pod(namespace, name)
        # A merge patch (not strategic): a null value deletes exactly that key.
        reply = await self._request(
            "PATCH", path, body={"metadata": metadata}, content_type=MERGE_PATCH
        )
        pod: KubeObject = reply.payload
        return pod

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            # The uid makes the server refuse to bind a pod recreated under the same name.
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        retried = False

        def note_retry() -> None:
            nonlocal retried
            retried = True

        path = f"{self._pods_path(namespace)}/{_quote(name)}/binding"
        try:
            await self._request("POST", path, body=binding, on_retry=note_retry)
        except ConflictError:
            # After a lost reply the first POST may have bound it: that is our success.
            if retried and await self._bound_to(namespace, name, uid, node):
                return
            raise

    async def _bound_to(self, namespace: str, name: str, uid: str, node: str) -> bool:
        try:
            pod = await self.get_pod(namespace, name)
        except ClusterError:
            return False
        return (
            pod.get("metadata", {}).get("uid") == uid
            and pod.get("spec", {}).get("nodeName") == node
        )

    def watch_pods(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> AsyncIterator[WatchEvent]:
        return self._list_then_watch(
            self._pods_path(namespace), self._pod_selector(node_name), "Pod"
        )

    def watch_pods_marked(
        self, namespace: str | None = None, node_name: str | None = None
    ) -> AsyncIterator[WatchEvent | None]:
        """`watch_pods`, with None yielded after the ADDED events of each (re)list: from then
        on what it replayed is the cluster's pods (port.watch_pods_listed)."""
        return self._list_then_watch_marked(
            self._pods_path(namespace), self._pod_selector(node_name), "Pod"
        )

    # --- preemption: eviction, nomination, disruption budgets ---------------------------------

    async def evict_pod(
        self, namespace: str, name: str, uid: str, grace_period_s: int | None = None
    ) -> None:
        eviction: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        if grace_period_s is not None:
            eviction["deleteOptions"]["gracePeriodSeconds"] = grace_period_s
        path = f"{self._pods_path(namespace)}/{_quote(name)}/eviction"
        try:
            await self._request("POST", path, body=eviction, final_statuses=frozenset({429}))
        except ClusterError as exc:
            if exc.status == 429:  # a PodDisruptionBudget forbids it (not a rate limit here)
                raise DisruptionRefusedError(str(exc), 429) from exc
            raise

    async def set_nominated_node(self, namespace: str, name: str, node: str | None) -> None:
        await self._request(
            "PATCH",
            f"{self._pods_path(namespace)}/{_quote(name)}/status",
            body={"status": {"nominatedNodeName": node}},
            content_type=MERGE_PATCH,
        )

    async def list_disruption_budgets(self, namespace: str | None = None) -> list[KubeObject]:
        path = (
            f"/apis/policy/v1/namespaces/{_quote(namespace)}/poddisruptionbudgets"
            if namespace
            else "/apis/policy/v1/poddisruptionbudgets"
        )
        items, _ = await self._list_all(path, None, "PodDisruptionBudget")
        return items

    # --- quotas, nodes, events ----------------------------------------------------------------

    def watch_resource_quotas(self, namespace: str | None = None) -> AsyncIterator[WatchEvent]:
        path = (
            f"/api/v1/namespaces/{_quote(namespace)}/resourcequotas"
            if namespace
            else "/api/v1/resourcequotas"
        )
        return self._list_then_watch(path, None, "ResourceQuota")

    async def get_node(self, name: str) -> KubeObject:
        node: KubeObject = await self._get_json(f"/api/v1/nodes/{_quote(name)}")
        return node

    def watch_nodes(self) -> AsyncIterator[WatchEvent]:
        return self._list_then_watch("/api/v1/nodes", None, "Node")

    def watch_nodes_marked(self) -> AsyncIterator[WatchEvent | None]:
        """`watch_nodes` with None after each (re)list's ADDED events."""
        return self._list_then_watch_marked("/api/v1/nodes", None, "Node")

    async def patch_resource_quota_used(self, namespace: str, name: str,
                                        used: dict[str, str]) -> None:
        await self._request(
            "PATCH",
            f"/api/v1/namespaces/{_quote(namespace)}/resourcequotas/{_quote(name)}/status",
            body={"status": {"used": used}},
            content_type=MERGE_PATCH,
        )

    async def patch_node_annotations(self, node: str, annotations: dict[str, str | None]) -> None:
        await self._request(
            "PATCH",
            f"/api/v1/nodes/{_quote(node)}",
            body={"metadata": {"annotations": annotations}},
            content_type=MERGE_PATCH,
        )

    async def record_event(
        self,
        involved: ObjectRef,
        reason: str,
        message: str,
        event_type: Literal["Normal", "Warning"] = "Normal",
    ) -> None:
        # Events live in the object's namespace; cluster-scoped objects' go to "default".
        namespace = involved.namespace or "default"
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        component = self._settings.component
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{involved.name}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": {
                "apiVersion": involved.api_version,
                "kind": involved.kind,
                "namespace": involved.namespace,
                "name": involved.name,
                "uid": involved.uid,
            },
            "reason": reason,
            "message": message[:EVENT_MESSAGE_LIMIT],
            "type": event_type,
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self._request(
                "POST", f"/api/v1/namespaces/{_quote(namespace)}/events", body=event,
                bucket=self._event_bucket,
            )
        except ConflictError:
            return  # a retry whose first attempt landed: the event exists

    # --- config maps (per-node device configuration) ------------------------------------------

    async def get_config_map(self, namespace: str, name: str) -> KubeObject:
        path = f"/api/v1/namespaces/{_quote(namespace)}/configmaps/{_quote(name)}"
        config_map: KubeObject = await self._get_json(path)
        return config_map

    def watch_config_maps(self, namespace: str) -> AsyncIterator[WatchEvent]:
        return self._list_then_watch(
            f"/api/v1/namespaces/{_quote(namespace)}/configmaps", None, "ConfigMap"
        )

    # --- a webhook's own certificate (WebhookCertificatePort) -----------------------------------

    @staticmethod
    def _secret_path(namespace: str, name: str | None = None) -> str:
        path = f"/api/v1/namespaces/{_quote(namespace)}/secrets"
        return f"{path}/{_quote(name)}" if name else path

    @staticmethod
    def _webhook_path(kind: WebhookKind, name: str) -> str:
        resource = {"mutating": "mutatingwebhookconfigurations",
                    "validating": "validatingwebhookconfigurations"}[kind]
        return f"/apis/admissionregistration.k8s.io/v1/{resource}/{_quote(name)}"

    async def get_secret(self, namespace: str, name: str) -> KubeObject:
        secret: KubeObject = await self._get_json(self._secret_path(namespace, name))
        return secret

    async def create_secret(self, namespace: str, secret: KubeObject) -> KubeObject:
        reply = await self._request("POST", self._secret_path(namespace), body=secret)
        created: KubeObject = reply.payload
        return created

    async def replace_secret(self, namespace: str, secret: KubeObject) -> KubeObject:
        path = self._secret_path(namespace, secret["metadata"]["name"])
        replaced: KubeObject = (await self._request("PUT", path, body=secret)).payload
        return replaced

    async def get_webhook_configuration(self, kind: WebhookKind, name: str) -> KubeObject:
        config: KubeObject = await self._get_json(self._webhook_path(kind, name))
        return config

    async def replace_webhook_configuration(self, kind: WebhookKind, config: KubeObject
                                            ) -> KubeObject:
        path = self._webhook_path(kind, config["metadata"]["name"])
        replaced: KubeObject = (await self._request("PUT", path, body=config)).payload
        return replaced

    # --- list + watch -------------------------------------------------------------------------

    async def _list_all(
        self, path: str, field_selector: str | None, kind: str,
        decode: Callable[[bytes], Any] | None = None,
        reader: SlimReader | None = None,
    ) -> tuple[list[KubeObject], str]:  # fmt: skip
        """Every object, page by page; returns them with the list's resourceVersion. `decode`:
        each page's decoder (default: JSON in full, each item given the list's kind and
        apiVersion); `reader` takes its items (as they are by default; started afresh when the
        list is)."""
        while True:
            items: list[KubeObject] = []
            token: str | None = None
            if reader is not None:
                reader.skipped = 0
            try:
                while True:
                    query = [("limit", str(self._settings.page_size))]
                    if field_selector:
                        query.append(("fieldSelector", field_selector))
                    if token:
                        query.append(("continue", token))
                    page = await self._get_json(path, query, decode or json.loads)
                    listed = page.get("items") or []
                    for item in listed if decode is None else ():
                        # List items come without kind/apiVersion; watch events carry them.
                        item.setdefault("kind", kind)
                        item.setdefault("apiVersion", "v1")
                    items.extend(listed if reader is None else reader.take(listed))
                    meta = page.get("metadata", {})
                    token = meta.get("continue")
                    if not token:
                        return items, str(meta.get("resourceVersion", ""))
            except _GoneError:
                log.info("list continue token expired, listing again", extra={"path": path})

    async def _list_then_watch(
        self, path: str, field_selector: str | None, kind: str
    ) -> AsyncIterator[WatchEvent]:
        events = self._list_then_watch_marked(path, field_selector, kind)
        async with aclosing(events):
            async for event in events:
                if event is not None:
                    yield event

    async def _list_then_watch_marked(
        self, path: str, field_selector: str | None, kind: str
    ) -> AsyncIterator[WatchEvent | None]:
        """List then watch; None after each (re)list's events (the listing is replayed)."""
        known: dict[str, KubeObject] = {}
        resource_version: str | None = None
        failures = 0
        while True:
            if resource_version is None:
                items, resource_version = await self._list_all(path, field_selector, kind)
                current = {_object_key(item): item for item in items}
                for key in known.keys() - current.keys():
                    yield WatchEvent(type="DELETED", object=known[key])
                known = current
                for item in items:
                    yield WatchEvent(type="ADDED", object=item)
                yield None
            try:
                stream = self._watch_stream(path, field_selector, resource_version)
                async with aclosing(stream):
                    async for event_type, obj in stream:
                        failures = 0
                        resource_version = _resource_version(obj) or resource_version
                        if event_type == "BOOKMARK":
                            continue
                        key = _object_key(obj)
                        if event_type == "DELETED":
                            known.pop(key, None)
                        else:
                            known[key] = obj
                        yield WatchEvent(type=event_type, object=obj)
            except _GoneError:
                log.info("watch resourceVersion expired, relisting", extra={"path": path})
                resource_version = None
            except ClusterError as error:
                if not _is_transient(error):
                    raise
                failures += 1
                delay = self._backoff(min(failures, 10), None)
                log.warning(
                    "watch failed, resuming",
                    extra={"path": path, "error": str(error), "delay": delay},
                )
                await self._sleep(delay)

    async def _watch_stream(
        self, path: str, field_selector: str | None, resource_version: str
    ) -> AsyncIterator[tuple[Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK"], KubeObject]]:
        """One watch call: its events until the server ends the stream."""
        timeout_s = self._settings.watch_timeout_s
        query = [
            ("watch", "true"),
            ("resourceVersion", resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_s)),
        ]
        if field_selector:
            query.append(("fieldSelector", field_selector))
        # The read timeout outlives the server's own timeout, so a dead connection still ends.
        timeout = (self._settings.request_timeout_s, timeout_s + 30.0)
        reply = await self._request("GET", path, query, stream=True, timeout=timeout)
        response = reply.stream
        assert response is not None
        lines = _split_lines(response.stream(decode_content=True))
        try:
            while True:
                try:
                    line = await asyncio.to_thread(next, lines, None)
                except (urllib3.exceptions.HTTPError, OSError) as exc:
                    raise _TransientError(f"watch {path}: {exc}") from exc
                if line is None:
                    return
                try:
                    event = json.loads(line)
                    event_type = event["type"]
                    obj = event["object"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise _TransientError(f"watch {path}: malformed event {line[:200]!r}") from exc
                if event_type == "ERROR":
                    code = obj.get("code") if isinstance(obj, dict) else None
                    message = obj.get("message", "") if isinstance(obj, dict) else str(obj)
                    raise _error_for(int(code or 500), f"watch {path}: {message}")
                if event_type in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
                    yield event_type, obj
        finally:
            if not response.isclosed():
                # Our consumer went away mid-stream: interrupt a read still blocked in a worker
                # thread, and drop the connection rather than pool one with an unread body.
                with suppress(RuntimeError, ValueError, OSError):
                    response.shutdown()
                response.close()
