"""The Kubernetes adapter against a small API server that answers like kube-apiserver.

The server below serves the exact paths, verbs, content types and JSON shapes (objects, lists,
Status errors, chunked watch streams with ERROR events) the adapter uses, and records every
request so the tests can check what went over the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client as k8s_client

from tessera.cluster.kubernetes_api import KubeClientSettings, KubernetesCluster, TokenBucket
from tessera.cluster.port import (
    ClusterError,
    ClusterPort,
    ConflictError,
    NotFoundError,
    ObjectRef,
    WatchEvent,
)

pytestmark = pytest.mark.timeout(30)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A metav1.Status as the API server writes it for errors."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }


def make_pod(name: str, namespace: str = "team-a", node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "schedulerName": "tessera-scheduler",
        "containers": [
            {
                "name": "main",
                "image": "cuda:12",
                "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096"}},
            }
        ],
    }
    if node:
        spec["nodeName"] = node
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "labels": {"app": name},
            "annotations": {"keep": "me"},
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def make_quota(name: str, namespace: str, version: str) -> dict[str, Any]:
    return {
        "kind": "ResourceQuota",
        "apiVersion": "v1",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": version},
        "spec": {"hard": {"limits.nvidia.com/gpumem": "16Gi"}},
    }


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: Any


@dataclass
class Fault:
    """What to do instead of (or after) handling a matching request."""

    method: str
    path: str
    status: int = 500  # 0: close the connection without answering
    headers: dict[str, str] = field(default_factory=dict)
    after_handling: bool = False  # handle the request, then lose the reply
    with_query: str | None = None  # only requests carrying this query parameter


class FakeApiServer:
    """Enough of kube-apiserver for pods, bindings, nodes, events and resource quotas."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.quotas: list[dict[str, Any]] = []
        self.nodes: dict[str, dict[str, Any]] = {"gpu-1": {"metadata": {"annotations": {}}}}
        self.events: list[dict[str, Any]] = []
        self.resource_version = 100
        self.requests: list[Recorded] = []
        self.faults: deque[Fault] = deque()
        # Each watch call takes the next script: a list of event dicts to stream (then the
        # stream ends), or an int to answer with that HTTP status. With none left it holds the
        # stream open until the test ends, like an idle watch.
        self.watch_scripts: deque[list[dict[str, Any]] | int] = deque()
        self.stopping = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    def add_pod(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.resource_version += 1
            pod["metadata"]["resourceVersion"] = str(self.resource_version)
            self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod

    def calls(self, method: str, path: str) -> list[Recorded]:
        return [r for r in self.requests if r.method == method and r.path == path]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                record = Recorded(self.command, parts.path, query, dict(self.headers), body)
                server.requests.append(record)
                fault = server._take_fault(self.command, parts.path, query)
                if fault and not fault.after_handling:
                    self._fail(fault)
                    return
                code, payload = server.route(record)
                if fault:
                    self._fail(fault)
                    return
                if isinstance(payload, Iterator):
                    self._stream(payload)
                else:
                    self._send_json(code, payload)

            do_GET = do_POST = do_PATCH = _serve

            def _fail(self, fault: Fault) -> None:
                if fault.status == 0:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                payload = status(fault.status, "Fault", "injected")
                self._send_json(fault.status, payload, fault.headers)

            def _send_json(
                self, code: int, payload: Any, headers: dict[str, str] | None = None
            ) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, events: Iterator[dict[str, Any]]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for event in events:
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

        return Handler

    def _take_fault(self, method: str, path: str, query: dict[str, str]) -> Fault | None:
        with self.lock:
            for fault in list(self.faults):
                if fault.with_query and fault.with_query not in query:
                    continue
                if fault.method == method and fault.path == path:
                    self.faults.remove(fault)
                    return fault
        return None

    def route(self, req: Recorded) -> tuple[int, Any]:
        parts = req.path.strip("/").split("/")
        with self.lock:
            if parts[-1] == "pods" or parts[-1] == "resourcequotas":
                namespace = parts[3] if len(parts) == 5 else None
                if req.query.get("watch") == "true":
                    return self._watch()
                return self._list(parts[-1], namespace, req.query)
            if parts[:3] == ["api", "v1", "namespaces"] and parts[4:5] == ["pods"]:
                return self._pod(req, parts[3], parts[5], parts[6:])
            if parts[:3] == ["api", "v1", "nodes"] and req.method == "PATCH":
                node = self.nodes[parts[3]]
                merge_patch(node, req.body)
                return 200, {"kind": "Node", "apiVersion": "v1", **node}
            if parts[-1] == "events" and req.method == "POST":
                self.events.append(req.body)
                return 201, req.body
        return 404, status(404, "NotFound", "the server could not find the requested resource")

    def _list(self, resource: str, namespace: str | None, query: dict[str, str]) -> tuple[int, Any]:
        if resource == "pods":
            objects = [copy.deepcopy(p) for p in self.pods.values()]
            selector = query.get("fieldSelector", "")
            if selector.startswith("spec.nodeName="):
                node = selector.split("=", 1)[1]
                objects = [p for p in objects if p["spec"].get("nodeName") == node]
        else:
            objects = copy.deepcopy(self.quotas)
        if namespace:
            objects = [o for o in objects if o["metadata"]["namespace"] == namespace]
        for obj in objects:  # list items carry no kind/apiVersion on the wire
            obj.pop("kind", None)
            obj.pop("apiVersion", None)
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or len(objects) or 1)
        page = objects[start : start + limit]
        metadata: dict[str, Any] = {"resourceVersion": str(self.resource_version)}
        if start + limit < len(objects):
            metadata["continue"] = str(start + limit)
        kind = "PodList" if resource == "pods" else "ResourceQuotaList"
        return 200, {"kind": kind, "apiVersion": "v1", "metadata": metadata, "items": page}

    def _watch(self) -> tuple[int, Any]:
        if self.watch_scripts:
            script = self.watch_scripts.popleft()
            if isinstance(script, int):
                return script, status(script, "Expired", "too old resource version")
            return 200, iter(script)

        def idle() -> Iterator[dict[str, Any]]:
            self.stopping.wait(20)
            yield from ()

        return 200, idle()

    def _pod(self, req: Recorded, namespace: str, name: str, sub: list[str]) -> tuple[int, Any]:
        pod = self.pods.get((namespace, name))
        if pod is None:
            return 404, status(404, "NotFound", f'pods "{name}" not found')
        if sub == ["binding"] and req.method == "POST":
            if req.body["metadata"].get("uid") not in (None, pod["metadata"]["uid"]):
                return 409, status(409, "Conflict", "Precondition failed: UID mismatch")
            if pod["spec"].get("nodeName"):
                message = f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"'
                return 409, status(409, "Conflict", message)
            pod["spec"]["nodeName"] = req.body["target"]["name"]
            self.resource_version += 1
            pod["metadata"]["resourceVersion"] = str(self.resource_version)
            return 201, {**status(201, "", ""), "status": "Success"}
        if not sub and req.method == "GET":
            return 200, copy.deepcopy(pod)
        if not sub and req.method == "PATCH":
            if req.headers.get("Content-Type") != "application/merge-patch+json":
                return 415, status(415, "UnsupportedMediaType", "unexpected patch type")
            merge_patch(pod, req.body)
            self.resource_version += 1
            pod["metadata"]["resourceVersion"] = str(self.resource_version)
            return 200, copy.deepcopy(pod)
        return 405, status(405, "MethodNotAllowed", "method not allowed")


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386, as the API server applies application/merge-patch+json."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            child = target.get(key)
            if not isinstance(child, dict):
                child = target[key] = {}
            merge_patch(child, value)
        else:
            target[key] = value


