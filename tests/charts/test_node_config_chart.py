"""The node agent chart renders the per-node device configuration (ConfigMap
tessera-node-config, HAMi's `nodeconfig` fields) from values, lints and validates with it, and
the agents get what they need to follow it (its namespace, read access to ConfigMaps there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tessera.node_agent.node_config_rules import NodeConfigError, parse_config_map

from tessera.models import NODE_CONFIG_MAP
from tests.charts.test_charts import (  # noqa: F401 - charts_dir is the fixture
    KUBE_VERSIONS,
    NAMESPACE,
    charts_dir,
    container,
    env_of,
    find,
    lint_problems,
    render,
    validate_all,
)

CHART = "tessera-node-agent"
VALUES = {
    "nodeConfig": {
        "defaults": {"devicesplitcount": 8, "devicememoryscaling": 1},
        "nodes": [
            {"name": "gpu-a", "devicesplitcount": 2, "operatingmode": "hami-core",
             "filterdevices": {"uuid": ["GPU-0b1c"], "index": [3]}},
            {"name": "gpu-b", "devicecorescaling": 1},
        ],
    }
}


def test_configmap_renders_from_values_and_the_agent_reads_it(charts_dir: Path) -> None:  # noqa: F811
    manifests = render(charts_dir, CHART, VALUES)
    config_map = find(manifests, "ConfigMap", NODE_CONFIG_MAP)
    assert config_map["metadata"]["namespace"] == NAMESPACE
    parsed = parse_config_map(config_map)  # what the agent itself will read
    assert parsed.defaults.devicesplitcount == 8
    assert [(e.name, e.devicesplitcount) for e in parsed.nodeconfig] == [("gpu-a", 2),
                                                                        ("gpu-b", None)]
    assert parsed.nodeconfig[0].filterdevices.index == [3]
    for kube_version in KUBE_VERSIONS:
        assert lint_problems(charts_dir / CHART, VALUES, kube_version) == []
        validate_all(manifests, kube_version)
    agent = container(find(manifests, "DaemonSet"), "node-agent")
    namespace = env_of(agent)["TESSERA_NODE_CONFIG_NAMESPACE"]
    assert namespace == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    role = find(manifests, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE  # this namespace's ConfigMaps only
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                              "verbs": ["get", "list", "watch"]}]


def test_defaults_render_an_empty_config_the_agent_accepts(charts_dir: Path) -> None:  # noqa: F811
    config_map = find(render(charts_dir, CHART), "ConfigMap", NODE_CONFIG_MAP)
    assert json.loads(config_map["data"]["config.json"]) == {"defaults": {}, "nodeconfig": []}
    parsed = parse_config_map(config_map)
    assert parsed.nodeconfig == []


def test_a_bad_value_renders_but_the_agent_rejects_it_with_the_field(charts_dir: Path) -> None:  # noqa: F811
    bad = {"nodeConfig": {"nodes": [{"name": "gpu-a", "devicesplitcount": -1}]}}
    config_map = find(render(charts_dir, CHART, bad), "ConfigMap", NODE_CONFIG_MAP)
    with pytest.raises(NodeConfigError, match="devicesplitcount"):
        parse_config_map(config_map)


def test_an_entry_without_a_name_fails_the_render(charts_dir: Path) -> None:  # noqa: F811
    with pytest.raises(Exception, match="every entry needs a name"):
        render(charts_dir, CHART, {"nodeConfig": {"nodes": [{"devicesplitcount": 2}]}})
