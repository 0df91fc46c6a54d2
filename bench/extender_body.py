"""A filter call's body as kube-scheduler sends it, its parts timed apart: the JSON scan around
the candidate list (finding the array, the pod decoded, the keys lowered) and the list's
resolution (the native resolver reading the array in place).

kube-scheduler's `ExtenderArgs` is `{"Pod":<the v1 Pod as its informer holds it>,
"Nodes":null,"NodeNames":[...]}` (the Go struct has no JSON tags; `kube_lists.extender_args`),
written by Go's encoding/json: no spaces, the pod first. The pod here is a realistic pending
pod of a Deployment (labels, annotations with kubectl's last-applied configuration, an owner,
managed fields, two containers with env, mounts, probes and GPU limits, the default
tolerations, status Pending): ~6 KB. The lists are `kube_lists.py`'s, 20,000 nodes in the
parallel filters' order.

    python bench/extender_body.py      (BENCH_NODES, 20000; BENCH_CALLS, 200)

Per body, CPU ms of this thread, p50 / p99, after 32 MB of other memory was written (as a
decision between two calls does: "cold") and without ("warm": the parse reads each body first,
the parts after it): `NodeNamesCache.parse` whole (the service's path, the list read in place),
then its parts: `_start` (the `"nodenames"` key found), the resolver (`NameTable.slots_in`,
what `ClusterIndex.names_in_body` calls), the rest (the body without the array decoded with the
placeholder, its keys lowered); for reference, the whole body decoded (`msgspec`, `json`).
Printed, not recorded.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from kube_lists import COMPACT, KubeLists, extender_args  # noqa: E402

GIB = 1024**3


def pod(i: int) -> dict:
    """A pending pod of a Deployment as kube-scheduler's informer holds it."""
    name = f"trainer-7d9f8c6b5d-{i:05d}"
    labels = {"app": "trainer", "pod-template-hash": "7d9f8c6b5d", "team": "vision",
              "app.kubernetes.io/part-of": "research", "tier": "gpu"}
    container = {
        "name": "main", "image": "registry.example.com/vision/trainer:2026.12.1",
        "command": ["python", "-m", "trainer"], "args": ["--epochs", "40", "--batch", "256"],
        "ports": [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
        "env": [{"name": f"TRAINER_OPTION_{k}", "value": f"value-{k}"} for k in range(10)],
        "resources": {"limits": {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "16384",
                                 "nvidia.com/gpucores": "50", "cpu": "8", "memory": "32Gi"},
                      "requests": {"cpu": "4", "memory": "16Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"},
                         {"name": "kube-api-access-x2k9d", "readOnly": True,
                          "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 9090, "scheme": "HTTP"},
                          "initialDelaySeconds": 30, "timeoutSeconds": 1, "periodSeconds": 10,
                          "successThreshold": 1, "failureThreshold": 3},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent",
    }
    sidecar = {"name": "exporter", "image": "registry.example.com/ops/exporter:1.4",
               "resources": {"limits": {"cpu": "200m", "memory": "128Mi"}},
               "terminationMessagePath": "/dev/termination-log",
               "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}
    spec = {"containers": [container, sidecar]}
    return {
        "metadata": {
            "name": name, "generateName": "trainer-7d9f8c6b5d-", "namespace": "research",
            "uid": f"0f3c2a9e-5b1d-4c8e-9a7f-{i:012d}", "resourceVersion": str(81234567 + i),
            "creationTimestamp": "2026-12-07T12:00:00Z", "labels": labels,
            "annotations": {
                "hami.io/node-scheduler-policy": "binpack",
                "hami.io/gpu-scheduler-policy": "spread",
                "kubectl.kubernetes.io/last-applied-configuration": json.dumps(
                    {"apiVersion": "v1", "kind": "Pod", "metadata": {"labels": labels},
                     "spec": spec}, separators=COMPACT),
            },
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                 "name": "trainer-7d9f8c6b5d", "uid": "5e1f-77aa-4b2c",
                                 "controller": True, "blockOwnerDeletion": True}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update",
                               "apiVersion": "v1", "time": "2026-12-07T12:00:00Z",
                               "fieldsType": "FieldsV1",
                               "fieldsV1": {f"f:{k}": {} for k in
                                            ("metadata", "spec", "containers", "env", "ports",
                                             "resources", "volumeMounts", "volumes")}}],
        },
        "spec": {
            **spec,
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                        {"name": "kube-api-access-x2k9d", "projected": {
                            "sources": [{"serviceAccountToken": {"expirationSeconds": 3607,
                                                                 "path": "token"}}],
                            "defaultMode": 420}}],
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst", "serviceAccountName": "default",
            "serviceAccount": "default", "securityContext": {}, "schedulerName":
            "default-scheduler", "nodeSelector": {"gpu": "true"},
            "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                             "effect": "NoExecute", "tolerationSeconds": 300},
                            {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                             "effect": "NoExecute", "tolerationSeconds": 300}],
            "priority": 0, "enableServiceLinks": True, "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {"phase": "Pending", "qosClass": "Burstable"},
    }  # fmt: skip