def watch_event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


GONE = watch_event("ERROR", status(410, "Expired", "too old resource version: 100 (150)"))


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.start()
    yield server
    server.stop()


@dataclass
class Sleeps:
    """Records backoff delays instead of waiting them out."""

    delays: list[float] = field(default_factory=list)

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
def make_cluster(
    apiserver: FakeApiServer, sleeps: Sleeps
) -> Iterator[Callable[..., KubernetesCluster]]:
    made: list[KubernetesCluster] = []

    def make(**overrides: Any) -> KubernetesCluster:
        configuration = k8s_client.Configuration(host=apiserver.url)
        configuration.retries = False
        settings = KubeClientSettings(
            **{"request_timeout_s": 5.0, "watch_timeout_s": 20, **overrides}
        )
        cluster = KubernetesCluster(k8s_client.ApiClient(configuration), settings, sleep=sleeps)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture
def cluster(make_cluster: Callable[..., KubernetesCluster]) -> KubernetesCluster:
    return make_cluster()


async def take(events: AsyncIterator[WatchEvent], count: int) -> list[tuple[str, str]]:
    """The next `count` events as (type, name), with a deadline so a hang fails the test."""
    seen = []
    for _ in range(count):
        event = await asyncio.wait_for(anext(events), 5)
        seen.append((event.type, event.object["metadata"]["name"]))
    return seen


