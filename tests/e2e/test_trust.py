"""Trust boundaries on the local stack: the extender answers only the holder of the client
certificate (kube-sim, as kube-scheduler), and garbage written into a node's ledger key neither
loses its running pod's allocation nor keeps the node from taking new pods."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tessera import hami, signing
from tessera.bus import connect, ensure_bus
from tessera.codec import decode
from tessera.models import NodeLedger
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.stack import EXTENDER_CLIENT_NAME, SimNode

from .conftest import RunningStack, gpu_pod, start_stack

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NODE = "trust-a"


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningStack]:
    yield from start_stack([SimNode(name=NODE, gpus=1, gpu_memory_mib=24576,
                                    gpu_model="NVIDIA A10")])  # fmt: skip


def test_the_extender_refuses_callers_without_the_client_certificate(sim: RunningStack) -> None:
    certs = sim.stack.state_dir / "certs"
    url = f"https://127.0.0.1:{sim.stack.ports.scheduler}"
    made_up = gpu_pod("made-up", mem=1000)
    made_up["metadata"].update(namespace="default", uid="00000000-made-up")
    body = {"pod": made_up, "nodenames": [NODE]}
    anonymous = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"{url}/filter", json=body, verify=anonymous, timeout=5)
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{sim.stack.ports.scheduler}/filter", json=body, timeout=5)
    kube_scheduler = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    kube_scheduler.load_cert_chain(certs / f"{EXTENDER_CLIENT_NAME}.crt",
                                   certs / f"{EXTENDER_CLIENT_NAME}.key")  # fmt: skip
    # With the certificate the call is answered; the made-up pod still holds nothing.
    reply = httpx.post(f"{url}/filter", json=body, verify=kube_scheduler, timeout=5)
    assert reply.status_code == 200
    assert "does not exist in the cluster" in reply.json()["failedAndUnresolvableNodes"][NODE]


async def ledger_of(nats: NatsSettings, write_garbage: bool = False) -> NodeLedger:
    nc = await connect(nats, name="e2e-trust")
    try:
        buckets = await ensure_bus(nc.jetstream(), TesseraSettings())
        if write_garbage:
            await buckets.ledger.put(NODE, b"\xc1not a ledger")
        entry = await buckets.ledger.get(NODE)
        return decode(entry.value, NodeLedger) if not write_garbage else NodeLedger(node=NODE)
    finally:
        await nc.close()


def test_garbage_in_a_ledger_key_is_repaired_and_the_node_keeps_scheduling(
    sim: RunningStack, namespace: str
) -> None:
    # Garbage written with the scheduler's own identity: authorised, so only validation stops it.
    scheduler = sim.stack.nats_settings("scheduler")
    first = sim.kube.create_pod(gpu_pod("before", mem=8000, cores=30, node=NODE), namespace)
    assert first.status_code == 201, first.text
    running = sim.kube.wait_running(namespace, "before")
    uid = running["metadata"]["uid"]
    asyncio.run(ledger_of(scheduler, write_garbage=True))
    # A new pod on the same node is placed once the key is repaired (kube-sim retries).
    second = sim.kube.create_pod(gpu_pod("after", mem=8000, cores=30, node=NODE), namespace)
    assert second.status_code == 201, second.text
    sim.kube.wait_running(namespace, "after", timeout_s=40)
    ledger = asyncio.run(ledger_of(scheduler))
    assert uid in ledger.allocations, "the running pod lost its allocation"
    assert ledger.allocations[uid].containers[0][0].memory_mib == 8000
    certs = sim.stack.state_dir / "certs"
    client = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    client.load_cert_chain(certs / f"{EXTENDER_CLIENT_NAME}.crt",
                           certs / f"{EXTENDER_CLIENT_NAME}.key")  # fmt: skip
    metrics = httpx.get(f"https://127.0.0.1:{sim.stack.ports.scheduler}/metrics", verify=client,
                        timeout=5).text  # fmt: skip
    assert 'tessera_bus_rejected_total{reason="undecodable",source="ledger"}' in metrics
    # 8000 + 8000 of 24576 MiB: a third 10 GiB slice cannot fit, so no double allocation.
    third = sim.kube.create_pod(gpu_pod("too-big", mem=10000, cores=10, node=NODE), namespace)
    assert third.status_code == 201, third.text
    with pytest.raises(AssertionError):
        sim.kube.wait_running(namespace, "too-big", timeout_s=5)
    sim.kube.delete_namespace_pods(namespace)


def test_a_tenant_cannot_forge_the_allocation_but_tessera_records_it(
    sim: RunningStack, namespace: str
) -> None:
    """kube-sim runs admission on UPDATE and pods/status with each client's identity: the
    scheduler and the node agent (their own service accounts) recorded the grant; the real
    kubectl cannot change it (over plain HTTP kubectl sends no token: it is system:anonymous;
    the tenant's token itself: kube_sim/test_update_admission.py) (issue 34)."""
    created = sim.kube.create_pod(gpu_pod("recorded", mem=4000, cores=10, node=NODE), namespace)
    assert created.status_code == 201, created.text
    sim.kube.wait_running(namespace, "recorded")
    annotations = sim.kube.wait_for(
        "the node agent's signed record",
        lambda: (a := sim.kube.pod(namespace, "recorded")["metadata"]["annotations"])
        and signing.RECORD_ANNOTATION in a and a,
    )
    recorded = annotations[hami.ANN_DEVICES_ALLOCATED]
    assert hami.decode_pod_devices(recorded)[0][0].memory_mib == 4000
    kubectl = str(Path(sys.executable).parent / "kubectl")
    forged = recorded.replace(",4000,", ",24576,")
    for who in ("kubeconfig-tenant", "kubeconfig"):
        config = str(sim.stack.state_dir / who)
        for args in (
            ["annotate", "--overwrite", "pod", "recorded",
             f"{hami.ANN_DEVICES_ALLOCATED}={forged}"],
            ["patch", "pod", "recorded", "--subresource=status", "--type=merge", "-p",
             f'{{"metadata":{{"annotations":{{"{hami.ANN_DEVICES_ALLOCATED}":"{forged}"}}}}}}'],
        ):
            result = subprocess.run([kubectl, "--kubeconfig", config, "-n", namespace, *args],
                                    capture_output=True, text=True, timeout=60)
            assert result.returncode != 0, (who, args, result.stdout)
            assert 'admission webhook "vgpu.tessera.io" denied the request' in result.stderr
            assert f"{hami.ANN_DEVICES_ALLOCATED} are written only by" in result.stderr
    after = sim.kube.pod(namespace, "recorded")["metadata"]["annotations"]
    assert after[hami.ANN_DEVICES_ALLOCATED] == recorded
