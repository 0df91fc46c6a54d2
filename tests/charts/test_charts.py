"""The Helm charts: rendered and linted with the Helm SDK (no helm binary, no cluster), every
manifest validated against the Kubernetes 1.29 and 1.33 schemas, and the things an operator
relies on asserted: the extender config follows the resource names, the webhook fails closed
with the right exclusions, RBAC is minimal, the node agent touches only the host paths it needs,
and the libvgpu install never rewrites a library a container has mapped.
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tessera.settings import TesseraSettings

REPO_CHARTS = Path(__file__).resolve().parents[2] / "charts"
NATS_STANDIN = Path(__file__).resolve().parent / "standins" / "nats"
SERVICE_CHARTS = [
    "tessera-admission",
    "tessera-scheduler",
    "tessera-quota",
    "tessera-node-agent",
    "tessera-metrics",
]
ALL_CHARTS = [*SERVICE_CHARTS, "tessera"]
# The oldest Kubernetes the charts support (kubeVersion), one in between, the newest with schemas.
KUBE_VERSIONS = ["1.29.0", "1.33.0", kubernetes_validate.utils.latest_version()]
NAMESPACE = "tessera-system"
RELEASE = "tessera"
HAMI_NAMES = {
    "gpu": "nvidia.com/gpu",
    "memory": "nvidia.com/gpumem",
    "memoryPercentage": "nvidia.com/gpumem-percentage",
    "cores": "nvidia.com/gpucores",
    "priority": "nvidia.com/priority",
}
CUSTOM_NAMES = {
    "gpu": "example.com/vgpu",
    "memory": "example.com/vgpu-memory",
    "memoryPercentage": "example.com/vgpu-memory-percentage",
    "cores": "example.com/vgpu-cores",
    "priority": "example.com/vgpu-priority",
}
# Custom resources: no schema in kubernetes-validate; their shape is asserted below instead.
CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/")
CA_BUNDLE = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")

Manifest = dict[str, Any]

# (chart, values) pairs rendered, linted and validated besides the defaults.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    (
        "tessera-admission",
        {
            "tls": {
                "certManager": {"enabled": False},
                "existingSecret": "admission-tls",
                "caBundle": CA_BUNDLE.decode(),
            },
            "webhook": {"excludedNamespaces": ["cert-manager", "monitoring"]},
        },
    ),
    (
        "tessera-admission",
        {
            "tls": {"certManager": {"enabled": True,
                                    "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}},
            "replicaCount": 3,
            "nats": {"auth": {"type": "userPassword", "existingSecret": "nats-auth"}},
        },
    ),
    ("tessera-admission", {"tls": {"certManager": {"enabled": True}}}),
    ("tessera-scheduler", {"resourceNames": CUSTOM_NAMES, "schedulerName": "gpu-scheduler"}),
    (
        "tessera-quota",
        {
            "nats": {
                "auth": {"type": "creds", "existingSecret": "nats-creds", "urlKey": "url"},
                "tls": {"enabled": True, "caSecret": "nats-ca"},
            }
        },
    ),
    (
        "tessera-node-agent",
        {"libvgpu": {"install": False}, "hostPaths": {"regions": "/data/tessera/regions"}},
    ),
    ("tessera-metrics", {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}),
    ("tessera-metrics", {"prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
                         "config": {"legacyNames": True}}),
    ("tessera-scheduler", {"serviceMonitor": {"enabled": True}}),
    ("tessera-node-agent", {"podMonitor": {"enabled": True}}),
    ("tessera-admission", {"serviceMonitor": {"enabled": True}}),
    ("tessera-quota", {"podMonitor": {"enabled": True}}),
    ("tessera-quota", {"probes": {"enabled": True}, "replicaCount": 2}),
    (
        "tessera",
        {
            "global": {
                "resourceNames": CUSTOM_NAMES,
                "nats": {
                    "url": "tls://nats.example:4222",
                    "tls": {"enabled": True, "caSecret": "ca"},
                },
                "config": {"deviceSplitCount": 4},
            },
            "metrics": {"enabled": False},
        },
    ),
]


@pytest.fixture(scope="module")
def charts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of charts/ with every chart's dependencies in place, as `helm dependency update`
    leaves them: the library chart in each service chart; the library, the service charts and
    NATS in the umbrella. NATS is the stand-in of tests/charts/standins/nats (the official
    chart cannot be downloaded here)."""
    root = tmp_path_factory.mktemp("charts") / "charts"
    shutil.copytree(REPO_CHARTS, root, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    for chart in SERVICE_CHARTS:
        helm.dependency_update(root / chart)  # file:// only
    umbrella_deps = root / "tessera" / "charts"
    umbrella_deps.mkdir()
    for dependency in yaml.safe_load((root / "tessera" / "Chart.yaml").read_text())["dependencies"]:
        if dependency["repository"].startswith("file://../"):
            source = root / dependency["repository"].removeprefix("file://../")
        else:
            assert dependency["name"] == "nats", dependency
            source = NATS_STANDIN
        shutil.copytree(source, umbrella_deps / dependency["name"])
    return root


def render(
    charts_dir: Path, chart: str, values: dict[str, Any] | None = None, namespace: str = NAMESPACE
) -> list[Manifest]:
    with helm.Chart.load(charts_dir / chart) as loaded:
        files = loaded.render(values, name=RELEASE, namespace=namespace)
    manifests = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        manifests.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return manifests


def find(manifests: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    matches = [
        m
        for m in manifests
        if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def kinds(manifests: list[Manifest]) -> set[str]:
    return {m["kind"] for m in manifests}


def container(workload: Manifest, name: str) -> Manifest:
    (found,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def env_of(c: Manifest) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def lint_problems(chart_path: Path, values: dict[str, Any] | None, kube_version: str) -> list[str]:
    report = helm.lint(
        chart_path,
        values,
        strict=True,
        namespace=NAMESPACE,
        with_subcharts=True,
        kube_version=f"v{kube_version}",
    )
    # Severity 1 is informational (e.g. "icon is recommended"); strict fails on the rest.
    problems = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
    return problems + list(report["errors"])


# Manifests already found valid, as (JSON text, Kubernetes version): renders of the umbrella,
# its variants and the README's installs share most of theirs, and validating is the slow part.
_VALID: set[tuple[str, str]] = set()


def validate_all(manifests: list[Manifest], kube_version: str) -> None:
    for manifest in manifests:
        if manifest["apiVersion"].startswith(CRD_GROUPS):
            continue
        key = (json.dumps(manifest, sort_keys=True), kube_version)
        if key in _VALID:
            continue
        try:
            kubernetes_validate.validate(manifest, kube_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = "/".join(str(p) for p in getattr(error, "path", []))
            first_line = str(error).splitlines()[0]
            pytest.fail(
                f"{manifest['kind']} {manifest['metadata']['name']} invalid for {kube_version} "
                f"at {where}: {first_line}"
            )
        _VALID.add(key)


def variant_id(variant: tuple[str, dict[str, Any]]) -> str:
    chart, values = variant
    return f"{chart}:{'+'.join(sorted(values))}"


# --- every chart, every variant: lint, render, schema ---------------------------------------


@pytest.mark.parametrize(
    ("chart", "values"),
    [(chart, None) for chart in ALL_CHARTS] + VARIANTS,
    ids=[f"{c}:defaults" for c in ALL_CHARTS] + [variant_id(v) for v in VARIANTS],
)
def test_chart_lints_strictly_and_every_manifest_is_valid_kubernetes(
    charts_dir: Path, chart: str, values: dict[str, Any] | None
) -> None:
    manifests = render(charts_dir, chart, values)
    assert manifests
    for kube_version in KUBE_VERSIONS:
        assert lint_problems(charts_dir / chart, values, kube_version) == []
        validate_all(manifests, kube_version)
    for manifest in manifests:
        labels = manifest["metadata"]["labels"]
        if labels.get("app.kubernetes.io/name") == "nats":
            continue  # the NATS chart's own
        assert labels["app.kubernetes.io/part-of"] == "tessera"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_validation_would_catch_a_broken_manifest() -> None:
    broken = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"p": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[0], strict=True)


def test_umbrella_installs_each_service_once_under_short_names(charts_dir: Path) -> None:
    manifests = render(charts_dir, "tessera")
    workloads = {
        m["metadata"]["name"] for m in manifests if m["kind"] in ("Deployment", "DaemonSet")
    }
    assert workloads == {
        "tessera-admission",
        "tessera-scheduler",
        "tessera-quota",
        "tessera-node-agent",
        "tessera-metrics",
    }
    without_agent = render(charts_dir, "tessera", {"nodeAgent": {"enabled": False}})
    assert "DaemonSet" not in kinds(without_agent)


def test_umbrella_globals_reach_every_service(charts_dir: Path) -> None:
    values = {
        "global": {
            "resourceNames": CUSTOM_NAMES,
            "schedulerName": "gpu-scheduler",
            "image": {"tag": "9.9.9"},
            "nats": {"url": "nats://nats.shared:4222", "auth": {"type": "userPassword"}},
        }
    }
    manifests = render(charts_dir, "tessera", values)
    workloads = [m for m in manifests if m["kind"] in ("Deployment", "DaemonSet")]
    assert len(workloads) == 5
    for workload in workloads:
        for c in workload["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "kube-scheduler":
                continue
            env = env_of(c)
            assert c["image"] == "ghcr.io/tessera/tessera:9.9.9"
            assert env["NATS_URL"] == "nats://nats.shared:4222"
            # Each service its own NATS identity (docs/security.md), never one shared Secret.
            component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
            if component == "node-agent":
                assert env["NATS_USER"] == "tessera-node-$(TESSERA_NODE_NAME)"
                assert env["NATS_PASSWORD_FILE"] == "/etc/tessera/nats/password"
            else:
                assert env["NATS_PASSWORD"] == {
                    "secretKeyRef": {"name": f"tessera-nats-{component}", "key": "password"}
                }
            assert env["TESSERA_RESOURCE_MEM"] == CUSTOM_NAMES["memory"]
            assert env["TESSERA_SCHEDULER_NAME"] == "gpu-scheduler"
    config = extender_config(manifests)
    assert managed_resources(config) == set(CUSTOM_NAMES.values())


def test_production_values_replicate_every_bucket_on_three_servers(charts_dir: Path) -> None:
    """One NATS server's lost disk must lose nothing: every service creates (and re-creates)
    buckets and the stream with 3 replicas by default; a single-server install can say 1."""
    for values, wanted in ((None, "3"), ({"global": {"config": {"busReplicas": 1}}}, "1")):
        manifests = render(charts_dir, "tessera", values)
        workloads = [m for m in manifests if m["kind"] in ("Deployment", "DaemonSet")]
        assert len(workloads) == 5
        for workload in workloads:
            for c in workload["spec"]["template"]["spec"]["containers"]:
                if c["name"] != "kube-scheduler":
                    assert env_of(c)["TESSERA_BUS_REPLICAS"] == wanted, workload["metadata"]


# --- scheduler ------------------------------------------------------------------------------


def extender_config(manifests: list[Manifest]) -> Manifest:
    configmap = next(
        m for m in manifests if m["kind"] == "ConfigMap" and "config.yaml" in m.get("data", {})
    )
    config: Manifest = yaml.safe_load(configmap["data"]["config.yaml"])
    return config


def managed_resources(config: Manifest) -> set[str]:
    (extender,) = config["extenders"]
    assert all(r["ignoredByScheduler"] is True for r in extender["managedResources"])
    return {r["name"] for r in extender["managedResources"]}


def test_the_extender_manages_the_other_vendors_resources_listed(charts_dir: Path) -> None:
    vendors = ["huawei.com/Ascend910B3", "huawei.com/Ascend910B3-memory", "cambricon.com/vmlu",
               "hygon.com/dcunum"]
    config = extender_config(render(charts_dir, "tessera-scheduler", {"vendorResources": vendors}))
    assert managed_resources(config) == set(HAMI_NAMES.values()) | set(vendors)


@pytest.mark.parametrize("names", [HAMI_NAMES, CUSTOM_NAMES], ids=["hami", "custom"])
def test_extender_config_follows_the_resource_names(
    charts_dir: Path, names: dict[str, str]
) -> None:
    manifests = render(charts_dir, "tessera-scheduler", {"resourceNames": names})
    config = extender_config(manifests)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in config["profiles"]] == ["tessera-scheduler"]
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:8888"
    assert (extender["filterVerb"], extender["prioritizeVerb"], extender["bindVerb"]) == (
        "filter",
        "prioritize",
        "bind",
    )
    assert extender["nodeCacheCapable"] is True
    assert extender["weight"] >= 1
    assert managed_resources(config) == set(names.values())
    assert config["leaderElection"]["resourceNamespace"] == NAMESPACE

    deployment = find(manifests, "Deployment")
    extender_container = container(deployment, "extender")
    env = env_of(extender_container)
    assert env["TESSERA_LISTEN"] == "127.0.0.1:8888"  # loopback: kube-scheduler only
    assert env["TESSERA_RESOURCE_NAME"] == names["gpu"]
    assert env["TESSERA_RESOURCE_MEM_PERCENTAGE"] == names["memoryPercentage"]
    assert env["TESSERA_CLUSTER"] == "kubernetes"
    assert (env["TESSERA_KUBE_QPS"], env["TESSERA_KUBE_BURST"]) == ("50", "100")
    assert extender_container["command"] == ["tessera-scheduler"]
    scheduler = container(deployment, "kube-scheduler")
    assert "--config=/etc/tessera-scheduler/config.yaml" in scheduler["command"]
    # Without a tag, kube-scheduler follows the cluster's minor version.
    assert scheduler["image"].startswith("registry.k8s.io/kube-scheduler:v1.")


def test_extender_answers_only_kube_scheduler(charts_dir: Path) -> None:
    """/filter and /bind on the pod's loopback (kube-scheduler is in the pod); kubelet and
    Prometheus get a probe port without them; optionally mutual TLS on top."""
    manifests = render(charts_dir, "tessera-scheduler")
    (extender,) = extender_config(manifests)["extenders"]
    assert extender["urlPrefix"].startswith("http://127.0.0.1:")
    deployment = find(manifests, "Deployment")
    ext = container(deployment, "extender")
    env = env_of(ext)
    assert env["TESSERA_LISTEN"].startswith("127.0.0.1:")
    assert env["TESSERA_PROBE_LISTEN"] == "0.0.0.0:8889"
    assert [p["containerPort"] for p in ext["ports"]] == [8889]
    assert find(manifests, "Service")["spec"]["ports"][0]["targetPort"] == "http"

    values = {"extender": {"tls": {"enabled": True, "secretName": "extender-mtls"}}}
    manifests = render(charts_dir, "tessera-scheduler", values)
    (extender,) = extender_config(manifests)["extenders"]
    assert extender["urlPrefix"].startswith("https://127.0.0.1:")
    assert extender["enableHTTPS"] is True
    tls = extender["tlsConfig"]
    assert {tls["certFile"], tls["keyFile"], tls["caFile"]} == {
        "/etc/tessera-extender-tls/client.crt", "/etc/tessera-extender-tls/client.key",
        "/etc/tessera-extender-tls/ca.crt",
    }  # fmt: skip
    deployment = find(manifests, "Deployment")
    env = env_of(container(deployment, "extender"))
    assert env["TESSERA_TLS_CLIENT_CA"] == "/etc/tessera-extender-tls/ca.crt"
    for name in ("extender", "kube-scheduler"):
        mounts = {m["name"]: m for m in container(deployment, name)["volumeMounts"]}
        assert mounts["extender-tls"]["mountPath"] == "/etc/tessera-extender-tls"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["extender-tls"]["secret"]["secretName"] == "extender-mtls"


def test_scheduler_pod_rolls_when_its_config_changes(charts_dir: Path) -> None:
    def checksum(values: dict[str, Any] | None) -> str:
        deployment = find(render(charts_dir, "tessera-scheduler", values), "Deployment")
        annotations: dict[str, str] = deployment["spec"]["template"]["metadata"]["annotations"]
        return annotations["checksum/config"]

    assert checksum(None) != checksum({"resourceNames": CUSTOM_NAMES})


# --- admission ------------------------------------------------------------------------------


def test_webhook_fails_closed_and_excludes_only_system_namespaces(charts_dir: Path) -> None:
    manifests = render(charts_dir, "tessera-admission")
    config = find(manifests, "MutatingWebhookConfiguration")
    (webhook,) = config["webhooks"]
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["failurePolicy"] == "Fail"
    assert 1 <= webhook["timeoutSeconds"] <= 5
    assert webhook["sideEffects"] == "None"
    assert webhook["rules"] == [
        {
            "operations": ["CREATE", "UPDATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        },
        {  # issue 34: a pods/status writer may not forge the allocation's record either
            "operations": ["UPDATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods/status", "pods/ephemeralcontainers", "pods/resize"],
            "scope": "Namespaced",
        },
    ]
    # Updates by this release's service accounts skip the webhook, and the webhook trusts the
    # same identities: a tenant's update may not touch the scheduler-owned annotations.
    condition, status_updates = webhook["matchConditions"]
    # pods/status updates (kubelet's, constant) reach the webhook only when annotations change.
    assert status_updates["name"] == "subresource-updates-that-change-annotations"
    assert "oldObject.metadata.annotations" in status_updates["expression"]
    prefix = f"system:serviceaccount:{NAMESPACE}:"
    assert condition["expression"] == (
        f"request.operation != 'UPDATE' || !request.userInfo.username.startsWith('{prefix}')"
    )
    # No objectSelector: a label a tenant can set on their own pod must not skip the webhook.
    assert "objectSelector" not in webhook
    (expression,) = webhook["namespaceSelector"]["matchExpressions"]
    assert expression["key"] == "kubernetes.io/metadata.name"
    assert expression["operator"] == "NotIn"
    assert expression["values"] == ["kube-system", NAMESPACE]

    service = find(manifests, "Service")
    target = webhook["clientConfig"]["service"]
    assert (target["name"], target["namespace"]) == (service["metadata"]["name"], NAMESPACE)
    assert target["port"] == service["spec"]["ports"][0]["port"] == 443
    deployment = find(manifests, "Deployment")
    admission = container(deployment, "admission")
    port_names = {p["name"]: p["containerPort"] for p in admission["ports"]}
    assert port_names[service["spec"]["ports"][0]["targetPort"]] == 9443
    assert admission["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert env_of(admission)["TESSERA_ADMISSION_TRUSTED_USER_PREFIXES"] == prefix


def test_webhook_exclusions_can_grow_but_never_lose_the_system_namespaces(
    charts_dir: Path,
) -> None:
    values = {"webhook": {"excludedNamespaces": ["cert-manager", "kube-system"]}}
    manifests = render(charts_dir, "tessera-admission", values, namespace="gpu")
    (webhook,) = find(manifests, "MutatingWebhookConfiguration")["webhooks"]
    (expression,) = webhook["namespaceSelector"]["matchExpressions"]
    assert expression["values"] == ["kube-system", "gpu", "cert-manager"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"webhook": {"timeoutSeconds": 10}}, "timeoutSeconds"),
        ({"webhook": {"failurePolicy": "Skip"}}, "failurePolicy"),
        (
            {"tls": {"certManager": {"enabled": False}, "caBundle": CA_BUNDLE.decode()}},
            "existingSecret is not",
        ),
        (
            {"tls": {"certManager": {"enabled": False}, "existingSecret": "tls"}},
            "caBundle",
        ),
    ],
    ids=["slow-timeout", "bad-policy", "no-secret", "no-ca"],
)
def test_admission_refuses_unsafe_or_incomplete_values(
    charts_dir: Path, values: dict[str, Any], message: str
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(charts_dir, "tessera-admission", values)


def test_admission_is_highly_available_with_cert_manager_certificates(charts_dir: Path) -> None:
    manifests = render(charts_dir, "tessera-admission", {"tls": {"certManager": {"enabled": True}}})
    deployment = find(manifests, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pdb = find(manifests, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    certificate = find(manifests, "Certificate")
    issuer = find(manifests, "Issuer")
    assert certificate["spec"]["issuerRef"]["name"] == issuer["metadata"]["name"]
    service_name = find(manifests, "Service")["metadata"]["name"]
    assert f"{service_name}.{NAMESPACE}.svc" in certificate["spec"]["dnsNames"]
    config = find(manifests, "MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{certificate['metadata']['name']}"
    )
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == certificate["spec"]["secretName"]
    env = env_of(container(deployment, "admission"))
    assert env["TESSERA_TLS_CERT"] == "/etc/tessera/tls/tls.crt"
    assert env["TESSERA_TLS_KEY"] == "/etc/tessera/tls/tls.key"


def test_admission_with_a_provided_secret_needs_no_cert_manager(charts_dir: Path) -> None:
    values = {
        "tls": {
            "certManager": {"enabled": False},
            "existingSecret": "admission-tls",
            "caBundle": CA_BUNDLE.decode(),
        }
    }
    manifests = render(charts_dir, "tessera-admission", values)
    assert not any(m["apiVersion"].startswith("cert-manager.io/") for m in manifests)
    config = find(manifests, "MutatingWebhookConfiguration")
    assert "annotations" not in config["metadata"]
    assert config["webhooks"][0]["clientConfig"]["caBundle"] == CA_BUNDLE.decode()
    deployment = find(manifests, "Deployment")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "admission-tls"


def test_admission_on_a_bare_cluster_provisions_its_own_certificate(charts_dir: Path) -> None:
    """The default: no cert-manager, no Secret to provide. The webhook is told which Secret to
    keep its CA in (the chart creates it empty), which DNS names to certify and which webhook
    configuration's caBundle to set; it may touch exactly those two objects."""
    manifests = render(charts_dir, "tessera-admission")
    assert not any(m["apiVersion"].startswith("cert-manager.io/") for m in manifests)
    deployment = find(manifests, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    env = env_of(container(deployment, "admission"))
    secret = find(manifests, "Secret")
    assert secret["type"] == "Opaque" and "data" not in secret  # the webhook fills it
    assert env["TESSERA_WEBHOOK_CERT_SECRET"] == f"{NAMESPACE}/{secret['metadata']['name']}"
    service = find(manifests, "Service")["metadata"]["name"]
    dns_names = json.loads(env["TESSERA_WEBHOOK_CERT_DNS_NAMES"])
    assert f"{service}.{NAMESPACE}.svc" in dns_names
    config = find(manifests, "MutatingWebhookConfiguration")
    assert json.loads(env["TESSERA_WEBHOOK_CERT_CONFIGURATIONS"]) == [
        f"mutating/{config['metadata']['name']}"]
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    assert "annotations" not in config["metadata"]
    assert int(env["TESSERA_WEBHOOK_CERT_RENEW_BEFORE_DAYS"]) < int(
        env["TESSERA_WEBHOOK_CERT_VALIDITY_DAYS"])
    # The files it writes: a writable in-memory volume where TESSERA_TLS_CERT/KEY point.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["emptyDir"]["medium"] == "Memory"
    (mount,) = [m for m in container(deployment, "admission")["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] is False
    assert env["TESSERA_TLS_CERT"].startswith(mount["mountPath"] + "/")
    assert pod["automountServiceAccountToken"] is True
    # Least privilege: get/update of the one Secret and the one configuration, by name.
    for role in (m for m in manifests if m["kind"] in ("Role", "ClusterRole")):
        for rule in role["rules"]:
            assert rule["verbs"] == ["get", "update"]
            if rule["resources"] == ["secrets"]:
                assert rule["resourceNames"] == [secret["metadata"]["name"]]
                assert role["kind"] == "Role"
            else:
                assert rule["resourceNames"] == [config["metadata"]["name"]]
    # ServiceMonitor verifies the webhook with the CA the webhook keeps in that Secret.
    monitored = render(charts_dir, "tessera-admission", {"serviceMonitor": {"enabled": True}})
    tls_config = find(monitored, "ServiceMonitor")["spec"]["endpoints"][0]["tlsConfig"]
    assert tls_config["ca"]["secret"] == {"name": secret["metadata"]["name"], "key": "ca.crt"}


# --- RBAC and security contexts -------------------------------------------------------------

# Exactly what each service may do through the API, as (apiGroup, resource) -> verbs.
EXPECTED_RULES: dict[str, dict[tuple[str, str], set[str]]] = {
    # Its own certificate (the default, without cert-manager): one Secret, one configuration.
    "tessera-admission": {
        ("", "secrets"): {"get", "update"},
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): {"get", "update"},
    },
    "tessera-metrics": {},
    "tessera-quota": {
        ("", "resourcequotas"): {"get", "list", "watch"},
        ("", "events"): {"create", "patch"},
        # a reservation only for a pod that exists; charges rebuilt from the bound pods
        ("", "pods"): {"get", "list"},
        ("resource.k8s.io", "resourceclaims"): {"list"},  # DRA pods' charges from their claims
    },
    "tessera-node-agent": {
        ("", "pods"): {"get", "list", "watch"},
        ("", "nodes"): {"get", "patch"},
        ("", "events"): {"create", "patch"},
        ("", "configmaps"): {"get", "list", "watch"},  # tessera-node-config, its namespace only
        ("", "pods/eviction"): {"create"},  # elastic memory: borrowers past a guarantee
    },
    "tessera-scheduler": {
        ("", "pods"): {"get", "list", "watch", "patch"},
        ("", "pods/binding"): {"create"},
        ("", "pods/eviction"): {"create"},  # preemption: evict victims
        ("", "pods/status"): {"patch"},  # preemption: status.nominatedNodeName
        ("policy", "poddisruptionbudgets"): {"list"},  # preemption: honour PDBs
        ("", "events"): {"create", "patch"},
        ("coordination.k8s.io", "leases"): {"create", "get", "update"},
        # the ledger's rebuild: running DRA pods' slices from their claims
        ("resource.k8s.io", "resourceclaims"): {"list"},
    },
}
# Roles Kubernetes itself defines for a second scheduler; nothing else is borrowed.
BUILT_IN_ROLES = {
    "system:kube-scheduler",
    "system:volume-scheduler",
    "extension-apiserver-authentication-reader",
}


def granted_rules(manifests: list[Manifest]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for role in (m for m in manifests if m["kind"] in ("ClusterRole", "Role")):
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


@pytest.mark.parametrize("chart", SERVICE_CHARTS)
def test_rbac_grants_only_what_the_service_uses(charts_dir: Path, chart: str) -> None:
    manifests = render(charts_dir, chart)
    assert granted_rules(manifests) == EXPECTED_RULES[chart]
    own_roles = {m["metadata"]["name"] for m in manifests if m["kind"] in ("ClusterRole", "Role")}
    for binding in (m for m in manifests if m["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        assert binding["roleRef"]["name"] in own_roles | BUILT_IN_ROLES
        (subject,) = binding["subjects"]
        assert subject["kind"] == "ServiceAccount"
        assert subject["namespace"] == NAMESPACE
    # An update is limited to named objects: the scheduler's own lease, the webhook's own
    # Secret and webhook configuration.
    for role in (m for m in manifests if m["kind"] in ("Role", "ClusterRole")):
        for rule in role["rules"]:
            if "update" in rule["verbs"]:
                assert rule["resourceNames"] in (["tessera-scheduler"],
                                                 ["tessera-admission-certs"],
                                                 [f"tessera-admission-{NAMESPACE}"])


@pytest.mark.parametrize(("chart", "values"), [
    ("tessera-metrics", None),
    # The webhook calls the API only to provision its own certificate.
    ("tessera-admission", {"tls": {"certManager": {"enabled": True}}}),
    ("tessera-admission", {"tls": {"existingSecret": "tls", "caBundle": CA_BUNDLE.decode()}}),
], ids=["metrics", "admission-cert-manager", "admission-existing-secret"])
def test_services_without_api_access_get_no_token(charts_dir: Path, chart: str,
                                                  values: dict[str, Any] | None) -> None:
    manifests = render(charts_dir, chart, values)
    assert find(manifests, "ServiceAccount")["automountServiceAccountToken"] is False
    pod = find(manifests, "Deployment")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("chart", [c for c in SERVICE_CHARTS if c != "tessera-node-agent"])
def test_control_plane_runs_non_root_read_only_without_capabilities(
    charts_dir: Path, chart: str
) -> None:
    deployment = find(render(charts_dir, chart), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    assert not any("hostPath" in v for v in pod["volumes"])
    for c in pod["containers"]:
        context = c["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
        if chart == "tessera-quota":
            continue  # no HTTP face yet: probes are opt-in (test_opt_in_health_probes)
        for probe in ("readinessProbe", "livenessProbe"):
            port = c[probe]["httpGet"]["port"]
            assert port in {p["name"] for p in c["ports"]}
        if c["name"] != "kube-scheduler":
            assert c["command"][0].startswith("tessera-")  # a console script of the image


# --- node agent -----------------------------------------------------------------------------


def test_node_agent_mounts_only_the_host_paths_it_needs(charts_dir: Path) -> None:
    daemonset = find(render(charts_dir, "tessera-node-agent"), "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        "device-plugins": {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"},
        "pod-resources": {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"},
        "regions": {"path": "/var/lib/tessera/containers", "type": "DirectoryOrCreate"},
        "vgpu": {"path": "/usr/local/vgpu", "type": "DirectoryOrCreate"},
        # This node's own NATS password (docs/security.md), read-only.
        "nats-node": {"path": "/etc/tessera/nats", "type": "Directory"},
    }
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod["priorityClassName"] == "system-node-critical"

    agent = container(daemonset, "node-agent")
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    # Same paths inside as on the host: the mounts it hands kubelet name host paths.
    for name, host_path in host_paths.items():
        assert mounts[name]["mountPath"] == host_path["path"]
    assert mounts["pod-resources"].get("readOnly") is True
    assert mounts["vgpu"].get("readOnly") is True
    assert mounts["nats-node"].get("readOnly") is True
    assert not mounts["regions"].get("readOnly")
    context = agent["securityContext"]
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    env = env_of(agent)
    assert env["TESSERA_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["TESSERA_REGION_HOST_DIR"] == "/var/lib/tessera/containers"
    assert env["TESSERA_LIBVGPU_HOST_PATH"] == "/usr/local/vgpu/libvgpu.so"
    # Containers mount the ld.so.preload the init container installed, not a second copy.
    assert env["TESSERA_PRELOAD_HOST_PATH"] == "/usr/local/vgpu/ld.so.preload"
    assert env["TESSERA_DEVICE_PLUGIN_DIR"] == "/var/lib/kubelet/device-plugins"
    assert env["TESSERA_POD_RESOURCES_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert env["TESSERA_DEVICE_SPLIT_COUNT"] == "10"
    assert env["TESSERA_MIG_STRATEGY"] == "none"  # config.migStrategy

    (init,) = pod["initContainers"]
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert set(init_mounts) == {"install-script", "vgpu"}
    assert not init_mounts["vgpu"].get("readOnly")


@pytest.mark.parametrize(
    ("chart", "kind", "name"),
    [("tessera-quota", "Deployment", "quota"), ("tessera-node-agent", "DaemonSet", "node-agent")],
)
def test_health_probes(charts_dir: Path, chart: str, kind: str, name: str) -> None:
    off = {"probes": {"enabled": False}}
    assert "livenessProbe" not in container(find(render(charts_dir, chart, off), kind), name)
    values = {"probes": {"port": 8081}}
    probed = container(find(render(charts_dir, chart, values), kind), name)
    assert env_of(probed)["TESSERA_LISTEN"] == "0.0.0.0:8081"
    assert probed["ports"] == [{"name": "health", "containerPort": 8081, "protocol": "TCP"}]
    assert probed["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert probed["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}


def test_node_agent_without_install_has_no_init_container(charts_dir: Path) -> None:
    values = {"libvgpu": {"install": False}, "hostPaths": {"regions": "/data/regions"}}
    manifests = render(charts_dir, "tessera-node-agent", values)
    pod = find(manifests, "DaemonSet")["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert "TESSERA_PRELOAD_HOST_PATH" not in env_of(container(find(manifests, "DaemonSet"),
                                                             "node-agent"))
    # No install script ConfigMap (tessera-node-config, the device configuration, stays).
    assert [m["metadata"]["name"] for m in manifests if m["kind"] == "ConfigMap"] == [
        "tessera-node-config"]
    regions = next(v for v in pod["volumes"] if v["name"] == "regions")
    assert regions["hostPath"]["path"] == "/data/regions"


def test_node_agent_enforces_memory_guarantees_unless_told_otherwise(charts_dir: Path) -> None:
    """Elastic memory: by default the node evicts a borrower that keeps a due guarantee's memory
    past the grace bound; an operator can leave it to the pods. Whatever the chart renders, the
    agent's settings accept it."""
    def settings_of(values: dict[str, Any] | None) -> TesseraSettings:
        env = env_of(container(find(render(charts_dir, "tessera-node-agent", values),
                                    "DaemonSet"), "node-agent"))  # fmt: skip
        keys = ("TESSERA_MEMORY_RECLAIM_ENFORCEMENT", "TESSERA_MEMORY_RECLAIM_GRACE_S",
                "TESSERA_COMPUTE_RECLAIM_EVENT_WINDOW_S")
        assert all(k in env for k in keys), env
        return TesseraSettings(**{k.removeprefix("TESSERA_").lower(): env[k] for k in keys})

    default = settings_of(None)
    assert (default.memory_reclaim_enforcement, default.memory_reclaim_grace_s) == ("evict", 5)
    lenient = settings_of({"config": {"memoryReclaimEnforcement": "borrower",
                                      "memoryReclaimGraceS": 12}})  # fmt: skip
    assert (lenient.memory_reclaim_enforcement, lenient.memory_reclaim_grace_s) == ("borrower", 12)
    assert default.compute_reclaim_event_window_s == 60


def run_install(script: Path, source: Path, vgpu_dir: Path) -> str:
    result = subprocess.run(
        ["sh", str(script)],
        env={
            "PATH": os.environ["PATH"],
            "LIBVGPU_SOURCE": str(source),
            "VGPU_DIR": str(vgpu_dir),
            "LIBVGPU_CONTAINER_PATH": "/usr/local/vgpu/libvgpu.so",
        },
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return result.stdout


def test_libvgpu_install_never_rewrites_a_mapped_library(charts_dir: Path, tmp_path: Path) -> None:
    configmap = find(render(charts_dir, "tessera-node-agent"), "ConfigMap",
                     "tessera-node-agent-install")
    script = tmp_path / "install-libvgpu.sh"
    script.write_text(configmap["data"]["install-libvgpu.sh"])
    host = tmp_path / "host" / "usr-local-vgpu"
    image_lib = tmp_path / "image" / "libvgpu.so"
    image_lib.parent.mkdir()

    image_lib.write_bytes(b"\x7fELF build one" * 100)
    run_install(script, image_lib, host)
    installed = host / "libvgpu.so"
    assert installed.is_symlink()
    assert installed.read_bytes() == image_lib.read_bytes()
    assert (host / "ld.so.preload").read_text() == "/usr/local/vgpu/libvgpu.so\n"

    # A running container has the first build mapped.
    with open(installed, "rb") as mapped_file:
        mapped = mmap.mmap(mapped_file.fileno(), 0, prot=mmap.PROT_READ)
        first_inode = os.fstat(mapped_file.fileno()).st_ino
        preload_inode = (host / "ld.so.preload").stat().st_ino

        image_lib.write_bytes(b"\x7fELF build two" * 100)
        output = run_install(script, image_lib, host)

        assert mapped[:14] == b"\x7fELF build one"  # the mapped pages are untouched
        assert installed.read_bytes() == image_lib.read_bytes()  # new containers get build two
        assert os.stat(installed).st_ino != first_inode
        assert os.readlink(installed) in output
        mapped.close()
    old_versions = [p for p in host.iterdir() if p.name.startswith("libvgpu.so.")]
    assert len(old_versions) == 2  # the first build stays for whoever still maps it
    assert (host / "ld.so.preload").stat().st_ino == preload_inode  # unchanged content
    assert not list(host.glob(".*tmp"))

    # The same build again is a no-op.
    target = os.readlink(installed)
    run_install(script, image_lib, host)
    assert os.readlink(installed) == target
    assert len([p for p in host.iterdir() if p.name.startswith("libvgpu.so.")]) == 2


# --- metrics --------------------------------------------------------------------------------


@pytest.fixture
def metrics_with_dashboard(charts_dir: Path, tmp_path: Path) -> Iterator[Path]:
    chart = tmp_path / "tessera-metrics"
    shutil.copytree(charts_dir / "tessera-metrics", chart)
    (chart / "dashboards" / "extra.json").write_text('{"title": "Tessera extra", "panels": []}')
    yield chart


def test_metrics_service_monitor_and_dashboards(
    charts_dir: Path, metrics_with_dashboard: Path
) -> None:
    defaults = render(charts_dir, "tessera-metrics")
    assert "ServiceMonitor" not in kinds(defaults)
    service = find(defaults, "Service")
    assert service["spec"]["ports"][0]["port"] == 9394

    manifests = render(
        metrics_with_dashboard.parent,
        "tessera-metrics",
        {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    )
    monitor = find(manifests, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["spec"]["selector"].items()

    dashboards = find(manifests, "ConfigMap")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert yaml.safe_load(dashboards["data"]["extra.json"])["title"] == "Tessera extra"
    shipped = sorted(
        p.name for p in (REPO_CHARTS / "tessera-metrics" / "dashboards").glob("*.json")
    )
    assert sorted(dashboards["data"]) == sorted([*shipped, "extra.json"])


# --- NATS connection ------------------------------------------------------------------------


def test_nats_credentials_come_from_secrets_never_values(charts_dir: Path) -> None:
    values = {
        "nats": {
            "auth": {"type": "creds", "existingSecret": "nats-creds", "urlKey": "url"},
            "tls": {"enabled": True, "caSecret": "nats-ca"},
        }
    }
    deployment = find(render(charts_dir, "tessera-quota", values), "Deployment")
    quota = container(deployment, "quota")
    env = env_of(quota)
    assert env["NATS_URL"] == {"secretKeyRef": {"name": "nats-creds", "key": "url"}}
    mounts = {m["name"]: m["mountPath"] for m in quota["volumeMounts"]}
    assert env["NATS_CREDS"] == f"{mounts['nats-auth']}/nats.creds"
    assert env["NATS_TLS_CA"] == f"{mounts['nats-tls']}/ca.crt"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["nats-auth"]["secret"]["secretName"] == "nats-creds"
    assert volumes["nats-tls"]["secret"]["secretName"] == "nats-ca"
    assert "NATS_USER" not in env and "NATS_PASSWORD" not in env

    with pytest.raises(helm.HelmError, match=r"nats\.auth\.type"):
        render(charts_dir, "tessera-quota", {"nats": {"auth": {"type": "token"}}})


def test_node_agent_watchdog_gets_host_pids_and_cap_kill_only_when_asked(charts_dir: Path) -> None:
    def agent_pod(values: dict[str, Any]) -> tuple[Manifest, Manifest]:
        daemonset = find(render(charts_dir, "tessera-node-agent", values), "DaemonSet")
        return daemonset["spec"]["template"]["spec"], container(daemonset, "node-agent")

    pod, agent = agent_pod({})
    assert not pod.get("hostPID") and env_of(agent)["TESSERA_ENFORCEMENT"] == "observe"
    assert env_of(agent)["TESSERA_LEASE_ENFORCEMENT"] == "kill"  # a bypass: at first sight
    pod, agent = agent_pod({"watchdog": {"hostPID": True}})
    assert pod["hostPID"] is True
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    pod, agent = agent_pod({"watchdog": {"hostPID": True},
                            "config": {"leaseEnforcement": "observe"}})  # fmt: skip
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # observe: no kill
    pod, agent = agent_pod({"watchdog": {"hostPID": True}, "config": {"enforcement": "kill"}})
    assert env_of(agent)["TESSERA_ENFORCEMENT"] == "kill"
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    assert agent["securityContext"]["privileged"] is False