# --- plain calls ------------------------------------------------------------------------------


def test_adapter_implements_the_cluster_port(cluster: KubernetesCluster) -> None:
    assert isinstance(cluster, ClusterPort)


async def test_get_pod_returns_the_servers_json(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("trainer"))
    pod = await cluster.get_pod("team-a", "trainer")
    assert pod["metadata"]["uid"] == "uid-trainer"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] == "4096"
    with pytest.raises(NotFoundError):
        await cluster.get_pod("team-a", "missing")


async def test_list_pods_pages_and_filters_by_node(
    apiserver: FakeApiServer, make_cluster: Callable[..., KubernetesCluster]
) -> None:
    for index in range(5):
        apiserver.add_pod(make_pod(f"p{index}", node="gpu-1" if index % 2 == 0 else "gpu-2"))
    cluster = make_cluster(page_size=2)

    pods = await cluster.list_pods(node_name="gpu-1")
    assert sorted(p["metadata"]["name"] for p in pods) == ["p0", "p2", "p4"]
    assert all(p["kind"] == "Pod" and p["apiVersion"] == "v1" for p in pods)
    lists = apiserver.calls("GET", "/api/v1/pods")
    assert [r.query.get("continue") for r in lists] == [None, "2"]
    assert {r.query["fieldSelector"] for r in lists} == {"spec.nodeName=gpu-1"}

    assert len(await cluster.list_pods(namespace="team-a")) == 5
    assert apiserver.calls("GET", "/api/v1/namespaces/team-a/pods")


async def test_list_pods_slim_pages_keeps_only_the_fields_read_and_skips_undecoded(
    apiserver: FakeApiServer, make_cluster: Callable[..., KubernetesCluster]
) -> None:
    for index in range(5):
        apiserver.add_pod(make_pod(f"p{index}", node="gpu-1"))
    cluster = make_cluster(page_size=2)
    asked: list[list[Any]] = []

    def need(uids: list[Any], schedulers: list[Any]) -> list[bool]:
        asked.append(list(zip(uids, schedulers, strict=True)))
        return [uid not in ("uid-p1", "uid-p4") for uid in uids]

    listed = await cluster.list_pods_slim(need)
    assert listed.skipped == 2 and [p["metadata"]["name"] for p in listed.pods] == [
        "p0", "p2", "p3"]  # fmt: skip
    assert [len(keys) for keys in asked] == [2, 2, 1]  # page by page
    assert asked[0][0] == ("uid-p0", "tessera-scheduler")
    version = listed.pods[0]["metadata"]["resourceVersion"]  # the fake server's own
    assert listed.pods[0] == {
        "metadata": {"name": "p0", "namespace": "team-a", "uid": "uid-p0",
                     "resourceVersion": version, "annotations": {}},
        "spec": {"schedulerName": "tessera-scheduler", "nodeName": "gpu-1", "containers": [
            {"name": "main", "resources": {"limits": {"nvidia.com/gpu": "1",
                                                      "nvidia.com/gpumem": "4096"}}}]},
        "status": {"phase": "Pending"},
    }  # fmt: skip
    assert [r.query.get("continue") for r in apiserver.calls("GET", "/api/v1/pods")] == [
        None, "2", "4"]  # fmt: skip
    everything = await cluster.list_pods_slim()
    assert everything.skipped == 0 and len(everything.pods) == 5


