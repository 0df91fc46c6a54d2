"""The chart values docs/migrating-from-hami.md tells an operator to set, rendered: HAMi's `gpu=on`
label is the node agent's default, the migration values move the agent onto a label of its own
(tolerating the taint that keeps HAMi's scheduler off migrated nodes), and the extra webhook
condition lets HAMi's components keep writing their pods' annotations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_charts import charts_dir, find, render  # noqa: F401 - the fixture

HAMI_SKIP = ("request.operation != 'UPDATE' || !request.userInfo.username.startsWith("
             "'system:serviceaccount:kube-system:hami')")  # fmt: skip
MIGRATION_VALUES: dict[str, Any] = {
    "nodeAgent": {
        # Helm merges maps: HAMi's label must be removed (null), not just another one added.
        "nodeSelector": {"gpu": None, "tessera.io/node-agent": "true"},
        "tolerations": [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "tessera.io/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
    },
    "admission": {"webhook": {"matchConditions": [
        {"name": "skip-hami-component-updates", "expression": HAMI_SKIP}]}},
}


def agent_spec(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "DaemonSet")["spec"]["template"]["spec"]


def test_node_agent_selects_hamis_gpu_label_by_default(charts_dir: Path) -> None:  # noqa: F811
    spec = agent_spec(render(charts_dir, "tessera-node-agent"))
    assert spec["nodeSelector"] == {"gpu": "on"}


def test_migration_values_render_as_the_guide_says(charts_dir: Path) -> None:  # noqa: F811
    manifests = render(charts_dir, "tessera", MIGRATION_VALUES)
    spec = agent_spec(manifests)
    assert spec["nodeSelector"] == {"tessera.io/node-agent": "true"}
    assert {"key": "tessera.io/gpu", "operator": "Exists", "effect": "NoSchedule"} in (
        spec["tolerations"])
    (webhook,) = find(manifests, "MutatingWebhookConfiguration")["webhooks"]
    names = [c["name"] for c in webhook["matchConditions"]]
    assert names == ["skip-tessera-component-updates",
                     "subresource-updates-that-change-annotations", "skip-hami-component-updates"]
    assert webhook["matchConditions"][2]["expression"] == HAMI_SKIP
