"""What HAMi users copy from guides (aliases, with a kubectl-visible warning naming the canonical
key) and what can never fit (denied with a message naming the field and the unit), through the
webhook's HTTP endpoint."""

from __future__ import annotations

import httpx
from admission_helpers import CORES, GPU, MEM, PRIORITY, container, limits_of, patched, pod, review
from tessera.admission.app import AdmissionApp
from tessera.admission.metrics import AdmissionMetrics

from tessera.settings import TesseraSettings


async def mutate(client: httpx.AsyncClient, obj: dict) -> dict:
    answer = await client.post("/mutate", json=review(obj))
    assert answer.status_code == 200, answer.text
    return answer.json()["response"]


async def denial(client: httpx.AsyncClient, obj: dict) -> str:
    response = await mutate(client, obj)
    assert response["allowed"] is False, response
    return str(response["status"]["message"])


# --- aliases -----------------------------------------------------------------------------------


async def test_cores_alias_is_renamed_with_a_warning(client):
    original = pod(container(limits={GPU: "1", MEM: "2000", "nvidia.com/cores": "30"}))
    response = await mutate(client, original)
    new = patched(original, response)
    limits = limits_of(new)
    assert limits[CORES] == "30" and "nvidia.com/cores" not in limits
    assert any("nvidia.com/cores" in w and CORES in w for w in response["warnings"])


async def test_cores_alias_conflicting_with_canonical_is_denied(client):
    message = await denial(client, pod(container(
        limits={GPU: "1", MEM: "2000", CORES: "20", "nvidia.com/cores": "30"})))
    assert "nvidia.com/cores" in message and CORES in message


async def test_annotation_aliases_are_copied_to_canonical_keys(client):
    original = pod(container(limits={GPU: "1", MEM: "2000", CORES: "10"}), annotations={
        "hami.io/gpu-type": "A100", "hami.io/gpu-uuid-white-list": "GPU-a,GPU-b"})
    response = await mutate(client, original)
    annotations = patched(original, response)["metadata"]["annotations"]
    assert annotations["nvidia.com/use-gputype"] == "A100"
    assert annotations["nvidia.com/use-gpuuuid"] == "GPU-a,GPU-b"
    warnings = " | ".join(response["warnings"])
    assert "nvidia.com/use-gputype" in warnings and "nvidia.com/use-gpuuuid" in warnings


async def test_canonical_annotation_wins_over_its_alias(client):
    original = pod(container(limits={GPU: "1", MEM: "2000", CORES: "10"}), annotations={
        "hami.io/gpu-type": "A100", "nvidia.com/use-gputype": "H100"})
    response = await mutate(client, original)
    annotations = patched(original, response)["metadata"]["annotations"]
    assert annotations["nvidia.com/use-gputype"] == "H100"
    assert any("both are set" in w for w in response["warnings"])


async def test_task_priority_maps_higher_number_to_high_priority(client):
    high = pod(container(limits={GPU: "1", MEM: "2000", CORES: "10"}),
               container("sidecar"), annotations={"hami.io/task-priority": "5"})
    response = await mutate(client, high)
    new = patched(high, response)
    assert limits_of(new)[PRIORITY] == "0"  # nvidia.com/priority 0 = high
    assert PRIORITY not in (new["spec"]["containers"][1].get("resources") or {}).get("limits", {})
    env = {e["name"]: e["value"] for e in new["spec"]["containers"][0]["env"]}
    assert env["CUDA_TASK_PRIORITY"] == "0"
    assert any(PRIORITY in w and "hami.io/task-priority" in w for w in response["warnings"])
    low = pod(container(limits={GPU: "1", MEM: "2000", CORES: "10"}),
              annotations={"hami.io/task-priority": "0"})
    assert limits_of(patched(low, await mutate(client, low)))[PRIORITY] == "1"
    message = await denial(client, pod(container(limits={GPU: "1", MEM: "2000"}),
                                       annotations={"hami.io/task-priority": "urgent"}))
    assert "hami.io/task-priority" in message and "integer" in message


async def test_unknown_hami_and_nvidia_keys_get_warnings(client):
    original = pod(container(limits={GPU: "1", MEM: "2000", CORES: "10",
                                     "nvidia.com/gpumemory": "3000"}),
                   annotations={"hami.io/gpu-schedular-policy": "binpack",
                                "nvidia.com/use-gpu-type": "A100", "example.com/other": "x"})
    response = await mutate(client, original)
    assert response["allowed"] is True
    warnings = " | ".join(response["warnings"])
    for key in ("nvidia.com/gpumemory", "hami.io/gpu-schedular-policy",
                "nvidia.com/use-gpu-type"):
        assert key in warnings, key
    assert "example.com/other" not in warnings