async def test_patch_metadata_is_a_merge_patch_and_none_removes_a_key(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("trainer"))
    pod = await cluster.patch_pod_metadata(
        "team-a",
        "trainer",
        annotations={"hami.io/vgpu-node": "gpu-1", "keep": None},
        labels={"tessera.io/state": "bound"},
    )
    assert pod["metadata"]["annotations"] == {"hami.io/vgpu-node": "gpu-1"}
    assert pod["metadata"]["labels"] == {"app": "trainer", "tessera.io/state": "bound"}
    (patch,) = apiserver.calls("PATCH", "/api/v1/namespaces/team-a/pods/trainer")
    assert patch.headers["Content-Type"] == "application/merge-patch+json"
    assert patch.body == {
        "metadata": {
            "annotations": {"hami.io/vgpu-node": "gpu-1", "keep": None},
            "labels": {"tessera.io/state": "bound"},
        }
    }


async def test_bind_posts_a_binding_with_the_pod_uid(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("trainer"))
    await cluster.bind_pod("team-a", "trainer", "uid-trainer", "gpu-1")
    (post,) = apiserver.calls("POST", "/api/v1/namespaces/team-a/pods/trainer/binding")
    assert post.body == {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": "trainer", "namespace": "team-a", "uid": "uid-trainer"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-1"},
    }
    assert apiserver.pods[("team-a", "trainer")]["spec"]["nodeName"] == "gpu-1"
    with pytest.raises(ConflictError, match="already assigned"):
        await cluster.bind_pod("team-a", "trainer", "uid-trainer", "gpu-2")


async def test_bind_whose_reply_was_lost_succeeds_on_retry(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("trainer"))
    path = "/api/v1/namespaces/team-a/pods/trainer/binding"
    apiserver.faults.append(Fault("POST", path, status=0, after_handling=True))
    await cluster.bind_pod("team-a", "trainer", "uid-trainer", "gpu-1")
    # The retry met "already assigned"; the adapter saw it was bound to our node by us.
    assert len(apiserver.calls("POST", path)) == 2
    assert apiserver.pods[("team-a", "trainer")]["spec"]["nodeName"] == "gpu-1"


async def test_node_annotations_and_events(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    await cluster.patch_node_annotations("gpu-1", {"tessera.io/handshake": "ok", "old": None})
    (patch,) = apiserver.calls("PATCH", "/api/v1/nodes/gpu-1")
    assert patch.headers["Content-Type"] == "application/merge-patch+json"
    assert patch.body == {"metadata": {"annotations": {"tessera.io/handshake": "ok", "old": None}}}

    pod = ObjectRef(namespace="team-a", name="trainer", uid="uid-trainer")
    await cluster.record_event(pod, "FilteringFailed", "x" * 5000, "Warning")
    await cluster.record_event(ObjectRef(kind="Node", name="gpu-1"), "Registered", "4 GPUs")
    pod_event, node_event = apiserver.events
    assert pod_event["metadata"]["namespace"] == "team-a"
    assert pod_event["metadata"]["name"].startswith("trainer.")
    assert pod_event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "team-a",
        "name": "trainer",
        "uid": "uid-trainer",
    }
    assert pod_event["type"] == "Warning" and pod_event["reason"] == "FilteringFailed"
    assert len(pod_event["message"]) == 1024
    assert pod_event["count"] == 1 and pod_event["source"] == {"component": "tessera"}
    assert node_event["metadata"]["namespace"] == "default"
    assert apiserver.calls("POST", "/api/v1/namespaces/default/events")


