"""The quota keys users write (both `requests.` and `limits.` forms, byte units on gpumem, the
gpumem-percentage key) read as meant or refused with a message, never silently unlimited; and
`tessera quota set` does not silently replace a ResourceQuota's limits."""

from __future__ import annotations

import asyncio

import pytest
from quota_testkit import call, eventually, unique_namespace
from tessera.quota import arithmetic as qa
from test_resource_quotas import limits_of, resource_quota
from typer.testing import CliRunner

from tessera import bus
from tessera.cluster.memory import InMemoryCluster
from tessera.models import QuotaAmount, QuotaRequest, QuotaSetRequest, QuotaStatusRequest
from tessera_cli.app import build_app

KEYS = qa.ResourceQuotaKeys.from_resource_names(
    "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/gpumem-percentage"
)


@pytest.mark.parametrize(("hard", "expected"), [
    ({"requests.nvidia.com/gpumem": "8000", "requests.nvidia.com/gpucores": "150"},
     QuotaAmount(memory_mib=8000, cores=150)),
    ({"limits.nvidia.com/gpumem": "160Gi"}, QuotaAmount(memory_mib=160 * 1024)),
    ({"limits.nvidia.com/gpumem": "80G"}, QuotaAmount(memory_mib=80 * 10**9 // 2**20)),
    ({"limits.nvidia.com/gpumem": "512Mi", "requests.nvidia.com/gpumem": "400"},
     QuotaAmount(memory_mib=400)),  # both forms: the tightest wins
    ({"requests.nvidia.com/gpu": "2", "limits.nvidia.com/gpu": "3"}, QuotaAmount(gpus=2)),
    # what kube-apiserver writes back for 8000 MiB, 160000 MiB and 2000 % (canonical forms)
    ({"limits.nvidia.com/gpumem": "8k", "limits.nvidia.com/gpucores": "2k"},
     QuotaAmount(memory_mib=8000, cores=2000)),
    ({"limits.nvidia.com/gpumem": "160k"}, QuotaAmount(memory_mib=160000)),
    ({"limits.nvidia.com/gpumem": "1e3"}, QuotaAmount(memory_mib=1000)),
], ids=["requests forms", "160Gi", "80G", "limits and requests", "gpu both forms", "8k", "160k",
        "1e3"])
def test_quota_values_are_read_as_users_mean_them(hard: dict, expected: QuotaAmount) -> None:
    limits, problems = qa.limits_from_hard(hard, KEYS)
    assert limits == expected and problems == []


@pytest.mark.parametrize(("hard", "words"), [
    ({"limits.nvidia.com/gpumem-percentage": "50"}, "percentage"),
    ({"limits.nvidia.com/gpucores": "2Ki"}, "unit"),
    ({"requests.nvidia.com/gpu": "4Gi"}, "unit"),
    ({"limits.nvidia.com/gpumem": "500m"}, "thousandths"),
    ({"limits.nvidia.com/gpumem": "2000Ei"}, "more than any cluster"),
    ({"limits.nvidia.com/gpumem": "lots"}, "not a quantity"),
])
def test_unreadable_quota_values_are_refused_with_a_message(hard: dict, words: str) -> None:
    limits, problems = qa.limits_from_hard(hard, KEYS)
    assert limits == QuotaAmount()
    assert len(problems) == 1 and words in problems[0], problems
    assert next(iter(hard)) in problems[0]


async def test_resource_quota_with_units_and_requests_forms_applies(start_quota, nc):
    cluster = InMemoryCluster()
    ns = unique_namespace()
    cluster.put_quota(resource_quota(ns, "gpu", {
        "requests.nvidia.com/gpumem": "160Gi", "requests.nvidia.com/gpucores": "300",
        "limits.nvidia.com/gpumem-percentage": "50",
    }))
    await start_quota(cluster=cluster)

    async def applied() -> bool:
        return await limits_of(nc, ns) == QuotaAmount(memory_mib=163840, cores=300)

    await eventually(applied)
    assert any(e["reason"] == "InvalidGPUQuota" and "gpumem-percentage" in e["message"]
               for e in cluster.events)


async def test_quota_set_refuses_to_replace_a_resource_quota_unless_override(
    start_quota, nc, nats_url, monkeypatch
):
    monkeypatch.setenv("NATS_URL", nats_url)
    cluster = InMemoryCluster()
    ns = unique_namespace()
    cluster.put_quota(resource_quota(ns, "team-gpu", {"limits.nvidia.com/gpumem": "4000"}))
    await start_quota(cluster=cluster)

    async def applied() -> bool:
        return await limits_of(nc, ns) == QuotaAmount(memory_mib=4000)

    await eventually(applied)
    reply = await call(nc, bus.QUOTA_SET,
                       QuotaSetRequest(namespace=ns, limits=QuotaAmount(memory_mib=9000)))
    assert "ResourceQuota team-gpu" in reply.reason and "--override" in reply.reason
    assert await limits_of(nc, ns) == QuotaAmount(memory_mib=4000)

    async def cli(*args: str) -> tuple[int, str]:
        result = await asyncio.to_thread(CliRunner().invoke, build_app(), list(args))
        return result.exit_code, result.output

    code, out = await cli("quota", "set", ns, "--memory", "9000")
    assert code != 0 and "ResourceQuota" in out and "--override" in out
    assert await limits_of(nc, ns) == QuotaAmount(memory_mib=4000)
    code, out = await cli("quota", "set", ns, "--memory", "9000", "--override")
    assert code == 0, out
    status = await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace=ns))
    assert status.states[0].limits == QuotaAmount(memory_mib=9000)
    assert status.states[0].source == "cli"


