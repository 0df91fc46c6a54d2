"""Manifests as `kubectl apply -f` reads them: directories, several documents, errors that name
the file and line and quote the YAML's own text."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera_cli.apply import diff_paths, merge_patch, quote_for, subset_diff
from tessera_cli.manifests import ManifestError, check, load, parse

POD = """apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  containers:
  - name: main
    image: cuda
"""


def test_a_directory_applies_its_yaml_files_in_name_order_with_every_document(
    tmp_path: Path,
) -> None:
    (tmp_path / "b.yaml").write_text(POD.format(name="b1") + "---\n" + POD.format(name="b2"))
    (tmp_path / "a.yml").write_text("# a comment\n" + POD.format(name="a1"))
    (tmp_path / "notes.txt").write_text("not a manifest")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.yaml").write_text(POD.format(name="c1"))
    manifests = load([str(tmp_path)])
    assert [m.name for m in manifests] == ["a1", "b1", "b2"]
    assert [m.line for m in manifests] == [2, 1, 10]
    assert manifests[2].where == f"{tmp_path / 'b.yaml'}:10"
    assert [m.name for m in load([str(tmp_path)], recursive=True)][-1] == "c1"


def test_a_list_and_empty_documents() -> None:
    text = "---\n---\nkind: List\nitems:\n- kind: Pod\n  metadata: {name: x}\n"
    assert [(m.kind, m.name) for m in parse("f.yaml", text)] == [("Pod", "x")]


def test_a_yaml_error_names_the_file_and_line_and_quotes_the_text() -> None:
    bad = POD.format(name="ok") + "---\n" + "kind: Pod\nmetadata:\n  name: x\n  labels: a: b\n"
    with pytest.raises(ManifestError) as caught:
        parse("pods.yaml", bad)
    message = str(caught.value)
    assert message.startswith("pods.yaml:13: invalid YAML"), message
    assert '"labels: a: b"' in message


def test_objects_without_kind_or_name_are_refused_with_their_place(tmp_path: Path) -> None:
    [nameless] = parse("p.yaml", "apiVersion: v1\nkind: Pod\nmetadata:\n  labels: {}\n")
    with pytest.raises(ManifestError, match=r"p.yaml:1: Pod has no metadata.name"):
        check(nameless)
    [kindless] = parse("q.yaml", "\n\nmetadata:\n  name: x\n")
    with pytest.raises(ManifestError, match=r'q.yaml:3: the object has no kind \("metadata:"\)'):
        check(kindless)
    with pytest.raises(ManifestError, match="does not exist"):
        load([str(tmp_path / "missing.yaml")])


def test_changes_are_named_by_field_path() -> None:
    old = {"metadata": {"name": "p", "labels": {"a": "1"}},
           "spec": {"containers": [{"name": "m", "resources": {"limits": {"x": 1}}}]}}
    new = {"metadata": {"name": "p", "labels": {"a": "2"}},
           "spec": {"containers": [{"name": "m", "resources": {"limits": {"x": 2}}}]}}
    assert diff_paths(old, new) == ["metadata.labels.a", "spec.containers[0].resources.limits.x"]
    assert diff_paths(old, old) == []
    server = {**old, "status": {"phase": "Running"}, "spec": {**old["spec"], "nodeName": "n"}}
    assert subset_diff(old, server) == []  # what the server added is no change
    assert merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 1, "d": 3}, "e": 4}) == {
        "a": None, "b": {"d": 3}, "e": 4}


def test_a_refusal_quotes_the_line_it_is_about() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "06-quota-denied.yaml"
    [manifest] = load([str(example)])
    denial = ("exceeding resource quota in namespace team-a: gpumem 0 used + 10000 requested "
              "> 8000 MiB limit")
    assert quote_for(manifest, denial) == f'{example}:16: "nvidia.com/gpumem: 5000"'
    field = 'spec.containers[0].resources.limits[nvidia.com/gpucores]: Invalid value: "x"'
    assert quote_for(manifest, field) == f'{example}:17: "nvidia.com/gpucores: 10"'
    assert quote_for(manifest, "something else entirely") == ""