async def test_events_never_hold_up_a_bind(
    apiserver: FakeApiServer, make_cluster: Callable[..., KubernetesCluster]
) -> None:
    """Events take tokens from a bucket of their own (kube-scheduler records events through a
    client of its own): a pod's bind goes through while events wait for theirs."""
    cluster = make_cluster(qps=0.001, burst=1)
    apiserver.add_pod(make_pod("trainer"))
    pod = ObjectRef(namespace="team-a", name="trainer", uid="uid-trainer")
    await cluster.record_event(pod, "FilteringSucceed", "1 node(s) fit the GPU request")
    waiting = asyncio.create_task(cluster.record_event(pod, "BindingSucceed", "bound"))
    try:
        await asyncio.wait_for(cluster.bind_pod("team-a", "trainer", "uid-trainer", "gpu-1"), 10)
        assert apiserver.pods[("team-a", "trainer")]["spec"]["nodeName"] == "gpu-1"
        assert not waiting.done()  # the second event still waits for its bucket
    finally:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
    assert len(apiserver.events) == 1


def three_pods_in_pages_of_two_whose_token_expires(
    apiserver: FakeApiServer, make_cluster: Callable[..., KubernetesCluster]
) -> KubernetesCluster:
    """Three pods listed two a page; the second page's continue token answers 410 once."""
    for name in ("p0", "p1", "p2"):
        apiserver.add_pod(make_pod(name))
    apiserver.faults.append(Fault("GET", "/api/v1/pods", 410, with_query="continue"))
    return make_cluster(page_size=2)


async def test_list_restarts_when_its_continue_token_expires(
    apiserver: FakeApiServer, make_cluster: Callable[..., KubernetesCluster]
) -> None:
    cluster = three_pods_in_pages_of_two_whose_token_expires(apiserver, make_cluster)
    pods = await cluster.list_pods()
    assert sorted(p["metadata"]["name"] for p in pods) == ["p0", "p1", "p2"]  # no duplicates
    pages = [r.query.get("continue") for r in apiserver.calls("GET", "/api/v1/pods")]
    assert pages == [None, "2", None, "2"]


async def test_slim_list_restarted_after_an_expired_token_counts_each_pod_once(
    apiserver: FakeApiServer, make_cluster: Callable[..., KubernetesCluster]
) -> None:
    cluster = three_pods_in_pages_of_two_whose_token_expires(apiserver, make_cluster)
    listed = await cluster.list_pods_slim(lambda uids, _s: [uid == "uid-p2" for uid in uids])
    assert [p["metadata"]["name"] for p in listed.pods] == ["p2"] and listed.skipped == 2


def test_from_environment_uses_the_kubeconfig_and_its_token(
    apiserver: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "sim", "cluster": {"server": apiserver.url}}],
                "users": [{"name": "tessera", "user": {"token": "s3cret"}}],
                "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "tessera"}}],
                "current-context": "sim",
            }
        )
    )
    monkeypatch.setenv("TESSERA_KUBECONFIG", str(kubeconfig))
    apiserver.add_pod(make_pod("trainer"))
    cluster = KubernetesCluster.from_environment()
    try:
        pod = asyncio.run(cluster.get_pod("team-a", "trainer"))
    finally:
        cluster.close()
    assert pod["metadata"]["name"] == "trainer"
    (request,) = apiserver.calls("GET", "/api/v1/namespaces/team-a/pods/trainer")
    headers = {name.lower(): value for name, value in request.headers.items()}
    assert headers["authorization"] == "Bearer s3cret"


# --- retries ----------------------------------------------------------------------------------


async def test_retries_5xx_and_429_honouring_retry_after(
    apiserver: FakeApiServer, cluster: KubernetesCluster, sleeps: Sleeps
) -> None:
    apiserver.add_pod(make_pod("trainer"))
    path = "/api/v1/namespaces/team-a/pods/trainer"
    apiserver.faults.extend(
        [
            Fault("GET", path, 500),
            Fault("GET", path, 429, headers={"Retry-After": "3"}),
            Fault("GET", path, 503),
        ]
    )
    pod = await cluster.get_pod("team-a", "trainer")
    assert pod["metadata"]["name"] == "trainer"
    assert len(apiserver.calls("GET", path)) == 4
    assert len(sleeps.delays) == 3
    assert sleeps.delays[1] == 3.0  # the server's Retry-After, not our own backoff
    assert 0 < sleeps.delays[0] <= 0.2 and 0 < sleeps.delays[2] <= 0.8


