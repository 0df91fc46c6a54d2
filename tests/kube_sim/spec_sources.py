"""Every pod spec a user can copy from the repository: examples/ (with sub-folders), the charts'
example and verify manifests (charts/**, Helm templates excepted), and the YAML snippets of the
README files and docs/ that are pods or workloads (their pod template)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job"}
_SNIPPET = re.compile(r"```ya?ml\n(.*?)```", re.S)


@dataclass(frozen=True)
class PodSpec:
    source: str  # path[:document] the user copies it from
    name: str
    pod: dict[str, Any]  # a Pod (a workload's template made into one)


def _pods_of(doc: Any, source: str) -> list[PodSpec]:
    if not isinstance(doc, dict):
        return []
    kind = doc.get("kind")
    name = str((doc.get("metadata") or {}).get("name") or "unnamed")
    if kind == "Pod":
        return [PodSpec(source, name, doc)]
    if kind in WORKLOADS:
        template = (doc.get("spec") or {}).get("template") or {}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**(template.get("metadata") or {}), "name": name},
               "spec": template.get("spec") or {}}
        return [PodSpec(source, name, pod)]
    return []


def _documents(text: str, source: str) -> list[PodSpec]:
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return []  # not YAML a user can apply (a values excerpt, a Helm template)
    return [spec for index, doc in enumerate(docs)
            for spec in _pods_of(doc, f"{source}:{index}")]


def pod_specs() -> list[PodSpec]:
    found: list[PodSpec] = []
    files = sorted({*ROOT.glob("examples/**/*.yaml"), *ROOT.glob("charts/**/*.yaml")})
    for path in files:
        if "templates" in path.parts:
            continue  # Helm templates are not manifests until rendered
        found += _documents(path.read_text(), str(path.relative_to(ROOT)))
    readmes = sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("*/*/README.md"),
                      *ROOT.glob("*/README.md")})
    for path in readmes:
        for number, match in enumerate(_SNIPPET.finditer(path.read_text())):
            found += _documents(match.group(1), f"{path.relative_to(ROOT)}#yaml{number}")
    return found
