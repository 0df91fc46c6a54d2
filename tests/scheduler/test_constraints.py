"""The node constraints /bind re-checks, table-driven against Kubernetes' documented semantics."""

from __future__ import annotations

from typing import Any

import pytest
from tessera.scheduler.constraints import node_constraint_problem


def node(labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
         unschedulable: bool = False) -> dict[str, Any]:  # fmt: skip
    return {"metadata": {"name": "gpu-1", "labels": labels or {}},
            "spec": {"taints": taints or [], "unschedulable": unschedulable}}  # fmt: skip


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": spec}


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}}}  # fmt: skip


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": operator, "values": list(values)}]}


NO_SCHEDULE = {"key": "dedicated", "value": "infer", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("spec", "target", "allowed"),
    [
        ({}, node(), True),
        ({"nodeSelector": {"pool": "a"}}, node({"pool": "a"}), True),
        ({"nodeSelector": {"pool": "a"}}, node({"pool": "b"}), False),
        ({"nodeSelector": {"pool": "a"}}, node(), False),
        ({"affinity": required(expr("pool", "In", "a", "b"))}, node({"pool": "b"}), True),
        ({"affinity": required(expr("pool", "In", "a"))}, node({"pool": "b"}), False),
        ({"affinity": required(expr("pool", "NotIn", "a"))}, node(), True),
        ({"affinity": required(expr("gpu", "Exists"))}, node({"gpu": "x"}), True),
        ({"affinity": required(expr("gpu", "DoesNotExist"))}, node({"gpu": "x"}), False),
        ({"affinity": required(expr("mem", "Gt", "40"))}, node({"mem": "80"}), True),
        ({"affinity": required(expr("mem", "Lt", "40"))}, node({"mem": "80"}), False),
        # Terms are OR'ed.
        ({"affinity": required(expr("pool", "In", "x"), expr("pool", "In", "a"))},
         node({"pool": "a"}), True),
        ({"affinity": required({"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": ["gpu-1"]}]})}, node(), True),
        ({"affinity": required({"matchFields": [
            {"key": "metadata.name", "operator": "NotIn", "values": ["gpu-1"]}]})}, node(), False),
        ({}, node(taints=[NO_SCHEDULE]), False),
        ({}, node(taints=[{**NO_SCHEDULE, "effect": "PreferNoSchedule"}]), True),
        ({}, node(taints=[{**NO_SCHEDULE, "effect": "NoExecute"}]), False),
        ({"tolerations": [{"key": "dedicated", "operator": "Equal", "value": "infer"}]},
         node(taints=[NO_SCHEDULE]), True),
        ({"tolerations": [{"key": "dedicated", "value": "train"}]}, node(taints=[NO_SCHEDULE]),
         False),
        ({"tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}]},
         node(taints=[NO_SCHEDULE]), False),
        ({"tolerations": [{"operator": "Exists"}]}, node(taints=[NO_SCHEDULE]), True),
        ({}, node(unschedulable=True), False),
    ],
)  # fmt: skip
def test_node_constraints(spec: dict[str, Any], target: dict[str, Any], allowed: bool) -> None:
    problem = node_constraint_problem(pod(**spec), target)
    assert (problem is None) == allowed, problem