async def test_connection_failures_are_retried(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("trainer"))
    path = "/api/v1/namespaces/team-a/pods/trainer"
    apiserver.faults.append(Fault("PATCH", path, status=0))
    pod = await cluster.patch_pod_metadata("team-a", "trainer", annotations={"a": "b"})
    assert pod["metadata"]["annotations"]["a"] == "b"
    assert len(apiserver.calls("PATCH", path)) == 2


async def test_gives_up_after_max_attempts_and_never_retries_client_errors(
    apiserver: FakeApiServer, make_cluster: Callable[..., KubernetesCluster]
) -> None:
    cluster = make_cluster(max_attempts=3)
    apiserver.add_pod(make_pod("trainer"))
    path = "/api/v1/namespaces/team-a/pods/trainer"
    apiserver.faults.extend(Fault("GET", path, 503) for _ in range(5))
    with pytest.raises(ClusterError) as failure:
        await cluster.get_pod("team-a", "trainer")
    assert failure.value.status == 503
    assert len(apiserver.calls("GET", path)) == 3

    apiserver.faults.clear()
    apiserver.faults.append(Fault("GET", path, 403))
    with pytest.raises(ClusterError) as forbidden:
        await cluster.get_pod("team-a", "trainer")
    assert forbidden.value.status == 403
    assert len(apiserver.calls("GET", path)) == 4


# --- watches ----------------------------------------------------------------------------------


async def test_watch_lists_then_streams_and_relists_after_410_gone(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("a"))
    apiserver.add_pod(make_pod("b"))
    list_version = str(apiserver.resource_version)
    modified = make_pod("a")
    modified["metadata"]["resourceVersion"] = "150"
    apiserver.watch_scripts.append([watch_event("MODIFIED", modified), GONE])
    apiserver.watch_scripts.append([watch_event("MODIFIED", make_pod("c"))])

    events = cluster.watch_pods(namespace="team-a")
    assert await take(events, 3) == [("ADDED", "a"), ("ADDED", "b"), ("MODIFIED", "a")]

    # While the watch is broken, b goes away and c arrives: the relist must show both.
    with apiserver.lock:
        del apiserver.pods[("team-a", "b")]
    apiserver.add_pod(make_pod("c"))
    relist_version = str(apiserver.resource_version)
    assert await take(events, 3) == [("DELETED", "b"), ("ADDED", "a"), ("ADDED", "c")]
    assert await take(events, 1) == [("MODIFIED", "c")]

    path = "/api/v1/namespaces/team-a/pods"
    lists = [r for r in apiserver.calls("GET", path) if "watch" not in r.query]
    watches = [r for r in apiserver.calls("GET", path) if "watch" in r.query]
    assert len(lists) == 2
    assert [w.query["resourceVersion"] for w in watches] == [list_version, relist_version]
    assert watches[0].query["allowWatchBookmarks"] == "true"
    await events.aclose()


async def test_marked_pod_watch_says_when_each_listing_is_replayed(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("a"))
    apiserver.add_pod(make_pod("b"))
    modified = make_pod("a")
    modified["metadata"]["resourceVersion"] = "150"
    apiserver.watch_scripts.append([watch_event("MODIFIED", modified), GONE])
    apiserver.watch_scripts.append([watch_event("MODIFIED", make_pod("c"))])

    events = cluster.watch_pods_marked(namespace="team-a")

    async def marked(count: int) -> list[tuple[str, str] | None]:
        seen: list[tuple[str, str] | None] = []
        for _ in range(count):
            event = await asyncio.wait_for(anext(events), 5)
            seen.append(None if event is None else (event.type, event.object["metadata"]["name"]))
        return seen

    assert await marked(4) == [("ADDED", "a"), ("ADDED", "b"), None, ("MODIFIED", "a")]
    with apiserver.lock:
        del apiserver.pods[("team-a", "b")]
    apiserver.add_pod(make_pod("c"))
    assert await marked(5) == [("DELETED", "b"), ("ADDED", "a"), ("ADDED", "c"), None,
                               ("MODIFIED", "c")]  # fmt: skip
    await events.aclose()


