"""`tessera apply` asks the API server for strict field validation, as kubectl does by default:
a misspelt field is refused naming it, and nothing is created without its meaning."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

TYPO = """apiVersion: v1
kind: Pod
metadata:
  name: typo
spec:
  containers:
  - name: main
    image: cuda:12
    resources:
      limit:
        nvidia.com/gpu: 1
"""


@pytest.fixture
def ns() -> str:
    return f"cli-{uuid.uuid4().hex[:8]}"


def test_a_misspelt_field_is_refused_naming_it(kube_sim, ns: str, tmp_path: Path) -> None:
    manifest = tmp_path / "typo.yaml"
    manifest.write_text(TYPO)
    result = kube_sim.cli("apply", "-f", str(manifest), "-n", ns)
    assert result.exit_code == 1, result.output
    assert ('Pod in version "v1" cannot be handled as a Pod: strict decoding error: unknown '
            'field "spec.containers[0].resources.limit"') in result.output
    assert kube_sim.get(f"/api/v1/namespaces/{ns}/pods")["items"] == []
    manifest.write_text(TYPO.replace("limit:", "limits:"))
    fixed = kube_sim.cli("apply", "-f", str(manifest), "-n", ns)
    assert fixed.exit_code == 0 and "pod/typo created" in fixed.output, fixed.output
