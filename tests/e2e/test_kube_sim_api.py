"""kube-sim's API server through the real Kubernetes adapter (the path every service takes), and
the pure parts of its admission and scheduler clients. No stack: one in-process server."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from tessera.kube_sim.admission import apply_review_response
from tessera.kube_sim.apiserver import ApiServer, merge_patch
from tessera.kube_sim.kubeconfig import write_kubeconfig
from tessera.kube_sim.scheduler import unschedulable_message
from tessera.kube_sim.store import ObjectStore, StoreError

from tessera.cluster.kubernetes_api import KubeClientSettings, KubernetesCluster
from tessera.cluster.port import ConflictError, NotFoundError, ObjectRef
from tessera.embedded_http import EmbeddedUvicorn
from tessera_cli.nats_embedded import free_port

pytestmark = pytest.mark.timeout(60)


class Server:
    def __init__(self, api: ApiServer, url: str, cluster: KubernetesCluster) -> None:
        self.api = api
        self.url = url
        self.cluster = cluster
        self.http = httpx.AsyncClient(base_url=url)

    async def create_pod(self, name: str, namespace: str = "default", **spec: Any) -> dict:
        pod = {
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "x"}], **spec},
        }
        reply = await self.http.post(f"/api/v1/namespaces/{namespace}/pods", json=pod)
        assert reply.status_code == 201, reply.text
        return reply.json()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    store = ObjectStore(history_size=50)
    for node in ("n1", "n2"):
        store.create("Node", {"metadata": {"name": node, "annotations": {}}})
    api = ApiServer(store, bookmark_interval_s=0.2)
    port = free_port()
    uv = EmbeddedUvicorn(
        uvicorn.Config(api.app(), host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    task = asyncio.create_task(uv.serve())
    while not uv.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    write_kubeconfig(tmp_path / "kubeconfig", url)
    cluster = KubernetesCluster.from_environment(
        KubeClientSettings(kubeconfig=str(tmp_path / "kubeconfig"), page_size=2)
    )
    running = Server(api, url, cluster)
    try:
        yield running
    finally:
        await running.http.aclose()
        cluster.close()
        uv.should_exit = True
        await task


async def test_bind_once_and_list_by_node(server: Server) -> None:
    pod = await server.create_pod("p1")
    await server.create_pod("p2")
    await server.create_pod("p3")
    uid = pod["metadata"]["uid"]
    with pytest.raises(ConflictError):
        await server.cluster.bind_pod("default", "p1", "not-the-uid", "n1")
    await server.cluster.bind_pod("default", "p1", uid, "n1")
    with pytest.raises(ConflictError):
        await server.cluster.bind_pod("default", "p1", uid, "n2")
    with pytest.raises(NotFoundError):
        await server.cluster.get_pod("default", "nope")
    assert [p["metadata"]["name"] for p in await server.cluster.list_pods(node_name="n1")] == ["p1"]
    # Three pods, pages of two: the adapter follows the continue token.
    assert len(await server.cluster.list_pods()) == 3
    bound = await server.cluster.get_pod("default", "p1")
    assert bound["spec"]["nodeName"] == "n1"
    assert {"type": "PodScheduled", "status": "True"}.items() <= bound["status"]["conditions"][
        0
    ].items()


async def test_watch_by_node_sees_pods_arrive_and_leave(server: Server) -> None:
    probe = await server.create_pod("probe")
    await server.cluster.bind_pod("default", "probe", probe["metadata"]["uid"], "n2")
    pod = await server.create_pod("w1")
    seen: list[tuple[str, str]] = []
    watch = server.cluster.watch_pods(node_name="n2")

    async def follow() -> None:
        async for event in watch:
            seen.append((event.type, event.object["metadata"]["name"]))

    async def until(condition: Callable[[], bool], what: str) -> None:
        deadline = asyncio.get_running_loop().time() + 20
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, f"{what}: {seen}"
            await asyncio.sleep(0.02)

    task = asyncio.create_task(follow())
    # The watch is live once it has listed the node's pod (was: a 0.3 s sleep and hope; a
    # watch that listed after the bind and patch showed w1 ADDED, then DELETED only).
    await until(lambda: ("ADDED", "probe") in seen, "the watch never listed the node's pod")
    await server.cluster.bind_pod("default", "w1", pod["metadata"]["uid"], "n2")
    await server.cluster.patch_pod_metadata("default", "w1", annotations={"a": "1"})
    await server.http.delete("/api/v1/namespaces/default/pods/w1")
    await until(lambda: ("DELETED", "w1") in seen, "w1's deletion never seen")
    task.cancel()
    assert [e for e in seen if e[1] == "w1"] == [("ADDED", "w1"), ("MODIFIED", "w1"),
                                                ("DELETED", "w1")]  # fmt: skip


async def test_merge_patch_removes_null_keys_and_keeps_identity(server: Server) -> None:
    created = await server.create_pod("m1")
    await server.cluster.patch_pod_metadata(
        "default", "m1", annotations={"a": "1", "b": "2"}, labels={"x": "y"}
    )
    patched = await server.cluster.patch_pod_metadata("default", "m1", annotations={"a": None})
    assert patched["metadata"]["annotations"] == {"b": "2"}
    assert patched["metadata"]["labels"] == {"x": "y"}
    assert patched["metadata"]["uid"] == created["metadata"]["uid"]
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None}, "d": 3}) == {
        "a": {"c": 2},
        "d": 3,
    }
    await server.cluster.patch_node_annotations("n1", {"hami.io/node-nvidia-register": "[]"})
    node = (await server.http.get("/api/v1/nodes/n1")).json()
    assert node["metadata"]["annotations"] == {"hami.io/node-nvidia-register": "[]"}


async def test_too_old_resource_version_is_410_and_the_adapter_relists(server: Server) -> None:
    for i in range(60):  # more writes than the history keeps
        await server.create_pod(f"old-{i}")
    reply = await server.http.get(
        "/api/v1/pods", params={"watch": "true", "resourceVersion": "1", "timeoutSeconds": "1"}
    )
    event = json.loads(reply.text.splitlines()[0])
    assert event["type"] == "ERROR" and event["object"]["code"] == 410
    # A version from a previous incarnation of the server (ahead of it) is also 410.
    reply = await server.http.get(
        "/api/v1/pods", params={"watch": "1", "resourceVersion": "999999", "timeoutSeconds": "1"}
    )
    assert json.loads(reply.text.splitlines()[0])["object"]["code"] == 410


async def test_events_and_bad_requests(server: Server) -> None:
    await server.cluster.record_event(ObjectRef(name="p", namespace="default"), "Tested", "hello")
    events = (await server.http.get("/api/v1/namespaces/default/events")).json()["items"]
    assert [e["reason"] for e in events] == ["Tested"]
    bad = await server.http.post("/api/v1/namespaces/default/pods", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["kind"] == "Status"
    missing = await server.http.post("/api/v1/namespaces/default/pods", json={"metadata": {}})
    assert missing.status_code == 422
    selector = await server.http.get("/api/v1/pods", params={"fieldSelector": "spec.foo=x"})
    assert selector.status_code == 400


def review_reply(
    uid: str, allowed: bool, patch: list | None = None, message: str = "", code: int = 0
) -> dict:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch is not None:
        response |= {
            "patchType": "JSONPatch",
            "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
        }
    if message:
        response["status"] = {"code": code, "message": message}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def test_webhook_patch_is_applied_and_denials_carry_the_message() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"schedulerName": "default-scheduler"}}
    patch = [{"op": "replace", "path": "/spec/schedulerName", "value": "tessera-scheduler"}]
    mutated = apply_review_response(pod, review_reply("u1", True, patch), "u1")
    assert mutated["spec"]["schedulerName"] == "tessera-scheduler"
    assert pod["spec"]["schedulerName"] == "default-scheduler", "the input is not modified"
    with pytest.raises(StoreError) as denied:
        apply_review_response(
            pod, review_reply("u1", False, message="exceeding resource quota", code=403), "u1"
        )
    assert denied.value.status == 403 and "exceeding resource quota" in denied.value.message
    with pytest.raises(StoreError) as wrong_uid:
        apply_review_response(pod, review_reply("other", True), "u1")
    assert wrong_uid.value.status == 500


def test_unschedulable_message_counts_reasons_like_kube_scheduler() -> None:
    message = unschedulable_message(
        3, {"a": "1/2 CardInsufficientMemory", "b": "1/2 CardInsufficientMemory"}
    )
    assert message == (
        "0/3 nodes are available: 2 1/2 CardInsufficientMemory, 1 node(s) were filtered out."
    )


def test_nodes_file_shapes_kube_sim_and_one_agent_per_node(tmp_path: Path) -> None:
    from tessera_cli.stack import StackPorts, default_services, load_nodes

    nodes_file = tmp_path / "nodes.yaml"
    nodes_file.write_text(
        "nodes:\n"
        "  - {name: big, gpus: 8, gpu_memory_mib: 81920, gpu_model: NVIDIA H100, numa_nodes: 2}\n"
        "  - {name: small, gpus: 1}\n"
    )
    nodes = load_nodes(nodes_file)
    specs = {s.name: s for s in default_services(nodes, tmp_path, StackPorts(1, 2, 3, 4))}
    assert next(iter(specs)) == "kube-sim", "kube-sim first: the others read its kubeconfig"
    sim_nodes = json.loads(specs["kube-sim"].env["TESSERA_KUBE_SIM_NODES"])
    assert [n["name"] for n in sim_nodes] == ["big", "small"]
    big = specs["node-agent/big"].env
    assert big["TESSERA_STATIC_GPU_COUNT"] == "8"
    assert big["TESSERA_STATIC_NUMA_NODES"] == "2"
    assert big["TESSERA_STATIC_GPU_MODEL"] == "NVIDIA H100"
    # The agent's kubelet sockets are where kube-sim's kubelet for that node listens.
    root = specs["kube-sim"].env["TESSERA_KUBE_SIM_KUBELET_ROOT"]
    assert big["TESSERA_DEVICE_PLUGIN_DIR"] == f"{root}/big/device-plugins"
    assert len(f"{root}/big/device-plugins/kubelet.sock") < 108
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {name: Not_A_Node}\n")
    with pytest.raises(ValueError):
        load_nodes(bad)
