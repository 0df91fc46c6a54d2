"""Fuzzing POST /mutate: whatever arrives, the answer is never a 5xx, and what the webhook
admits with a patch is a pod it would leave alone the second time (reinvocation)."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import jsonpatch
from admission_helpers import CORES, GPU, MEM, PCT, PRIORITY, review
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics

from tessera.settings import TesseraSettings

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


async def call(app: AdmissionApp, body: bytes, path: str = "/mutate") -> tuple[int, bytes]:
    """Drive the ASGI app directly: no sockets, so hundreds of examples stay fast."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def run(app: AdmissionApp, body: bytes) -> tuple[int, bytes]:
    return asyncio.run(call(app, body))


def make_app(**values: Any) -> AdmissionApp:
    return AdmissionApp(TesseraSettings(quota_enabled=False, **values), metrics=AdmissionMetrics())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=4),
    max_leaves=20,
)

quantities = st.one_of(
    st.sampled_from(["1", "2", "0", "100", "101", "3000", "-1", "1e400", "abc", "1.5", "1Gi",
                     "500m", "", " 2 ", "1e3", "0x10", "NaN", "inf", "+5", "--1", "1e-400"]),
    st.integers(min_value=-5, max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(), st.booleans(), st.lists(st.integers(), max_size=2),
    st.text(max_size=8),
)

resource_maps = st.dictionaries(st.sampled_from([GPU, MEM, PCT, CORES, PRIORITY, "cpu"]),
                                quantities, max_size=5)

env_entries = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["CUDA_TASK_PRIORITY", "GPU_CORE_UTILIZATION_POLICY",
                                  "NVIDIA_VISIBLE_DEVICES", "OTHER"])},
        optional={"value": st.sampled_from(["0", "1", "force", "none", "x"])},
    ),
    max_size=4,
)

containers = st.fixed_dictionaries(
    {"name": st.text(min_size=1, max_size=8), "image": st.just("img")},
    optional={
        "resources": st.one_of(
            st.fixed_dictionaries({}, optional={"limits": resource_maps,
                                                "requests": resource_maps}),
            json_values,
        ),
        "env": env_entries,
        "securityContext": st.fixed_dictionaries({"privileged": st.booleans()}),
    },
)

pods = st.fixed_dictionaries(
    {
        "metadata": st.fixed_dictionaries(
            {"name": st.text(max_size=10)},
            optional={"annotations": st.dictionaries(
                st.sampled_from(["hami.io/vgpu-node", "hami.io/bind-phase", "a/b", "c", "d/e",
                                 "hami.io/gpu-scheduler-policy", "nvidia.com/use-gputype"]),
                st.text(max_size=5), max_size=2)},
        ),
        "spec": st.fixed_dictionaries(
            {"containers": st.lists(containers, min_size=1, max_size=3)},
            optional={
                "initContainers": st.lists(containers, max_size=2),
                "schedulerName": st.sampled_from(["", "default-scheduler", "tessera-scheduler",
                                                  "other"]),
                "nodeName": st.sampled_from(["", "n1"]),
            },
        ),
    },
)


def test_arbitrary_bytes_never_get_a_5xx():
    app = make_app()

    @FUZZ
    @given(st.binary(max_size=2000))
    def check(body: bytes) -> None:
        status, _ = run(app, body)
        assert status == 400

    check()


def test_arbitrary_json_in_any_place_never_gets_a_5xx():
    app = make_app()
    reviews = st.fixed_dictionaries(
        {"kind": st.sampled_from(["AdmissionReview", "Pod"]),
         "apiVersion": st.sampled_from(["admission.k8s.io/v1", "admission.k8s.io/v1beta1", "v1"]),
         "request": st.fixed_dictionaries({}, optional={
             "uid": json_values, "kind": json_values, "resource": json_values,
             "operation": json_values, "namespace": json_values, "object": json_values,
             "subResource": json_values, "dryRun": json_values,
         })},
    )

    @FUZZ
    @given(st.one_of(json_values, reviews))
    def check(document: Any) -> None:
        status, body = run(app, json.dumps(document).encode())
        assert status in (200, 400), body
        if status == 200:
            response = json.loads(body)["response"]
            assert isinstance(response["allowed"], bool)
            if not response["allowed"]:
                assert response["status"]["message"]

    check()


