"""DRA mode in the charts (docs/dra.md): the node agent a kubelet DRA plugin with kubelet's
plugin directories and the CDI directory mounted and read/write access to its ResourceSlices;
the webhook converting HAMi pods with the right to create ResourceClaimTemplates. Rendered,
linted and validated as every chart is; nothing of it when DRA is off."""

from __future__ import annotations

from pathlib import Path

from tests.charts.test_charts import (  # noqa: F401 - charts_dir is the fixture
    KUBE_VERSIONS,
    charts_dir,
    container,
    env_of,
    find,
    lint_problems,
    render,
    validate_all,
)


def test_the_node_agent_chart_in_dra_mode(charts_dir: Path) -> None:  # noqa: F811
    values = {"dra": {"enabled": True, "cdiDir": "/etc/cdi"}}
    manifests = render(charts_dir, "tessera-node-agent", values)
    daemonset = find(manifests, "DaemonSet")
    agent = container(daemonset, "node-agent")
    env = env_of(agent)
    assert (env["TESSERA_DRA"], env["TESSERA_DRA_KUBELET_DIR"], env["TESSERA_DRA_CDI_DIR"]) == (
        "true", "/var/lib/kubelet", "/etc/cdi")  # fmt: skip
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins/gpu.tessera.io",
            "/etc/cdi"} <= mounts  # fmt: skip
    rules = find(manifests, "ClusterRole")["rules"]
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"],
            "verbs": ["get"]} in rules  # fmt: skip
    for kube_version in KUBE_VERSIONS:
        assert lint_problems(charts_dir / "tessera-node-agent", values, kube_version) == []
        # resource.k8s.io/v1 (the DeviceClasses) is served from 1.34, which DRA mode needs
        served = int(kube_version.split(".")[1]) >= 34
        validate_all([m for m in manifests if served or m["kind"] != "DeviceClass"],
                     kube_version)  # fmt: skip
    off = render(charts_dir, "tessera-node-agent")
    assert "TESSERA_DRA" not in env_of(container(find(off, "DaemonSet"), "node-agent"))


def test_the_admission_chart_in_dra_mode(charts_dir: Path) -> None:  # noqa: F811
    values = {"dra": {"enabled": True}}
    manifests = render(charts_dir, "tessera-admission", values)
    deployment = find(manifests, "Deployment")
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    webhook = container(deployment, "admission")
    assert env_of(webhook)["TESSERA_ALLOCATION_MODE"] == "dra"
    role = find(manifests, "ClusterRole", "tessera-admission-dra")
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"],
            "verbs": ["get", "create"]} in role["rules"]  # fmt: skip
    for kube_version in KUBE_VERSIONS:
        assert lint_problems(charts_dir / "tessera-admission", values, kube_version) == []
        validate_all(manifests, kube_version)
    # DRA objects' configuration for the driver is checked when written (/validate)
    validating = find(manifests, "ValidatingWebhookConfiguration")
    hooks = validating["webhooks"]
    assert {h["clientConfig"]["service"]["path"] for h in hooks} == {"/validate"}
    assert [r for hook in hooks for rule in hook["rules"] for r in rule["resources"]] == [
        "resourceclaims", "resourceclaimtemplates", "deviceclasses"]
    # UPDATE too: a DeviceClass's config may change (kube-sim sends it as kube-apiserver does)
    assert {tuple(rule["operations"]) for hook in hooks for rule in hook["rules"]} == {
        ("CREATE", "UPDATE")}
    # the match conditions are the ones kube-sim applies (its conformance test runs them in CEL)
    from tessera.kube_sim.dra.validating_webhook import MATCH_CONDITIONS

    assert {h["rules"][0]["resources"][0]: h["matchConditions"][0]["expression"]
            for h in hooks} == MATCH_CONDITIONS  # fmt: skip
    assert env_of(webhook)["TESSERA_WEBHOOK_CERT_CONFIGURATIONS"] == (
        f'["mutating/{validating["metadata"]["name"]}",'
        f'"validating/{validating["metadata"]["name"]}"]')  # its caBundle set as the other's
    certs = [m for m in manifests if m["kind"] == "ClusterRole"
             and m["metadata"]["name"].endswith("-certs")]  # fmt: skip
    assert {"apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingwebhookconfigurations"],
            "resourceNames": [validating["metadata"]["name"]],
            "verbs": ["get", "update"]} in certs[0]["rules"]  # fmt: skip
    off = render(charts_dir, "tessera-admission")
    assert not [m for m in off if m["metadata"]["name"] == "tessera-admission-dra"]
    assert not [m for m in off if m["kind"] == "ValidatingWebhookConfiguration"]


def test_the_node_agent_chart_ships_the_deviceclasses_tessera_up_installs(
    charts_dir: Path,  # noqa: F811
) -> None:
    """With DRA on, the chart carries the DeviceClasses, so `helm upgrade` updates the classes
    an older release installed; they are exactly `tessera up --dra`'s (and the examples')."""
    from tessera_cli.dra import device_classes

    manifests = render(charts_dir, "tessera-node-agent", {"dra": {"enabled": True}})
    shipped = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "DeviceClass"}
    wanted = {c["metadata"]["name"]: c for c in device_classes()}
    assert set(shipped) == set(wanted)
    for name, cls in wanted.items():
        assert shipped[name]["apiVersion"] == cls["apiVersion"]
        assert shipped[name]["spec"] == cls["spec"], name
    validate_all(list(shipped.values()), KUBE_VERSIONS[-1])
    off = render(charts_dir, "tessera-node-agent")
    assert not [m for m in off if m["kind"] == "DeviceClass"]
