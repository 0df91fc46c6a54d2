"""`tessera apply` takes every kind the API server serves (found through its discovery, as
kubectl finds them), and skips a kubeconfig found in a directory with a note."""

from __future__ import annotations

import uuid
from pathlib import Path

from .conftest import KubeSim

PRIORITY = """apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata:
  name: {name}
value: 1000
description: training jobs
"""
CONFIGMAP = """apiVersion: v1
kind: ConfigMap
metadata:
  name: settings
data:
  mode: fast
"""
KUBECONFIG = """apiVersion: v1
kind: Config
clusters: []
contexts: []
users: []
"""


def test_kinds_from_discovery_are_applied_and_a_kubeconfig_is_skipped(
    kube_sim: KubeSim, tmp_path: Path
) -> None:
    ns, name = f"cli-{uuid.uuid4().hex[:8]}", f"high-{uuid.uuid4().hex[:6]}"
    (tmp_path / "a-priority.yaml").write_text(PRIORITY.format(name=name))
    (tmp_path / "b-config.yaml").write_text(CONFIGMAP)
    (tmp_path / "c-kubeconfig.yaml").write_text(KUBECONFIG)
    first = kube_sim.cli("apply", "-f", str(tmp_path), "-n", ns)
    assert first.exit_code == 0, first.output
    lines = first.output.splitlines()
    assert lines[:2] == [f"priorityclass/{name} created", "configmap/settings created"], lines
    assert lines[2].startswith("skipped ") and "c-kubeconfig.yaml" in lines[2]
    assert "a kubeconfig" in lines[2]
    stored = kube_sim.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
    assert stored["value"] == 1000
    assert kube_sim.get(f"/api/v1/namespaces/{ns}/configmaps/settings")["data"] == {"mode": "fast"}
    again = kube_sim.cli("apply", "-f", str(tmp_path / "a-priority.yaml"), "-n", ns)
    assert again.exit_code == 0 and again.output.strip() == f"priorityclass/{name} unchanged"


def test_a_kind_the_server_does_not_serve_is_refused_in_one_line(
    kube_sim: KubeSim, tmp_path: Path
) -> None:
    manifest = tmp_path / "widget.yaml"
    manifest.write_text("apiVersion: example.com/v1\nkind: Widget\nmetadata:\n  name: w\n")
    result = kube_sim.cli("apply", "-f", str(manifest))
    assert result.exit_code == 1
    assert 'no matches for kind "Widget" in version "example.com/v1"' in result.output
    assert "Traceback" not in result.output


def test_get_and_delete_find_a_kind_through_discovery(kube_sim: KubeSim, tmp_path: Path) -> None:
    name = f"pc-{uuid.uuid4().hex[:6]}"
    (tmp_path / "pc.yaml").write_text(PRIORITY.format(name=name))
    assert kube_sim.cli("apply", "-f", str(tmp_path / "pc.yaml")).exit_code == 0
    for resource in ("priorityclasses", "pc", "priorityclass.scheduling.k8s.io"):
        listed = kube_sim.cli("get", resource, name, "-o", "name")
        assert listed.exit_code == 0 and listed.output.strip() == f"priorityclass/{name}", \
            listed.output  # fmt: skip
    unknown = kube_sim.cli("get", "widgets")
    assert unknown.exit_code == 1 and 'resource type "widgets"' in unknown.output
    deleted = kube_sim.cli("delete", "pc", name)
    assert deleted.exit_code == 0 and f'priorityclass "{name}" deleted' in deleted.output
