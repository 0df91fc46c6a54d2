"""Quota check (against a test double of tessera-quota) and admission events, on a real NATS."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from admission_helpers import (
    CORES,
    GPU,
    MEM,
    QuotaServiceDouble,
    container,
    patched,
    pod,
    review,
)
from tessera.admission.app import AdmissionApp
from tessera.admission.event_queue import EventQueue
from tessera.admission.metrics import AdmissionMetrics
from tessera.admission.quota_check import QuotaChecker

from tessera.events import subscribe
from tessera.models import AdmissionEvent
from tessera.settings import TesseraSettings


@contextlib.asynccontextmanager
async def webhook(
    nc: object, *, timeout_s: float = 1.0, events: bool = True, **settings: object
) -> AsyncIterator[httpx.AsyncClient]:
    config = TesseraSettings(**settings)
    metrics = AdmissionMetrics()
    queue = EventQueue(nc.jetstream(), source="admission/test",  # type: ignore[attr-defined]
                       on_drop=metrics.events_dropped.inc) if events else None
    app = AdmissionApp(config, metrics=metrics, quota=QuotaChecker(nc, timeout_s),  # type: ignore[arg-type]
                       events=queue)
    if queue:
        queue.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://webhook") as http:
            yield http
    finally:
        if queue:
            await queue.stop(drain_timeout_s=0.5)


@pytest.fixture
def namespace() -> str:
    return f"ns-{uuid.uuid4().hex[:10]}"


async def answer(http: httpx.AsyncClient, obj: dict, **kw: object) -> dict:
    reply = await http.post("/mutate", json=review(obj, **kw))
    assert reply.status_code == 200, reply.text
    return reply.json()["response"]


async def test_pod_that_fits_is_admitted_after_a_check_only_request(admission_nc, namespace):
    double = await QuotaServiceDouble(limits={namespace: (10_000, 400, 4)}).start(admission_nc)
    try:
        obj = pod(
            container("a", limits={GPU: "2", MEM: "2000", CORES: "30"}),
            container("b", limits={MEM: "1000"}),
            init=[container("warm", limits={GPU: "1"})],
            namespace=namespace,
        )
        async with webhook(admission_nc, events=False) as http:
            response = await answer(http, obj)
        assert patched(obj, response)["spec"]["schedulerName"] == "tessera-scheduler"
        [asked] = double.requests
        assert asked.check_only is True and asked.namespace == namespace
        # HAMi's charge: app containers summed over every GPU, init containers by max.
        assert (asked.memory_mib, asked.cores, asked.gpus) == (5000, 100, 3)
        assert asked.pod_uid == obj["metadata"]["uid"]
    finally:
        await double.stop()


async def test_pod_over_quota_is_denied_with_the_quota_reason(admission_nc, namespace):
    double = await QuotaServiceDouble(limits={namespace: (3000, None, None)}).start(admission_nc)
    try:
        obj = pod(container(limits={GPU: "2", MEM: "2000"}), namespace=namespace)
        async with webhook(admission_nc, events=False) as http:
            response = await answer(http, obj)
        assert response["allowed"] is False
        message = response["status"]["message"]
        assert "exceeding resource quota" in message and namespace in message
        assert "4000 > limit 3000" in message
    finally:
        await double.stop()


async def test_quota_not_asked_for_pods_without_gpu_or_when_disabled(admission_nc, namespace):
    double = await QuotaServiceDouble(limits={namespace: (0, 0, 0)}).start(admission_nc)
    try:
        async with webhook(admission_nc, events=False) as http:
            assert (await answer(http, pod(container(), namespace=namespace)))["allowed"]
        async with webhook(admission_nc, events=False, quota_enabled=False) as http:
            gpu_pod = pod(container(limits={GPU: "1"}), namespace=namespace)
            assert (await answer(http, gpu_pod))["allowed"]
        assert double.requests == []
    finally:
        await double.stop()


async def test_silent_quota_service_denies_by_default_within_the_timeout(admission_nc, namespace):
    double = await QuotaServiceDouble(silent=True).start(admission_nc)
    try:
        async with webhook(admission_nc, timeout_s=0.2, events=False) as http:
            started = time.monotonic()
            response = await answer(http, pod(container(limits={GPU: "1"}), namespace=namespace))
            assert time.monotonic() - started < 2.0
        assert response["allowed"] is False
        assert response["status"]["code"] == 503
        assert "did not answer within 0.2 s" in response["status"]["message"]
        assert "TESSERA_QUOTA_FAILURE_POLICY=deny" in response["status"]["message"]
    finally:
        await double.stop()


async def test_silent_quota_service_with_allow_policy_admits_with_a_warning(
    admission_nc, namespace
):
    double = await QuotaServiceDouble(silent=True).start(admission_nc)
    try:
        obj = pod(container(limits={GPU: "1"}), namespace=namespace)
        async with webhook(admission_nc, timeout_s=0.2, events=False,
                           quota_failure_policy="allow") as http:
            response = await answer(http, obj)
        assert patched(obj, response)["spec"]["schedulerName"] == "tessera-scheduler"
        assert any("was not checked" in w for w in response["warnings"])
    finally:
        await double.stop()


async def test_no_quota_service_at_all_is_a_clear_denial(admission_nc, namespace):
    async with webhook(admission_nc, events=False) as http:
        response = await answer(http, pod(container(limits={GPU: "1"}), namespace=namespace))
    assert response["allowed"] is False
    assert "no quota service is running" in response["status"]["message"]


async def collect_events(nc: object, namespace: str, names: set[str]) -> list[AdmissionEvent]:
    """Events of the namespace until every pod in `names` has one (or 5 s passed)."""
    found: list[AdmissionEvent] = []
    subject = f"tessera.events.admission.{namespace}.>"

    async def read() -> None:
        async for received in subscribe(nc, subject):  # type: ignore[arg-type]
            assert isinstance(received.event, AdmissionEvent)
            found.append(received.event)
            if names <= {e.name for e in found}:
                return

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(read(), 5.0)
    return found


async def test_events_say_what_happened_and_why(admission_nc, namespace):
    double = await QuotaServiceDouble(limits={namespace: (None, None, 1)}).start(admission_nc)
    try:
        async with webhook(admission_nc) as http:
            await answer(http, pod(container(limits={GPU: "1"}), name="p1", namespace=namespace))
            await answer(http, pod(container(), name="p2", namespace=namespace))
            await answer(http, pod(container(limits={GPU: "1"}), name="p3", namespace=namespace,
                                   nodeName="n1"))
            await answer(http, pod(container(limits={GPU: "3"}), name="p4", namespace=namespace))
            await answer(http, pod(container(limits={GPU: "1"}), name="dry",
                                   namespace=namespace), dry_run=True)
            await answer(http, pod(container(), name="p5", namespace=namespace))
        events = await collect_events(admission_nc, namespace, {"p1", "p2", "p3", "p4", "p5"})
    finally:
        await double.stop()
    by_name = {e.name: e for e in events}
    assert set(by_name) == {"p1", "p2", "p3", "p4", "p5"}, "dry runs publish nothing"
    assert by_name["p1"].action == "mutated" and "schedulerName" in by_name["p1"].reason
    assert by_name["p2"].action == "allowed" and by_name["p2"].reason == "no GPU requested"
    assert by_name["p3"].action == "denied" and "spec.nodeName" in by_name["p3"].reason
    assert by_name["p4"].action == "denied" and "exceeding resource quota" in by_name["p4"].reason
    assert all(e.namespace == namespace and e.source == "admission/test" for e in events)


class HangingJetStream:
    """A broker that never acknowledges: what a stuck NATS looks like to a publisher."""

    async def publish(self, *args: object, **kwargs: object) -> None:
        await asyncio.Event().wait()


async def test_a_stuck_event_bus_never_slows_reviews_and_drops_are_counted():
    metrics = AdmissionMetrics()
    queue = EventQueue(HangingJetStream(), source="t", maxsize=8,  # type: ignore[arg-type]
                       batch_window_s=0.0, max_batch=4, on_drop=metrics.events_dropped.inc)
    app = AdmissionApp(TesseraSettings(quota_enabled=False), metrics=metrics, events=queue)
    queue.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://w") as http:
            started = time.monotonic()
            for i in range(50):
                reply = await http.post("/mutate", json=review(pod(container(), name=f"p{i}")))
                assert reply.json()["response"]["allowed"] is True
            assert time.monotonic() - started < 5.0
            metrics_text = (await http.get("/metrics")).text
    finally:
        stop_started = time.monotonic()
        await queue.stop(drain_timeout_s=0.2)
        assert time.monotonic() - stop_started < 2.0
    # Eight wait in the queue, up to a batch of four is stuck publishing, the rest were dropped.
    assert 50 - 8 - 4 <= queue.dropped <= 50 - 8
    assert f"tessera_admission_events_dropped_total {queue.dropped}.0" in metrics_text


async def test_with_nats_down_reviews_answer_at_once(fresh_nats):
    """The broker dies: GPU pods are denied (policy deny) without waiting for a timeout, pods
    without GPU are admitted, and events pile up or drop without slowing anything."""
    from tessera.bus import connect
    from tessera.settings import NatsSettings

    nc = await connect(NatsSettings(NATS_URL=fresh_nats.url), name="admission-down-test")
    try:
        async with webhook(nc, timeout_s=5.0) as http:
            fresh_nats.kill()
            deadline = time.monotonic() + 20  # the client notices the lost socket (busy host)
            while nc.is_connected:
                assert time.monotonic() < deadline, "the client never noticed NATS died"
                await asyncio.sleep(0.02)
            started = time.monotonic()
            gpu = await answer(http, pod(container(limits={GPU: "1"}), namespace="down"))
            plain = await answer(http, pod(container(), namespace="down"))
            assert time.monotonic() - started < 1.0
    finally:
        with contextlib.suppress(Exception):  # closing a client whose broker is gone
            await nc.close()
    assert gpu["allowed"] is False and "not connected to NATS" in gpu["status"]["message"]
    assert plain["allowed"] is True
