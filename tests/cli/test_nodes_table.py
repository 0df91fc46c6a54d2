"""`tessera get nodes` shows each node's GPUs and what the pods there hold; rich tables print as
plain aligned columns off a terminal."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from tessera.hami import ANN_DEVICES_ALLOCATED, encode_node_register
from tessera.models import DeviceInfo
from tessera_cli.nodes import nodes_table, summarise
from tessera_cli.plain_tables import show


def gpu_node(name: str, unhealthy: int | None = None) -> dict:
    devices = [DeviceInfo(uuid=f"GPU-{name}-{i}", index=i, type="NVIDIA-A10", memory_mib=24576,
                          healthy=i != unhealthy) for i in range(2)]  # fmt: skip
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z",
                         "annotations": {"hami.io/node-nvidia-register":
                                         encode_node_register(devices)}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip


def gpu_pod(node: str, grants: str, phase: str = "Running", inits: int = 0) -> dict:
    return {"metadata": {"annotations": {ANN_DEVICES_ALLOCATED: grants}},
            "spec": {"nodeName": node, "initContainers": [{}] * inits},
            "status": {"phase": phase}}  # fmt: skip


def test_nodes_show_gpu_count_memory_cores_mode_and_health() -> None:
    pods = [
        gpu_pod("n1", "GPU-n1-0,NVIDIA-A10,3000,30:;"),
        gpu_pod("n1", "GPU-n1-0,NVIDIA-A10,1000,10:;"),
        # Not running yet: its init container's 8000 MiB counts (larger than the app's 2000).
        gpu_pod("n1", "GPU-n1-1,NVIDIA-A10,8000,0:;GPU-n1-1,NVIDIA-A10,2000,20:;", "Pending", 1),
        gpu_pod("n1", "GPU-n1-1,NVIDIA-A10,9999,99:;", "Succeeded"),  # finished: holds nothing
    ]
    summaries = summarise([gpu_node("n1"), gpu_node("n2", unhealthy=1),
                           {"metadata": {"name": "cpu-only"}}], pods)  # fmt: skip
    n1 = summaries[0]
    assert (n1["memory_used_mib"], n1["memory_mib"]) == (12000, 49152)
    assert (n1["cores_used"], n1["cores"]) == (60, 200)
    assert [g["pods"] for g in n1["gpus"]] == [2, 1] and n1["gpu_pods"] == 3
    lines = nodes_table(summaries).splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "GPUS", "MEMORY", "(MiB)", "CORES", "MODE",
                                "HEALTH"]  # fmt: skip
    assert lines[1].split() == ["n1", "Ready", "2", "12000/49152", "60/200%", "hami-core",
                                "healthy"]  # fmt: skip
    assert lines[2].split()[-1] == "unhealthy" and lines[2].split()[-2] == "1"
    assert lines[3].split() == ["cpu-only", "Unknown", "0", "-", "-", "-", "-"]
    wide = nodes_table(summaries, wide=True).splitlines()
    assert "TYPE" in wide[0] and "NVIDIA-A10" in wide[1] and "2026-01-01T00:00:00Z" in wide[1]


def test_a_rich_table_off_a_terminal_is_plain_columns_without_wrapping() -> None:
    table = Table(title="GPU quotas")
    for column in ("namespace", "memory used / limit", "pods"):
        table.add_column(column)
    long_name = "a-namespace-with-a-name-much-longer-than-eighty-columns-would-allow-" * 2
    table.add_row(long_name, "[green]3,000 MiB[/green] / 8,000 MiB (38%)", "1")
    out = io.StringIO()
    show(Console(file=out, width=80), table)  # a StringIO is no terminal
    lines = out.getvalue().splitlines()
    assert lines[0] == "GPU quotas"
    assert lines[1] == "NAMESPACE".ljust(len(long_name)) + "   MEMORY USED / LIMIT" + " " * (
        len("3,000 MiB / 8,000 MiB (38%)") - len("MEMORY USED / LIMIT")) + "   PODS"
    assert lines[2] == f"{long_name}   3,000 MiB / 8,000 MiB (38%)   1"
    assert len(lines) == 3

