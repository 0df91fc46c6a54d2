"""The rebuild before serving lists pods slim (`tessera.cluster.slim_pods`: only the fields it and
HAMi's classification read, decoded straight into them). A pure speed change: on random and
hostile pods, what every reader makes of a slim pod — HAMi's classification, the allocation
restored from its annotations, the rebuild's report, what it writes, HAMi's holdings — is
exactly what it makes of the full pod, whether the slim pod was cut in memory or decoded from
the JSON the API server sends (where a page the schema does not fit is decoded in full)."""

from __future__ import annotations

import copy
import json
import random
from functools import partial
from typing import Any

import pytest
from tessera.scheduler.foreign import ForeignCapacity
from tessera.scheduler.index import ClusterIndex
from tessera.scheduler.rebuild import LedgerRebuilder, needed

from tessera import hami
from tessera.cluster.memory import InMemoryCluster
from tessera.cluster.slim_pods import (
    Listed,
    PodPage,
    SlimReader,
    decode_pod_page,
    decode_pods,
    key_of,
    list_pods_slim,
    slim,
)
from tessera.models import NodeLedger
from tessera.restore import allocation_from_pod
from tessera.settings import TesseraSettings

from .factories import GIB, node
from .test_rebuild_placed import Store, held

NOW = 1_000.0
GRANTS = ["GPU-a-0,NVIDIA-H100,1024,10:;", "GPU-a-1,NVIDIA-H100,2048,0:;GPU-b-0,NVIDIA,5,5:;",
          ";", "", "not;a:grant", "GPU-x,T,99999999999,5:;", ",,,:;", "GPU-b-1,NVIDIA,1,1:"]
ODD: list[Any] = [None, 0, 1, -3, 2.5, True, False, "", "x", "0", [], [1], {}, {"a": 1},
                  float("nan"), 10**30, "Succeeded", "hami-scheduler", "a"]  # fmt: skip


def random_pod(rng: random.Random, i: int) -> dict[str, Any]:
    """A pod as an API server could list it (junk fields everywhere), often HAMi's, sometimes
    with a value of the wrong kind anywhere."""
    containers = [{"name": f"c{j}", "image": "cuda", "env": [{"name": "A", "value": "b"}],
                   "resources": rng.choice([{}, {"limits": {"nvidia.com/gpu": 1}},
                                            {"requests": {"nvidia.com/gpumem": "3000"}},
                                            {"limits": {"cpu": "1"}}]),
                   **({"restartPolicy": "Always"} if rng.random() < 0.2 else {})}
                  for j in range(rng.randint(0, 3))]  # fmt: skip
    annotations: dict[str, Any] = {"kubectl.kubernetes.io/last-applied-configuration": "{}" * 50}
    for key in (hami.ANN_DEVICES_ALLOCATED, hami.ANN_DEVICES_TO_ALLOCATE):
        if rng.random() < 0.6:
            annotations[key] = rng.choice(GRANTS)
    if rng.random() < 0.8:
        annotations[hami.ANN_VGPU_NODE] = rng.choice(["a", "b", ""])
    if rng.random() < 0.8:
        annotations[hami.ANN_BIND_PHASE] = rng.choice(["success", "allocating", "failed"])
    spec: dict[str, Any] = {"containers": containers, "volumes": [{"name": "v"}],
                            "nodeName": rng.choice(["a", "b", "", None])}  # fmt: skip
    if rng.random() < 0.5:
        spec["schedulerName"] = rng.choice(["hami-scheduler", "tessera-scheduler", ""])
    status: dict[str, Any] = {"phase": rng.choice(["Running", "Pending", "Succeeded", "Failed"]),
                              "conditions": [{"type": "Ready"}]}  # fmt: skip
    if rng.random() < 0.4:
        spec["initContainers"] = [{"name": "init", "image": "x", "resources": {}}]
        code = rng.choice([0, 0, 1, None])
        status["initContainerStatuses"] = [{"name": "init", "image": "x", "state": (
            {"terminated": {"exitCode": code, "reason": "Completed"}} if code is not None
            else {"running": {}})}]  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"p{i}", "namespace": rng.choice(["default", "team"]),
                        "uid": f"uid-p{rng.randint(0, 40)}", "resourceVersion": str(i),
                        "labels": {"app": "x"}, "managedFields": [{"manager": "kubelet"}],
                        "annotations": annotations},
           "spec": spec, "status": status}  # fmt: skip
    for _ in range(rng.choice([0, 0, 1, 2])):  # a value of the wrong kind somewhere
        corrupt(rng, pod)
    return pod