async def test_watch_resumes_from_last_version_and_relists_on_http_410(
    apiserver: FakeApiServer, cluster: KubernetesCluster
) -> None:
    apiserver.add_pod(make_pod("a", node="gpu-1"))
    added = make_pod("d", node="gpu-1")
    added["metadata"]["resourceVersion"] = "160"
    bookmark = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": "170"}}
    deleted = make_pod("a", node="gpu-1")
    deleted["metadata"]["resourceVersion"] = "180"
    apiserver.watch_scripts.extend(
        [
            [watch_event("ADDED", added), watch_event("BOOKMARK", bookmark)],  # then it ends
            410,  # the bookmark's version has been compacted away meanwhile
            [watch_event("DELETED", deleted)],
        ]
    )
    events = cluster.watch_pods(node_name="gpu-1")
    assert await take(events, 2) == [("ADDED", "a"), ("ADDED", "d")]
    # d only ever lived in the lost stretch of history: the relist finds it gone. a is
    # replayed as ADDED, then the watch after the relist deletes it.
    assert await take(events, 3) == [("DELETED", "d"), ("ADDED", "a"), ("DELETED", "a")]

    watches = [r for r in apiserver.calls("GET", "/api/v1/pods") if "watch" in r.query]
    assert [w.query["resourceVersion"] for w in watches][:2] == ["101", "170"]
    assert {w.query["fieldSelector"] for w in watches} == {"spec.nodeName=gpu-1"}
    lists = [r for r in apiserver.calls("GET", "/api/v1/pods") if "watch" not in r.query]
    assert len(lists) == 2
    await events.aclose()


async def test_watch_rides_out_server_errors(
    apiserver: FakeApiServer, cluster: KubernetesCluster, sleeps: Sleeps
) -> None:
    apiserver.quotas.append(make_quota("gpu", "team-a", "90"))
    path = "/api/v1/namespaces/team-a/resourcequotas"
    changed = make_quota("gpu", "team-a", "120")
    error_event = watch_event("ERROR", status(500, "InternalError", "etcd leader changed"))
    apiserver.watch_scripts.extend([[error_event], [watch_event("MODIFIED", changed)]])
    apiserver.faults.append(Fault("GET", path, 503))  # the first list

    events = cluster.watch_resource_quotas("team-a")
    first = await asyncio.wait_for(anext(events), 5)
    assert first.type == "ADDED" and first.object["kind"] == "ResourceQuota"
    second = await asyncio.wait_for(anext(events), 5)
    assert second.type == "MODIFIED"
    assert second.object["metadata"]["resourceVersion"] == "120"
    calls = apiserver.calls("GET", path)
    assert len([r for r in calls if "watch" not in r.query]) == 2  # 503, then the list
    # A 500 inside the stream is not a 410: resume from the same version, no relist.
    assert [r.query["resourceVersion"] for r in calls if "watch" in r.query] == ["100", "100"]
    assert len(sleeps.delays) == 2
    await events.aclose()


# --- rate limit -------------------------------------------------------------------------------


async def test_token_bucket_allows_a_burst_then_holds_to_qps() -> None:
    now = [0.0]

    async def advance(delay: float) -> None:
        now[0] += delay

    bucket = TokenBucket(qps=10, burst=3, clock=lambda: now[0], sleep=advance)
    for _ in range(3):
        await bucket.acquire()
    assert now[0] == 0.0  # the burst goes at once
    for _ in range(5):
        await bucket.acquire()
    assert now[0] == pytest.approx(0.5)  # then 10 a second


def test_default_client_limits_are_scheduler_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = KubeClientSettings()
    assert (settings.qps, settings.burst) == (50, 100)
    monkeypatch.setenv("TESSERA_KUBE_QPS", "200")
    monkeypatch.setenv("TESSERA_KUBE_BURST", "400")
    monkeypatch.setenv("TESSERA_KUBECONFIG", "/etc/kube/config")
    settings = KubeClientSettings()
    assert (settings.qps, settings.burst, settings.kubeconfig) == (200, 400, "/etc/kube/config")
