"""HAMi's webhook rules, end to end through POST /mutate: every rule checks the patched pod."""

from __future__ import annotations

import copy

import httpx
import pytest
from admission_helpers import (
    CORES,
    GPU,
    MEM,
    PCT,
    PRIORITY,
    container,
    env_of,
    limits_of,
    patched,
    pod,
    review,
)
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics

from tessera.settings import TesseraSettings

SCHED = "tessera-scheduler"


async def mutate(client: httpx.AsyncClient, obj: dict, **kw: object) -> dict:
    answer = await client.post("/mutate", json=review(obj, **kw))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["kind"] == "AdmissionReview"
    return body["response"]


def with_settings(**values: object) -> httpx.AsyncClient:
    app = AdmissionApp(TesseraSettings(quota_enabled=False, **values), metrics=AdmissionMetrics())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://webhook")


# --- normalisation: the patched pod is exactly the original plus what HAMi adds ---------------


async def test_bare_gpu_count_becomes_an_exclusive_card_and_is_routed_to_tessera(client):
    original = pod(container(limits={GPU: "1"}))
    response = await mutate(client, original)
    expected = copy.deepcopy(original)
    expected["spec"]["schedulerName"] = SCHED
    expected["spec"]["containers"][0]["resources"]["limits"][CORES] = "100"
    assert patched(original, response) == expected


async def test_memory_only_gets_the_default_gpu_count_and_stays_shared(client):
    original = pod(container(limits={MEM: "3000"}))
    new = patched(original, await mutate(client, original))
    assert limits_of(new) == {MEM: "3000", GPU: "1"}
    assert new["spec"]["schedulerName"] == SCHED


async def test_cores_only_gets_a_count_and_keeps_its_cores(client):
    original = pod(container(limits={CORES: "30"}))
    new = patched(original, await mutate(client, original))
    assert limits_of(new) == {CORES: "30", GPU: "1"}


@pytest.mark.parametrize(("percentage", "exclusive"), [("100", True), ("50", False)])
async def test_full_percentage_means_exclusive_cores(client, percentage, exclusive):
    original = pod(container(limits={PCT: percentage}))
    new = patched(original, await mutate(client, original))
    expected = {PCT: percentage, GPU: "1"} | ({CORES: "100"} if exclusive else {})
    assert limits_of(new) == expected


async def test_default_gpu_num_setting_is_what_gets_added():
    async with with_settings(default_gpu_num=2) as http:
        original = pod(container(limits={MEM: "1024"}))
        new = patched(original, await mutate(http, original))
    assert limits_of(new)[GPU] == "2"