def main() -> None:
    from tessera.scheduler.index import ClusterIndex
    from tessera.scheduler.node_names import _PLACEHOLDER_JSON, NodeNamesCache

    from tessera.models import DeviceInfo, NodeRegistration

    count = int(os.environ.get("BENCH_NODES", "20000"))
    calls = int(os.environ.get("BENCH_CALLS", "200"))
    names = [f"node-{i:05d}" for i in range(count)]
    index = ClusterIndex()
    for name in names:
        device = DeviceInfo(uuid=f"GPU-{name}", index=0, type="T", memory_mib=1024, cores=100)
        index.set_registration(name, NodeRegistration(node=name, devices=[device]), 0.0)
    kube = KubeLists(names, "full", order="parallel")
    bodies = [extender_args(json.dumps(pod(i), separators=COMPACT).encode(),
                            json.dumps(kube.next(), separators=COMPACT).encode())
              for i in range(calls)]  # fmt: skip
    pod_bytes = bodies[0].lower().find(b'"nodenames"')
    cache = NodeNamesCache(100_000, resolver=index.names_from_bytes, runs=index.names_of_run,
                           in_place=index.names_in_body)  # fmt: skip
    for body in bodies[:20]:  # (runs and rotations resting, as after any 8 such lists)
        assert cache.parse(body) is not None
    table = index.name_table()[1]  # (built: the parses above)
    decode = msgspec.json.Decoder().decode
    junk = bytearray(32 << 20)
    parts = ("parse", "start", "resolve", "rest", "msgspec whole", "json whole")
    print(f"{count} nodes, parallel order, a {pod_bytes}-byte pod, {len(bodies[0])}-byte "
          f"bodies; CPU ms p50 / p99; load {os.getloadavg()[0]:.2f}")
    for cold in (True, False):
        times: dict[str, list[float]] = {p: [] for p in parts}

        def timed(part: str, call, *args, cold=cold, times=times):  # type: ignore[no-untyped-def]
            if cold:
                junk[::64] = b"\x01" * len(junk[::64])
            started = time.thread_time_ns()
            result = call(*args)
            times[part].append((time.thread_time_ns() - started) / 1e6)
            return result

        for body in bodies[20:]:
            cache._recent.clear()  # (each body new, as kube-scheduler's parallel lists are)
            assert timed("parse", cache.parse, body) is not None
            start = timed("start", NodeNamesCache._start, body)
            found = timed("resolve", table.slots_in, body, start)
            assert found is not None
            end = found[1]

            def rest(body: bytes = body, start: int = start, end: int = end) -> dict:
                text = body[:start] + _PLACEHOLDER_JSON + body[end:]
                assert text.count(_PLACEHOLDER_JSON) == 1
                return {str(k).lower(): v for k, v in decode(text).items()}

            timed("rest", rest)
            timed("msgspec whole", decode, body)
            timed("json whole", json.loads, body)

        def q(xs: list[float]) -> str:
            xs.sort()
            return f"{xs[len(xs) // 2]:.3f} / {xs[int(len(xs) * 0.99)]:.3f}"

        print(("cold" if cold else "warm") + ": " + "; ".join(f"{p} {q(times[p])}" for p in parts))
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
