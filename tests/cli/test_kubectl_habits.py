"""kubectl's habits against a real API server double (kube-sim): apply -f DIR and multi-document
files, re-apply updates or says what cannot change, delete says when there is nothing, errors
name the file and quote the YAML's own text."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from .conftest import KubeSim

POD = """apiVersion: v1
kind: Pod
metadata:
  name: {name}
  labels:
    app: {label}
spec:
  containers:
  - name: main
    image: cuda:12
    resources:
      limits:
        cpu: "{cpu}"
"""
QUOTA = """apiVersion: v1
kind: ResourceQuota
metadata:
  name: gpu
spec:
  hard:
    limits.nvidia.com/gpumem: "{mem}"
{extra}"""


@pytest.fixture
def ns() -> str:
    return f"cli-{uuid.uuid4().hex[:8]}"


def write(directory: Path, *, label: str = "a", cpu: str = "1", mem: str = "8000",
          extra: str = "    limits.nvidia.com/gpu: \"2\"\n") -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "a.yaml").write_text(POD.format(name="p1", label=label, cpu="1") + "---\n"
                                      + QUOTA.format(mem=mem, extra=extra))
    (directory / "b.yaml").write_text(POD.format(name="p2", label="b", cpu=cpu))
    return directory


def test_apply_a_directory_then_reapply_updates_or_says_what_cannot_change(
    kube_sim: KubeSim, ns: str, tmp_path: Path
) -> None:
    manifests = write(tmp_path / "m")
    first = kube_sim.cli("apply", "-f", str(manifests), "-n", ns)
    assert first.exit_code == 0, first.output
    assert first.output.splitlines() == ["pod/p1 created", "resourcequota/gpu created",
                                         "pod/p2 created"]
    again = kube_sim.cli("apply", "-f", str(manifests), "-n", ns)
    assert again.exit_code == 0, again.output
    assert again.output.splitlines() == ["pod/p1 unchanged", "resourcequota/gpu unchanged",
                                         "pod/p2 unchanged"]

    # A label and the quota change; a pod's resources cannot.
    write(manifests, label="changed", cpu="2", mem="16000", extra="")
    changed = kube_sim.cli("apply", "-f", str(manifests), "-n", ns)
    assert changed.exit_code == 1, changed.output
    assert "pod/p1 configured" in changed.output
    assert "resourcequota/gpu configured" in changed.output
    assert f"{manifests / 'b.yaml'}:1: pod/p2: a pod's spec.containers[0].resources.limits.cpu " \
           "cannot change" in changed.output
    assert "delete it and apply again" in changed.output
    pod = kube_sim.get(f"/api/v1/namespaces/{ns}/pods/p1")
    assert pod["metadata"]["labels"] == {"app": "changed"}
    hard = kube_sim.get(f"/api/v1/namespaces/{ns}/resourcequotas/gpu")["spec"]["hard"]
    assert hard == {"limits.nvidia.com/gpumem": "16k"}, "the removed key is removed"  # 16000
    assert kube_sim.get(f"/api/v1/namespaces/{ns}/pods/p2")["spec"]["containers"][0][
        "resources"]["limits"]["cpu"] == "1"


def test_stdin_and_errors_that_quote_the_yaml(kube_sim: KubeSim, ns: str, tmp_path: Path) -> None:
    piped = kube_sim.cli("apply", "-f", "-", "-n", ns,
                         input=POD.format(name="piped", label="x", cpu="1"))
    assert piped.exit_code == 0 and "pod/piped created" in piped.output, piped.output

    bad = tmp_path / "bad.yaml"
    bad.write_text(POD.format(name="fine", label="x", cpu="1") + "---\n"
                   "apiVersion: v1\nkind: Pod\nmetadata:\n  name: broken\nspec:\n"
                   '  containers: "not a list"\n'
                   "---\napiVersion: v1\nkind: Frobnicator\nmetadata:\n  name: f\n")
    result = kube_sim.cli("apply", "-f", str(bad), "-n", ns)
    assert result.exit_code == 1
    assert "pod/fine created" in result.output
    # The server's own words, where in the file, and the line itself.
    assert (f'{bad}:15: pod/broken: Pod "broken" is invalid: spec.containers: Required value'
            in result.output), \
        result.output
    assert f'{bad}:20: "containers: "not a list""' in result.output
    assert f'{bad}:22: no matches for kind "Frobnicator" in version "v1"' in result.output
    assert '"kind: Frobnicator"' in result.output

    syntax = tmp_path / "syntax.yaml"
    syntax.write_text("kind: Pod\nmetadata:\n  name: x\n  labels: a: b\n")
    result = kube_sim.cli("apply", "-f", str(syntax), "-n", ns)
    assert result.exit_code == 1
    assert f'{syntax}:4: invalid YAML' in result.output and '"labels: a: b"' in result.output


def test_get_and_delete_say_when_there_is_nothing(
    kube_sim: KubeSim, ns: str, tmp_path: Path
) -> None:
    empty = kube_sim.cli("get", "pods", "-n", ns)
    assert empty.exit_code == 0 and f"No resources found in {ns} namespace." in empty.output
    nothing = kube_sim.cli("delete", "pod", "--all", "-n", ns)
    assert nothing.exit_code == 0 and f"No resources found in {ns} namespace." in nothing.output
    missing = kube_sim.cli("delete", "pod", "ghost", "-n", ns)
    assert missing.exit_code == 1
    assert 'Error from server (NotFound): pods "ghost" not found' in missing.output
    assert kube_sim.cli("delete", "pod", "ghost", "-n", ns, "--ignore-not-found").exit_code == 0
    noname = kube_sim.cli("delete", "pod", "-n", ns)
    assert noname.exit_code == 1 and "no name was specified" in noname.output

    manifests = write(tmp_path / "m")
    assert kube_sim.cli("apply", "-f", str(manifests), "-n", ns).exit_code == 0
    listing = kube_sim.cli("get", "pods", "-n", ns)
    assert listing.output.splitlines()[0].split() == ["NAME", "STATUS", "NODE", "GPUS", "REASON"]
    assert {line.split()[0] for line in listing.output.splitlines()[1:]} == {"p1", "p2"}
    as_json = json.loads(kube_sim.cli("get", "pods", "p1", "-n", ns, "-o", "json").output)
    assert [p["name"] for p in as_json] == ["p1"]
    assert "limits.nvidia.com/gpumem=8k" in kube_sim.cli("get", "quota", "-n", ns).output  # 8000

    deleted = kube_sim.cli("delete", "-f", str(manifests), "-n", ns)
    assert deleted.exit_code == 0, deleted.output
    assert deleted.output.splitlines() == ['pod "p1" deleted', 'resourcequota "gpu" deleted',
                                           'pod "p2" deleted']
    twice = kube_sim.cli("delete", "-f", str(manifests), "-n", ns)
    assert twice.exit_code == 1 and twice.output.count("NotFound") == 3