async def test_request_only_gpu_resources_keep_requests_and_limits_equal(client):
    original = pod(container())
    original["spec"]["containers"][0]["resources"] = {"requests": {MEM: "2000"}}
    new = patched(original, await mutate(client, original))
    resources = new["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {GPU: "1"}
    assert resources["requests"] == {MEM: "2000", GPU: "1"}


async def test_init_containers_are_normalised_too(client):
    original = pod(
        container("app", limits={MEM: "1000", GPU: "1"}),
        init=[container("warmup", limits={GPU: "1"}), container("fetch")],
    )
    new = patched(original, await mutate(client, original))
    assert limits_of(new, 0, "initContainers") == {GPU: "1", CORES: "100"}
    assert "resources" not in new["spec"]["initContainers"][1]
    assert limits_of(new) == {MEM: "1000", GPU: "1"}
    assert new["spec"]["schedulerName"] == SCHED


async def test_pod_without_gpu_is_allowed_unchanged(client):
    original = pod(container(limits={"cpu": "1", "memory": "1Gi"}))
    response = await mutate(client, original)
    assert response["allowed"] is True and "patch" not in response


@pytest.mark.parametrize("scheduler", ["volcano", "hami-scheduler"])
async def test_pods_for_other_schedulers_are_left_alone(client, scheduler):
    # Even what we would deny (privileged, preset node) is the other scheduler's business.
    original = pod(
        container(limits={GPU: "1"}, securityContext={"privileged": True}),
        schedulerName=scheduler, nodeName="node-1",
    )
    response = await mutate(client, original)
    assert response["allowed"] is True and "patch" not in response


async def test_default_scheduler_is_replaced_for_gpu_pods(client):
    original = pod(container(limits={MEM: "1000", GPU: "1"}), schedulerName="default-scheduler")
    new = patched(original, await mutate(client, original))
    assert new["spec"]["schedulerName"] == SCHED


async def test_an_already_normalised_pod_gets_no_patch(client):
    original = pod(container(limits={GPU: "1", CORES: "100"}), schedulerName=SCHED)
    response = await mutate(client, original)
    assert response["allowed"] is True and "patch" not in response


# --- env injection -----------------------------------------------------------------------------


async def test_priority_becomes_cuda_task_priority_next_to_existing_env(client):
    env = [{"name": "A", "value": "x"}]
    original = pod(container(limits={MEM: "1000", PRIORITY: "0"}, env=env))
    new = patched(original, await mutate(client, original))
    assert new["spec"]["containers"][0]["env"] == [
        {"name": "A", "value": "x"},
        {"name": "CUDA_TASK_PRIORITY", "value": "0"},
    ]


async def test_conflicting_and_duplicate_env_entries_end_as_one_with_the_resource_value(client):
    env = [
        {"name": "CUDA_TASK_PRIORITY", "value": "0"},
        {"name": "B", "value": "y"},
        {"name": "CUDA_TASK_PRIORITY", "value": "0"},
    ]
    original = pod(container(limits={MEM: "1000", PRIORITY: "1"}, env=env))
    new = patched(original, await mutate(client, original))
    assert new["spec"]["containers"][0]["env"] == [
        {"name": "CUDA_TASK_PRIORITY", "value": "1"},
        {"name": "B", "value": "y"},
    ]


async def test_reinvocation_is_idempotent():
    """The API server may call the webhook again on its own output: nothing more is added."""
    async with with_settings(core_policy="force", env_overwrite=True) as http:
        original = pod(
            container("main", limits={MEM: "1000", PRIORITY: "0"}),
            container("sidecar"),
            init=[container("warmup", limits={GPU: "1", PRIORITY: "1"})],
        )
        first = patched(original, await mutate(http, original))
        again = await mutate(http, first)
    assert again["allowed"] is True and "patch" not in again
    assert env_of(first) == {"CUDA_TASK_PRIORITY": "0", "GPU_CORE_UTILIZATION_POLICY": "force"}
    assert env_of(first, 1) == {"NVIDIA_VISIBLE_DEVICES": "none"}
    assert env_of(first, 0, "initContainers") == {
        "CUDA_TASK_PRIORITY": "1", "GPU_CORE_UTILIZATION_POLICY": "force"
    }


async def test_core_policy_env_only_on_gpu_containers():
    async with with_settings(core_policy="disable") as http:
        original = pod(container("main", limits={GPU: "1"}), container("sidecar"))
        new = patched(original, await mutate(http, original))
    assert env_of(new) == {"GPU_CORE_UTILIZATION_POLICY": "disable"}
    assert "env" not in new["spec"]["containers"][1]


async def test_default_core_policy_and_no_priority_inject_nothing(client):
    original = pod(container(limits={MEM: "1000"}))
    new = patched(original, await mutate(client, original))
    assert "env" not in new["spec"]["containers"][0]


async def test_env_overwrite_hides_gpus_from_containers_that_ask_none():
    async with with_settings(env_overwrite=True) as http:
        env = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
        original = pod(container("cpu-only", env=env))
        new = patched(original, await mutate(http, original))
    assert env_of(new) == {"NVIDIA_VISIBLE_DEVICES": "none"}


async def test_gpucores_above_100_can_never_fit_and_is_denied(client):
    # HAMi clamps silently; a card has 100, so Tessera says so (see test_admission_compat.py).
    response = await mutate(client, pod(container(limits={GPU: "1", CORES: "150"})))
    assert response["allowed"] is False
    assert CORES in response["status"]["message"] and "0 to 100" in response["status"]["message"]


# --- denials -------------------------------------------------------------------------------------


async def denied(client: httpx.AsyncClient, obj: object, **kw: object) -> dict:
    response = await mutate(client, obj, **kw)  # type: ignore[arg-type]
    assert response["allowed"] is False, response
    assert "patch" not in response
    assert response["status"]["message"]
    return response["status"]


@pytest.mark.parametrize("containers", [[], None])
async def test_pod_without_containers_is_denied(client, containers):
    original = pod()
    original["spec"]["containers"] = containers
    status = await denied(client, original)
    assert status["message"] == "pod has no containers"


async def test_privileged_sidecar_in_a_gpu_pod_is_denied_by_name(client):
    original = pod(
        container("main", limits={GPU: "1"}),
        container("debugger", securityContext={"privileged": True}),
    )
    status = await denied(client, original)
    assert status["code"] == 403
    assert "container debugger is privileged" in status["message"]


async def test_privileged_container_without_gpu_is_not_our_business(client):
    original = pod(container("debugger", securityContext={"privileged": True}))
    assert (await mutate(client, original))["allowed"] is True


async def test_preset_node_name_on_a_gpu_pod_is_denied(client):
    status = await denied(client, pod(container(limits={GPU: "1"}), nodeName="gpu-node-3"))
    assert "spec.nodeName" in status["message"] and "gpu-node-3" in status["message"]
    assert "nodeSelector" in status["message"]


async def test_preset_node_name_without_gpu_is_allowed(client):
    assert (await mutate(client, pod(container(), nodeName="n1")))["allowed"] is True


@pytest.mark.parametrize(
    ("resource", "value", "words"),
    [
        (MEM, "1e400", "absurdly large"),
        (MEM, "-1", "at least 0"),
        (MEM, "abc", "not a quantity"),
        (MEM, "1.5", "whole number"),
        (GPU, "-1", "at least 0"),
        (GPU, "1e400", "absurdly large"),
        (GPU, "abc", "not a quantity"),
        (PCT, "101", "between 0 and 100"),
        (PCT, "-5", "between 0 and 100"),
        (PCT, "1e400", "between 0 and 100"),
        (PCT, "abc", "not a quantity"),
        (CORES, "abc", "not a quantity"),
        (CORES, "-3", "at least 0"),
        (PRIORITY, "2", "at most 1"),
        (PRIORITY, "abc", "not a quantity"),
    ],
)
async def test_malformed_or_out_of_range_quantities_are_denied(client, resource, value, words):
    limits = {resource: value} if resource in (GPU, MEM) else {GPU: "1", resource: value}
    status = await denied(client, pod(container("worker", limits=limits)))
    assert status["code"] == 400
    assert "container worker" in status["message"]
    assert resource in status["message"] and words in status["message"]


async def test_zero_gpus_with_memory_is_contradictory_and_denied(client):
    status = await denied(client, pod(container(limits={GPU: "0", MEM: "1000"})))
    assert "is 0 but" in status["message"] and MEM in status["message"]


async def test_zero_gpus_alone_means_no_gpu(client):
    response = await mutate(client, pod(container(limits={GPU: "0"})))
    assert response["allowed"] is True and "patch" not in response


@pytest.mark.parametrize(
    "annotation",
    ["hami.io/vgpu-devices-to-allocate", "hami.io/vgpu-node", "hami.io/bind-phase",
     "hami.io/bind-time"],
)
async def test_scheduler_owned_annotations_are_denied(client, annotation):
    original = pod(container(limits={GPU: "1"}), annotations={annotation: "GPU-x,NVIDIA,1,1:;"})
    status = await denied(client, original)
    assert annotation in status["message"] and "remove" in status["message"]


async def test_scheduler_owned_annotations_are_denied_on_pods_without_gpu_too(client):
    original = pod(container(), annotations={"hami.io/vgpu-devices-allocated": "x"})
    await denied(client, original)


async def test_user_knob_annotations_are_fine(client):
    original = pod(
        container(limits={GPU: "1"}),
        annotations={"hami.io/gpu-scheduler-policy": "binpack", "nvidia.com/use-gputype": "A100"},
    )
    assert (await mutate(client, original))["allowed"] is True


async def test_denial_is_answered_in_v1beta1_when_asked_in_v1beta1(client):
    answer = await client.post(
        "/mutate", json=review(pod(), api_version="admission.k8s.io/v1beta1", uid="u-9")
    )
    body = answer.json()
    assert body["apiVersion"] == "admission.k8s.io/v1beta1"
    assert body["response"]["uid"] == "u-9"
    assert body["response"]["allowed"] is False


async def test_mutation_is_answered_in_v1beta1_when_asked_in_v1beta1(client):
    original = pod(container(limits={GPU: "1"}))
    body = (await client.post(
        "/mutate", json=review(original, api_version="admission.k8s.io/v1beta1")
    )).json()
    assert body["apiVersion"] == "admission.k8s.io/v1beta1"
    assert patched(original, body["response"])["spec"]["schedulerName"] == SCHED