def corrupt(rng: random.Random, value: Any) -> None:
    """Replace one value somewhere inside `value` (a dict or list) by an odd one."""
    path: list[Any] = []
    while isinstance(value, dict | list) and value and (not path or rng.random() < 0.7):
        key = rng.choice(list(value)) if isinstance(value, dict) else rng.randrange(len(value))
        path.append((value, key))
        value = value[key]
    if path:
        parent, key = path[-1]
        parent[key] = copy.deepcopy(rng.choice(ODD))


def outcome(call: Any) -> Any:
    try:
        return ("ok", call())
    except Exception as exc:
        return ("raised", type(exc), str(exc))


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to itself (a hostile pod's NaN is kept as read, by both)."""
    return json.dumps(a, default=repr, sort_keys=True) == json.dumps(b, default=repr,
                                                                     sort_keys=True)


def foreign_of(index: ClusterIndex) -> ForeignCapacity:
    return ForeignCapacity(settings=TesseraSettings(), index=index, clock=lambda: NOW)


def readings(pod: Any) -> list[Any]:
    """What each reader of the listing makes of one pod."""
    index = ClusterIndex()
    return [
        outcome(lambda: foreign_of(index).classify(pod)),
        outcome(lambda: allocation_from_pod(pod, quota_held=False, now=NOW, claim_ttl_s=30.0)),
    ]


def keys_of(page: PodPage) -> list[tuple[Any, Any]]:
    return list(zip(page.uids, page.schedulers, strict=True))


def decoded_slim(pods: list[Any]) -> list[Any]:
    """The pods as the real client's slim listing decodes the API server's page of them."""
    data = json.dumps({"kind": "PodList", "metadata": {"resourceVersion": "7"}, "items": pods})
    page = decode_pod_page(data.encode())
    assert page["metadata"]["resourceVersion"] == "7"
    assert same(keys_of(page["items"]), [key_of(p) for p in pods])
    return SlimReader().take(page["items"])


@pytest.mark.parametrize("seed", range(6))
def test_every_reader_reads_a_slim_pod_as_the_full_one(seed: int) -> None:
    rng = random.Random(seed)
    pods = [random_pod(rng, i) for i in range(300)]
    for pod in pods:
        full = readings(pod)
        assert full == readings(slim(pod)), pod
        (decoded,) = decoded_slim([pod])
        assert same(full, readings(decoded)), pod
    # A page decodes slim when every pod fits the schema, else in full (never refused).
    fitting = [p for p in pods if same(slim(p), decoded_slim([p])[0])]
    assert len(fitting) > 100
    assert same(decoded_slim(fitting), [slim(p) for p in fitting])
    assert decoded_slim(fitting) != json.loads(json.dumps(fitting))  # the junk was left out
    assert same(decoded_slim(pods), json.loads(json.dumps(pods))) or len(fitting) == len(pods)
    entries = decode_pods(json.dumps(pods).encode())
    assert same(keys_of(entries), [key_of(p) for p in pods])
    assert same(SlimReader().take(entries), decoded_slim(pods))
    wanted = [i % 3 == 0 for i in range(len(pods))]  # a few read, the others left out
    reader = SlimReader(lambda uids, schedulers: wanted)
    assert same(reader.take(decode_pods(json.dumps(pods).encode())),
                [p for p, w in zip(decoded_slim(pods), wanted, strict=True) if w])  # fmt: skip
    assert reader.skipped == len(pods) - sum(wanted)
    assert same(SlimReader().take(decode_pods(json.dumps(fitting).encode())),
                decoded_slim(fitting))  # fmt: skip


def test_a_slim_pod_keeps_exactly_the_fields_read() -> None:
    pod = random_pod(random.Random(1), 1)
    pod["metadata"]["annotations"][hami.ANN_DEVICES_ALLOCATED] = GRANTS[0]
    pod["spec"]["initContainers"] = [{"name": "i", "restartPolicy": "Always", "image": "x"}]
    pod["status"]["initContainerStatuses"] = [{"state": {"terminated": {"exitCode": 0}}}]
    cut = decoded_slim([pod])[0]
    assert cut == slim(pod)
    assert set(cut) == {"metadata", "spec", "status"}
    assert set(cut["metadata"]) == {"name", "namespace", "uid", "resourceVersion", "annotations"}
    assert hami.ANN_DEVICES_ALLOCATED in cut["metadata"]["annotations"]
    assert "kubectl.kubernetes.io/last-applied-configuration" not in cut["metadata"]["annotations"]
    assert cut["spec"]["initContainers"] == [{"name": "i", "restartPolicy": "Always"}]
    assert cut["status"]["initContainerStatuses"] == [{"state": {"terminated": {"exitCode": 0}}}]
    for text in (b"[1, NaN]", b'[{"metadata": {"uid": "\\ud800"}}]', b"\xef\xbb\xbf[]",
                 b'[{"metadata": {"uid": "a", "uid": "b"}, "spec": {"schedulerName": 1}}]',
                 b'[{"metadata": null, "spec": []}, 5, "x", null]', b"[1,"):
        assert same(outcome(lambda t=text: SlimReader().take(decode_pods(t))),
                    outcome(lambda t=text: [slim(p) for p in json.loads(t)])), text  # fmt: skip
        if text != b"[1,":
            keys = keys_of(decode_pods(text))
            assert same(keys, [key_of(p) for p in json.loads(text)]), text


class FullCluster(InMemoryCluster):
    """A cluster port without the slim listing (a stand-in's): the rebuild lists in full."""

    list_pods_slim = None  # type: ignore[assignment]


class OldCluster(InMemoryCluster):
    """Every pod read in full, whatever the rebuild says it may skip (as before either)."""

    async def list_pods_slim(self, skip: Any = None) -> Listed:
        return Listed(await self.list_pods(), 0)


class JsonCluster(InMemoryCluster):
    """Its pods read off JSON as the real client reads a page (and the bench its file)."""

    async def list_pods_slim(self, skip: Any = None) -> Listed:
        reader = SlimReader(skip)
        data = json.dumps(await self.list_pods()).encode()
        return Listed(reader.take(decode_pods(data)), reader.skipped)


LEDGER = NodeLedger(node="a", allocations={a.pod_uid: a for a in (
    held("p1", "a", "GPU-a-0"), held("p2", "a", "GPU-a-1"))})  # fmt: skip


async def rebuilt(cluster: InMemoryCluster, pods: list[dict[str, Any]]) -> Any:
    index, store = ClusterIndex(), Store()
    for name in ("a", "b"):
        index.set_registration(name, node(name, gpus=2, memory_mib=10 * GIB), NOW)
    ledger = LEDGER
    store.values["a"] = ledger
    index.set_ledger("a", ledger, 1, NOW)
    for i, spec in enumerate(pods):
        cluster.pods[("default", str(i))] = spec
    foreign = foreign_of(index)
    rebuilder = LedgerRebuilder(cluster=cluster, index=index, write=store.write,
                                quota_enabled=False, claim_ttl_s=30.0, clock=lambda: NOW,
                                foreign=foreign)  # fmt: skip
    report = outcome(rebuilder.rebuild)
    if report[0] == "ok":
        report = ("ok", await report[1])
    return (report, {n: v.model_dump() for n, v in store.values.items()}, foreign.pods,
            {n: (f.pods, f.allocations) for n, f in index.foreign.items()},
            dict(index.pod_nodes))  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
async def test_the_rebuild_does_the_same_from_a_slim_listing(seed: int) -> None:
    rng = random.Random(100 + seed)
    pods = [random_pod(rng, i) for i in range(150)]
    for i in (0, 1):  # what the ledger holds, listed
        pods[i]["metadata"]["uid"], pods[i]["metadata"]["name"] = f"uid-p{i + 1}", f"p{i + 1}"
    full = await rebuilt(OldCluster(), copy.deepcopy(pods))
    assert len((await list_pods_slim(FullCluster())).pods) == 0
    for cluster in (InMemoryCluster(), FullCluster(), JsonCluster()):
        assert same(await rebuilt(cluster, copy.deepcopy(pods)), full), cluster
    assert full[0][0] == "ok" and full[0][1].pods_seen + len(full[2]) <= len(pods)
    assert full[0][1].restored and full[0][1].unreadable and full[2]  # all of it exercised


async def test_pods_the_index_places_are_counted_not_decoded() -> None:
    """Over an intact ledger the listing decodes no pod of Tessera's; HAMi's and the others are
    decoded (and the same pod under HAMi's scheduler is never skipped)."""
    placed = [{"metadata": {"uid": f"uid-p{i}", "name": f"p{i}", "namespace": "default"},
               "spec": {"nodeName": "a", "schedulerName": name}}
              for i, name in ((1, "tessera-scheduler"), (2, None))]  # fmt: skip
    hamis = {"metadata": {"uid": "uid-p1", "name": "h"}, "spec": {"schedulerName": "hami"}}
    other = {"metadata": {"uid": "uid-p9", "name": "p9"}, "spec": {}}
    cluster = JsonCluster()
    for i, spec in enumerate([*placed, hamis, other]):
        cluster.pods[("default", str(i))] = spec
    placing = {"uid-p1": "a", "uid-p2": "a"}
    listed = await list_pods_slim(cluster, partial(needed, placing, "tessera-scheduler"))
    assert listed.skipped == 2 and listed.pods == [hamis, other]
    listed = await list_pods_slim(cluster, partial(needed, placing, None))  # no HAMi reading
    assert listed.skipped == 3 and listed.pods == [other]
