"""Spill to host memory in the metrics service (docs/elastic.md, "Spilling to host memory"):
what a container spilled and its bound, apart from the device series (spilled memory is in no
device's used and never borrowed); a container that may not spill has no series."""

from __future__ import annotations

from metrics_testkit import allocation, ledger, registration, usage
from tessera.metrics.view import ClusterView
from test_view import NOW, expose

from tessera.models import ContainerUsage, DeviceUsage

GIB = 1 << 30


def _view() -> ClusterView:
    view = ClusterView()
    view.put_node("n1", registration("n1", gpus=1, memory_mib=16384))
    spiller = allocation("n1", "team-a", "train", [[("GPU-n1-0", 4096, 20)]], names=["main"])
    hard = allocation("n1", "team-b", "infer", [[("GPU-n1-0", 4096, 20)]], names=["main"])
    view.put_ledger("n1", ledger("n1", spiller, hard))
    view.put_usage(usage("n1", NOW, [
        ContainerUsage(pod_uid=spiller.pod_uid, namespace="team-a", pod="train",
                       container="main", spilled_bytes=3 * GIB, spill_limit_bytes=16 * GIB,
                       devices=[DeviceUsage(uuid="GPU-n1-0", used_bytes=4 * GIB,
                                            limit_bytes=4 * GIB)]),
        ContainerUsage(pod_uid=hard.pod_uid, namespace="team-b", pod="infer", container="main",
                       devices=[DeviceUsage(uuid="GPU-n1-0", used_bytes=GIB,
                                            limit_bytes=4 * GIB)]),
    ]), NOW)  # fmt: skip
    return view


def test_spilled_memory_is_its_own_series() -> None:
    m = expose(_view())
    train = {"namespace": "team-a", "pod": "train", "container": "main"}
    assert m.value("tessera_container_spill_bytes", kind="spilled", **train) == 3 * GIB
    assert m.value("tessera_container_spill_bytes", kind="limit", **train) == 16 * GIB
    assert m.value("tessera_container_memory_bytes", kind="used", **train) == 4 * GIB
    assert m.value("tessera_container_memory_bytes", kind="borrowed", **train) is None
    infer = {"namespace": "team-b", "pod": "infer", "container": "main"}
    assert m.value("tessera_container_spill_bytes", kind="spilled", **infer) is None