async def test_known_keys_draw_no_warning(client):
    response = await mutate(client, pod(container(limits={GPU: "1", MEM: "2000", CORES: "10"}),
                                        annotations={"nvidia.com/use-gputype": "A100",
                                                     "hami.io/gpu-scheduler-policy": "binpack"}))
    assert response["allowed"] is True and not response.get("warnings")


# --- what can never fit --------------------------------------------------------------------------


async def test_gpumem_with_a_unit_is_denied_naming_mib(client):
    message = await denial(client, pod(container(limits={GPU: "1", MEM: "4Gi"})))
    assert MEM in message and "MiB" in message and "4Gi" in message
    assert f"write {MEM}: 4096" in message  # what to write instead


async def test_gpumem_fraction_is_denied_saying_what_to_write(client):
    message = await denial(client, pod(container(limits={GPU: "1", MEM: "1500m"})))
    assert "'1500m' is 1.5 MiB, not a whole number of MiB" in message and f"{MEM}: 2" in message


async def test_canonical_decimal_forms_are_the_mib_they_say(client):
    """kube-apiserver writes `3000` back as `3k` (and keeps `1e3`): the webhook admits every
    canonical decimal form, unchanged, with no warning."""
    for written in ("3k", "12k", "1e3", "3000", "2500"):
        original = pod(container(limits={GPU: "1", MEM: written}))
        response = await mutate(client, original)
        assert response["allowed"] is True, (written, response)
        assert limits_of(patched(original, response))[MEM] == written
        assert not response.get("warnings"), response


async def test_implausibly_small_gpumem_is_admitted_with_a_warning(client):
    response = await mutate(client, pod(container(limits={GPU: "1", MEM: "4"})))
    assert response["allowed"] is True
    [warning] = response["warnings"]
    assert f"{MEM}: '4' is 4 MiB" in warning and "implausibly small" in warning
    assert f"{MEM}: 4000" in warning and "4096" in warning


async def test_typo_of_a_gpu_resource_is_warned_with_the_right_name(client):
    response = await mutate(client, pod(container(limits={GPU: "1", "nvidia.com/gpumen": "3000"})))
    assert response["allowed"] is True
    assert any("nvidia.com/gpumen" in w and f"did you mean {MEM}?" in w
               for w in response["warnings"]), response["warnings"]
    far = await mutate(client, pod(container(limits={GPU: "1", "nvidia.com/foo": "1"})))
    assert not any("did you mean" in w for w in far["warnings"])


async def test_cores_above_a_card_are_denied(client):
    message = await denial(client, pod(container(limits={GPU: "2", MEM: "1000", CORES: "101"})))
    assert CORES in message and "0 to 100" in message


async def test_more_gpus_than_any_node_is_denied_with_configurable_ceiling():
    settings = TesseraSettings(quota_enabled=False, max_gpus_per_node=8)
    app = AdmissionApp(settings, metrics=AdmissionMetrics())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://webhook") as client:
        message = await denial(client, pod(container(limits={GPU: "9", MEM: "1000"})))
        assert GPU in message and "8" in message and "TESSERA_MAX_GPUS_PER_NODE" in message
        response = await mutate(client, pod(container(limits={GPU: "8", MEM: "1000"})))
        assert response["allowed"] is True


async def test_unknown_scheduler_policy_is_denied(client):
    message = await denial(client, pod(container(limits={GPU: "1", MEM: "1000"}),
                                       annotations={"hami.io/gpu-scheduler-policy": "packbin"}))
    assert "hami.io/gpu-scheduler-policy" in message and "binpack" in message
    message = await denial(client, pod(container(limits={GPU: "1", MEM: "1000"}),
                                       annotations={"hami.io/node-scheduler-policy": "mutex"}))
    assert "hami.io/node-scheduler-policy" in message
    ok = await mutate(client, pod(container(limits={GPU: "1", MEM: "1000"}),
                                  annotations={"hami.io/gpu-scheduler-policy": "binpack,numa"}))
    assert ok["allowed"] is True


async def test_bad_scoring_weights_are_denied(client):
    message = await denial(client, pod(container(limits={GPU: "1", MEM: "1000"}),
                                       annotations={"hami.io/device-scoring-weights": "slot=1"}))
    assert "hami.io/device-scoring-weights" in message


async def test_a_pod_whose_only_gpu_resource_is_misspelt_goes_to_our_scheduler(client):
    """It asks for no GPU Tessera knows, but it was meant for one: our scheduler takes it, so
    it is counted pending (and its deletion reported) rather than pending unseen."""
    original = pod(container(limits={"nvidia.com/gpumen": "3k"}))
    response = await mutate(client, original)
    assert response["allowed"] is True
    assert patched(original, response)["spec"]["schedulerName"] == "tessera-scheduler"
    assert any(f"did you mean {MEM}?" in w for w in response["warnings"])