def test_fuzzed_pods_get_an_answer_and_admitted_patches_are_stable():
    app = make_app(core_policy="force", env_overwrite=True)

    @FUZZ
    @given(pods)
    def check(obj: dict[str, Any]) -> None:
        status, body = run(app, json.dumps(review(obj)).encode())
        assert status == 200, body
        response = json.loads(body)["response"]
        if not response["allowed"]:
            assert response["status"]["message"]
            assert response["status"]["code"] in (400, 403)
            return
        if "patch" not in response:
            return
        new = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(response["patch"])))
        assert new["spec"].get("schedulerName") in ("tessera-scheduler", obj["spec"].get(
            "schedulerName"))
        # Reinvocation: the webhook's own output needs nothing more.
        _, again = run(app, json.dumps(review(new)).encode())
        second = json.loads(again)["response"]
        assert second["allowed"] is True and "patch" not in second, second

    check()


def test_json_patch_turns_any_document_into_any_other():
    """rules.json_patch prunes both documents before diffing: the patch must still be exact.
    A small alphabet makes the two documents share most of their structure, as pods do."""
    from tessera.admission.rules import json_patch

    leaves = st.none() | st.integers(0, 3) | st.sampled_from(["x", "y"])
    trees = st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
            st.sampled_from(["a", "b", "c/d", "~e"]), inner, max_size=3),
        max_leaves=12,
    )
    documents = st.dictionaries(st.sampled_from(["a", "b", "spec"]), trees, max_size=3)

    @FUZZ
    @given(documents, documents)
    def check(old: dict, new: dict) -> None:
        assert jsonpatch.apply_patch(old, json_patch(old, new)) == new

    check()


def test_quota_charge_is_the_one_of_the_patched_pod():
    """The charge sent to the quota service is what the scheduler will read from the pod."""
    from tessera.admission.rules import Admitted, decide

    from tessera.hami import parse_pod_request, quota_charge

    config = TesseraSettings(core_policy="force")

    @FUZZ
    @given(pods)
    def check(obj: dict[str, Any]) -> None:
        decision = decide(obj, "ns", config)
        if not isinstance(decision, Admitted) or decision.quota is None:
            return
        new = jsonpatch.apply_patch(obj, decision.patch)
        ask = decision.quota
        charge = quota_charge(parse_pod_request(new, config))
        assert (ask.memory_mib, ask.cores, ask.gpus) == charge

    check()



def test_fuzzed_pods_in_dra_mode_get_an_answer_and_converted_pods_are_stable():
    """DRA mode (dra_claims.py): every fuzzed pod gets an answer, a converted pod keeps no
    HAMi resource, and the webhook's own output needs nothing more."""
    from tessera.admission.dra_templates import DraTemplates

    from tessera.cluster.memory import InMemoryCluster

    settings = TesseraSettings(quota_enabled=False, allocation_mode="dra")
    app = AdmissionApp(settings, metrics=AdmissionMetrics(),
                       dra=DraTemplates(InMemoryCluster(), settings, cache_s=0))  # fmt: skip

    @FUZZ
    @given(pods)
    def check(obj: dict[str, Any]) -> None:
        status, body = run(app, json.dumps(review(obj)).encode())
        assert status == 200, body
        response = json.loads(body)["response"]
        if not response["allowed"]:
            assert response["status"]["message"]
            assert response["status"]["code"] in (400, 403)
            return
        if "patch" not in response:
            return
        new = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(response["patch"])))
        for c in [*(new["spec"].get("initContainers") or []), *new["spec"]["containers"]]:
            for part in ("limits", "requests"):
                held = ((c.get("resources") or {}).get(part)) or {}
                assert not any(k.startswith("nvidia.com/") for k in held), c
        _, again = run(app, json.dumps(review(new)).encode())
        second = json.loads(again)["response"]
        assert second["allowed"] is True and "patch" not in second, second

    check()
