"""The charts' side of docs/security.md: NATS auth and TLS on by default with one identity per
service and per node agent (Secrets named as `tessera nats-config` writes them), and the
NetworkPolicies that admit only Tessera's pods to NATS and nobody to the extender's port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from test_charts import (
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    charts_dir,  # noqa: F401 - the fixture
    container,
    env_of,
    find,
    lint_problems,
    render,
    validate_all,
)

from tessera import bus_permissions as bp
from tessera_cli.nats_config import secret_name

SERVICES = {"admission": bp.ADMISSION, "scheduler": bp.SCHEDULER, "quota": bp.QUOTA,
            "metrics": bp.METRICS}
CONTAINER = {"admission": "admission", "scheduler": "extender", "quota": "quota",
             "metrics": "metrics"}


def workloads(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] in ("Deployment", "DaemonSet")]


@pytest.mark.parametrize("chart", SERVICES)
def test_each_service_has_its_own_identity_and_tls_by_default(charts_dir: Path,  # noqa: F811
                                                               chart: str) -> None:
    manifests = render(charts_dir, f"tessera-{chart}")
    workload = find(manifests, "Deployment")
    env = env_of(container(workload, CONTAINER[chart]))
    own = secret_name(bp.permissions(SERVICES[chart]))  # what `tessera nats-config` writes
    assert env["NATS_USER"] == {"secretKeyRef": {"name": own, "key": "user"}}
    assert env["NATS_PASSWORD"] == {"secretKeyRef": {"name": own, "key": "password"}}
    assert env["NATS_URL"].startswith("tls://")
    assert env["NATS_TLS_CA"] == "/etc/tessera/nats-tls/ca.crt"
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    assert volumes["nats-tls"]["secret"]["secretName"] == "tessera-nats-ca"


def test_umbrella_refuses_one_shared_credential(charts_dir: Path) -> None:  # noqa: F811
    shared = {"global": {"nats": {"auth": {"type": "userPassword",
                                           "existingSecret": "everyone"}}}}
    with pytest.raises(helm.errors.HelmRenderError, match="one NATS identity"):
        render(charts_dir, "tessera", shared)


def test_one_daemonset_per_listed_node_with_that_nodes_secret(charts_dir: Path) -> None:  # noqa: F811
    nodes = ["gpu-1", "gpu.zone-b.2"]
    values = {"nodes": nodes}
    manifests = render(charts_dir, "tessera-node-agent", values)
    daemonsets = [m for m in manifests if m["kind"] == "DaemonSet"]
    assert len(daemonsets) == len(nodes)
    selectors = set()
    for node, daemonset in zip(nodes, daemonsets, strict=True):
        assert daemonset["metadata"]["annotations"]["tessera.io/node"] == node
        spec = daemonset["spec"]["template"]["spec"]
        (term,) = spec["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert term == {"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}
        env = env_of(container(daemonset, "node-agent"))
        own = secret_name(bp.permissions(bp.NODE_AGENT, node))
        assert env["NATS_PASSWORD"] == {"secretKeyRef": {"name": own, "key": "password"}}
        # The user names the node the pod runs on: the server grants it only that node.
        names = [e["name"] for e in container(daemonset, "node-agent")["env"]]
        assert names.index("TESSERA_NODE_NAME") < names.index("NATS_USER")
        assert env["NATS_USER"] == "tessera-node-$(TESSERA_NODE_NAME)"
        assert bp.user_name(bp.NODE_AGENT, node) == f"tessera-node-{node}"
        assert not any("hostPath" in v and v["name"] == "nats-node" for v in spec["volumes"])
        selectors.add(tuple(sorted(daemonset["spec"]["selector"]["matchLabels"].items())))
    assert len(selectors) == len(nodes)  # no two DaemonSets fight over pods
    for kube_version in KUBE_VERSIONS:
        assert lint_problems(charts_dir / "tessera-node-agent", values, kube_version) == []
        validate_all(manifests, kube_version)


def policy(manifests: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    return find(manifests, "NetworkPolicy", name)


def test_only_tesseras_pods_may_connect_to_nats(charts_dir: Path) -> None:  # noqa: F811
    manifests = render(charts_dir, "tessera")
    nats = policy(manifests, f"{RELEASE}-nats-clients")
    assert nats["metadata"]["namespace"] == "nats"
    assert nats["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "nats"}}
    clients, routes = nats["spec"]["ingress"]
    assert clients["ports"] == [{"port": 4222, "protocol": "TCP"}]
    (peer,) = clients["from"]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    expressions = {e["key"]: e["values"] for e in peer["podSelector"]["matchExpressions"]}
    assert expressions["app.kubernetes.io/instance"] == [RELEASE]
    assert set(expressions["app.kubernetes.io/component"]) == set(SERVICES) | {"node-agent"}
    assert routes == {"from": [{"podSelector": nats["spec"]["podSelector"]}]}
    # Every Tessera pod carries the labels the policy admits.
    for workload in workloads(manifests):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/component"] in expressions["app.kubernetes.io/component"]


def test_no_pod_may_call_the_extender(charts_dir: Path) -> None:  # noqa: F811
    manifests = render(charts_dir, "tessera-scheduler")
    extender = policy(manifests)
    assert extender["spec"]["policyTypes"] == ["Ingress"]
    assert extender["spec"]["ingress"] == []  # kube-scheduler calls 127.0.0.1 in the same pod
    prometheus = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    opened = policy(render(charts_dir, "tessera-scheduler",
                           {"networkPolicy": {"extender": {"from": prometheus}}}))
    assert opened["spec"]["ingress"] == [
        {"ports": [{"port": "http", "protocol": "TCP"}], "from": prometheus}]


@pytest.mark.parametrize("chart", ["tessera-quota", "tessera-node-agent"])
def test_services_without_an_http_face_admit_no_pod(charts_dir: Path, chart: str) -> None:  # noqa: F811
    assert policy(render(charts_dir, chart))["spec"]["ingress"] == []


def test_policies_can_be_turned_off(charts_dir: Path) -> None:  # noqa: F811
    off = {"networkPolicy": {"nats": {"enabled": False}},
           **{k: {"networkPolicy": {"enabled": False}}
              for k in ("admission", "scheduler", "quota", "nodeAgent", "metrics")}}
    assert not [m for m in render(charts_dir, "tessera", off) if m["kind"] == "NetworkPolicy"]