async def test_quota_service_counts_requests_by_endpoint_and_result(start_quota, nc):
    from prometheus_client.parser import text_string_to_metric_families

    service = await start_quota()
    ns = unique_namespace()
    await call(nc, bus.QUOTA_SET, QuotaSetRequest(namespace=ns, limits=QuotaAmount(gpus=1)))
    await call(nc, bus.QUOTA_RESERVE, QuotaRequest(namespace=ns, pod_uid="a", gpus=2,
                                                   check_only=True))
    await call(nc, bus.QUOTA_STATUS, QuotaStatusRequest(namespace="Not A Namespace!"))
    samples = {(s.name, s.labels.get("op"), s.labels.get("result")): s.value
               for f in text_string_to_metric_families(service.metrics.render().decode())
               for s in f.samples}
    assert samples[("tessera_quota_requests_total", "set", "ok")] == 1
    assert samples[("tessera_quota_requests_total", "reserve", "refused")] == 1
    assert samples[("tessera_quota_requests_total", "status", "error")] == 1
    assert samples[("tessera_quota_request_seconds_count", "reserve", None)] == 1


def test_quota_process_serves_metrics_beside_its_probes(nats_url, tmp_path):
    """The real entry point: /metrics on TESSERA_LISTEN, as the chart's PodMonitor scrapes it."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    from tessera_cli.nats_embedded import free_port

    port = free_port()
    env = {**os.environ, "NATS_URL": nats_url, "TESSERA_LISTEN": f"127.0.0.1:{port}",
           "TESSERA_CLUSTER": "none"}
    proc = subprocess.Popen([sys.executable, "-m", "tessera.quota"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90  # a busy 2-core machine starts Python slowly
        while True:
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
                if reply.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "no /metrics"
            time.sleep(0.2)
        assert "tessera_quota_requests" in reply.text
        assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_gpu_usage_is_written_to_the_resource_quota_status(start_quota, nc):
    """`kubectl describe quota` shows Used for the `limits.` GPU keys (kube-controller-manager
    evaluates extended resources only in their `requests.` form): the quota service writes
    them into status.used, in the API server's canonical form, when usage changes."""
    cluster = InMemoryCluster()
    ns = unique_namespace()
    cluster.put_quota(resource_quota(ns, "gpu", {
        "limits.nvidia.com/gpumem": "8000", "limits.nvidia.com/gpucores": "200", "pods": "10"}))
    await start_quota(cluster=cluster)

    async def applied() -> bool:
        return await limits_of(nc, ns) == QuotaAmount(memory_mib=8000, cores=200)

    await eventually(applied)
    await call(nc, bus.QUOTA_RESERVE, QuotaRequest(namespace=ns, pod_uid="a", gpus=1,
                                                  memory_mib=3000, cores=30))

    async def written() -> bool:
        used = (cluster.quotas[(ns, "gpu")].get("status") or {}).get("used") or {}
        return used == {"limits.nvidia.com/gpumem": "3k", "limits.nvidia.com/gpucores": "30"}

    await eventually(written)
