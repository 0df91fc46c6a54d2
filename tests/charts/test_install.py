"""charts/README.md's walkthrough, command by command: every `helm install` in it is rendered
with exactly its values files, --set and namespace (the NATS dependency on and off, with and
without cert-manager) and validated for the supported Kubernetes versions; the files and
objects the other commands name exist; the production install references no Secret the
walkthrough does not create. The official NATS chart is the stand-in of
tests/charts/standins/nats (see test_charts.charts_dir)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from test_charts import (
    KUBE_VERSIONS,
    NATS_STANDIN,
    charts_dir,  # noqa: F401 - the fixture
    container,
    env_of,
    find,
    lint_problems,
    render,
    validate_all,
)

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "charts" / "README.md"
Manifest = dict[str, Any]


def commands() -> list[list[str]]:
    """Every command of the README's ```sh blocks, split as the shell would."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


def installs() -> list[list[str]]:
    return [c for c in commands() if c[:2] == ["helm", "install"]]


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def helm_install(charts: Path, words: list[str]) -> tuple[str, list[Manifest]]:
    """Render `helm install RELEASE CHART [options]` as Helm would install it."""
    release, chart, *options = words[2:]
    namespace, values = "default", {}
    i = 0
    while i < len(options):
        option = options[i]
        if option in ("-n", "--namespace"):
            namespace, i = options[i + 1], i + 2
        elif option in ("-f", "--values"):
            path = ROOT / options[i + 1]
            assert path.is_file(), f"{path} named in the README does not exist"
            values, i = merge(values, yaml.safe_load(path.read_text()) or {}), i + 2
        elif option == "--set":
            values, i = merge(values, helm.parse_set_string(options[i + 1])), i + 2
        elif option == "--create-namespace":
            i += 1
        else:
            pytest.fail(f"README: option {option} of `{shlex.join(words)}` is not understood")
    assert chart.startswith("charts/") and (ROOT / chart / "Chart.yaml").is_file(), chart
    manifests = render(charts, Path(chart).name, values, namespace=namespace)
    assert release == "tessera"  # the names below are the release's
    return namespace, manifests


def tessera_containers(manifests: list[Manifest]) -> list[Manifest]:
    return [c for m in manifests if m["kind"] in ("Deployment", "DaemonSet")
            for c in m["spec"]["template"]["spec"]["containers"] if c["name"] != "kube-scheduler"]


def nats_servers(manifests: list[Manifest]) -> Manifest | None:
    found = [m for m in manifests if m["kind"] == "StatefulSet"
             and m["metadata"]["labels"].get("app.kubernetes.io/name") == "nats"]
    return found[0] if found else None


def by_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


# --- the walkthrough -----------------------------------------------------------------------------


def test_the_readme_has_the_two_command_quick_start_and_the_other_installs() -> None:
    quick = README.read_text().split("## Quick start", 1)[1].split("### Verify", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)```", quick, re.S)
    lines = [shlex.split(line) for line in block.strip().splitlines()]
    assert [line[:3] for line in lines] == [["helm", "dependency", "update"],
                                            ["helm", "install", "tessera"]]
    assert len(installs()) >= 4  # quick start, existing NATS, cert-manager, production


@pytest.mark.parametrize("words", installs(), ids=lambda w: " ".join(w[4:])[:60])
def test_every_install_in_the_readme_renders_valid_kubernetes(
    charts_dir: Path, words: list[str]  # noqa: F811
) -> None:
    _namespace, manifests = helm_install(charts_dir, words)
    for kube_version in KUBE_VERSIONS:
        validate_all(manifests, kube_version)
    # The services find NATS where the values say; with the bundled NATS, that is its Service.
    urls = {env_of(c)["NATS_URL"] for c in tessera_containers(manifests)}
    (url,) = urls
    servers = nats_servers(manifests)
    replicas = {env_of(c)["TESSERA_BUS_REPLICAS"] for c in tessera_containers(manifests)}
    if servers is not None:
        host = re.match(r"(?:nats|tls)://([^:/]+):4222$", url)
        assert host, url
        assert host.group(1) in {s["metadata"]["name"] for s in by_kind(manifests, "Service")}
        # Buckets and streams get as many replicas as there are NATS servers.
        assert replicas == {str(servers["spec"]["replicas"])}
        assert servers["spec"]["volumeClaimTemplates"], "JetStream without file storage"
    # A certificate for the webhook, whichever way: cert-manager's, or its own.
    admission = find(manifests, "Deployment", "tessera-admission")
    env = env_of(container(admission, "admission"))
    if by_kind(manifests, "Certificate"):
        assert "TESSERA_WEBHOOK_CERT_SECRET" not in env
    else:
        assert env["TESSERA_WEBHOOK_CERT_SECRET"].endswith("/tessera-admission-certs")


def test_the_quick_start_is_one_nats_server_and_no_prerequisite(charts_dir: Path) -> None:  # noqa: F811
    quick = [w for w in installs() if "charts/tessera/values-quickstart.yaml" in w
             and "--set" not in w]
    assert len(quick) == 1
    namespace, manifests = helm_install(charts_dir, quick[0])
    servers = nats_servers(manifests)
    assert servers is not None and servers["spec"]["replicas"] == 1
    assert not by_kind(manifests, "Certificate")  # no cert-manager needed
    for c in tessera_containers(manifests):
        env = env_of(c)
        assert "NATS_USER" not in env and "NATS_TLS_CA" not in env  # no Secrets to create first
        assert env["TESSERA_BUS_REPLICAS"] == "1"
    # Only Tessera's pods may reach the bundled NATS (its namespace is the release's).
    (policy,) = [p for p in by_kind(manifests, "NetworkPolicy")
                 if p["metadata"]["name"] == "tessera-nats-clients"]
    assert policy["metadata"]["namespace"] == namespace
    # "Verify" waits for the webhook by the name this install gives it.
    for words in commands():
        if words[3:5] == ["rollout", "status"]:
            assert words[:3] == ["kubectl", "-n", namespace]
            kind, name = words[5].split("/")
            find(manifests, kind.capitalize(), name)
    for kube_version in KUBE_VERSIONS:
        values = yaml.safe_load((ROOT / "charts/tessera/values-quickstart.yaml").read_text())
        assert lint_problems(charts_dir / "tessera", values, kube_version) == []


def test_without_the_nats_dependency_nothing_of_nats_is_installed(charts_dir: Path) -> None:  # noqa: F811
    manifests = render(charts_dir, "tessera")
    assert nats_servers(manifests) is None
    assert not [s for s in by_kind(manifests, "Service") if "nats" in s["metadata"]["name"]]


def test_production_needs_only_the_secrets_the_walkthrough_creates(charts_dir: Path) -> None:  # noqa: F811
    production = [w for w in installs() if "charts/tessera/values-production.yaml" in w]
    assert len(production) == 1
    _namespace, manifests = helm_install(charts_dir, production[0])
    servers = nats_servers(manifests)
    assert servers is not None and servers["spec"]["replicas"] == 3
    created = {"tessera-nats-admission", "tessera-nats-scheduler", "tessera-nats-quota",
               "tessera-nats-metrics",  # nats-auth/secrets.yaml (`tessera nats-config --out`)
               "tessera-command-trust"}  # the command keys' trust file, in the same file
    for words in commands():
        if words[:2] == ["kubectl", "-n"] and words[3:5] == ["create", "secret"]:
            created.add(words[6])
    created |= {s["metadata"]["name"] for s in by_kind(manifests, "Secret")}
    referenced: set[str] = set()
    for m in manifests:
        pod = m.get("spec", {}).get("template", {}).get("spec")
        if not pod or m["metadata"]["labels"].get("app.kubernetes.io/name") == "nats":
            continue
        referenced |= {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        for c in pod["containers"]:
            referenced |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                           if "secretKeyRef" in e.get("valueFrom", {})}
    assert referenced <= created, referenced - created
    # The NATS chart's own values (not rendered by the stand-in): the auth Secret the
    # walkthrough creates is mounted where the config's $include reads it.
    values = yaml.safe_load((ROOT / "charts/tessera/values-production.yaml").read_text())["nats"]
    (include,) = values["config"]["merge"].values()
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"]]
    (mount,) = [p["value"] for p in values["container"]["patch"]]
    assert volume["secret"]["secretName"] in created and mount["name"] == volume["name"]
    assert (Path("/etc/nats-config") / include).resolve().parent == Path(mount["mountPath"])
    assert values["config"]["nats"]["tls"]["secretName"] in created


def test_the_nats_dependency_is_the_official_chart_and_optional() -> None:
    chart = yaml.safe_load((ROOT / "charts/tessera/Chart.yaml").read_text())
    (nats,) = [d for d in chart["dependencies"] if d["name"] == "nats"]
    assert nats["repository"] == "https://nats-io.github.io/k8s/helm/charts/"
    assert nats["condition"] == "nats.enabled"
    values = yaml.safe_load((ROOT / "charts/tessera/values.yaml").read_text())
    assert values["nats"]["enabled"] is False
    assert values["nats"]["config"]["jetstream"]["enabled"] is True
    # The stand-in's version is within the declared range (so it stands in for a real release).
    low, high = re.match(r">=(\S+) <(\S+)$", nats["version"]).groups()  # type: ignore[union-attr]
    standin = yaml.safe_load((NATS_STANDIN / "Chart.yaml").read_text())["version"]

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(p) for p in text.split("."))

    assert version(low) <= version(standin) < version(high)


def test_the_verification_pod_asks_for_a_slice_with_hamis_names() -> None:
    applied = [w[-1] for w in commands() if w[:2] == ["kubectl", "apply"]]
    assert applied == ["charts/examples/verify-slice.yaml"]
    pod = yaml.safe_load((ROOT / applied[0]).read_text())
    for kube_version in KUBE_VERSIONS:
        kubernetes_validate.validate(pod, kube_version, strict=True)
    names = yaml.safe_load((ROOT / "charts/tessera/values.yaml").read_text())["global"][
        "resourceNames"]
    (c,) = pod["spec"]["containers"]
    limits = c["resources"]["limits"]
    assert set(limits) == {names["gpu"], names["memory"], names["cores"]}
    assert c["command"][0] == "nvidia-smi"
    assert pod["metadata"]["namespace"] not in ("kube-system", "tessera-system")  # not excluded
    logs = [w for w in commands() if w[:2] == ["kubectl", "logs"]]
    assert logs == [["kubectl", "logs", f"pod/{pod['metadata']['name']}"]]


BUNDLED = {"nats": {"enabled": True}, "global": {"nats": {"url": "nats://tessera-nats:4222"}}}


@pytest.mark.parametrize(("values", "message"), [
    (BUNDLED, "busReplicas is 3 but the bundled NATS has 1 server"),
    (merge(BUNDLED, {"nats": {"config": {"jetstream": {"enabled": False}}},
                     "global": {"config": {"busReplicas": 1}}}), "jetstream.enabled must be true"),
    (merge(BUNDLED, {"global": {"nats": {"url": "tls://nats.nats.svc.cluster.local:4222"},
                                "config": {"busReplicas": 1}}}), "is not the bundled NATS"),
], ids=["more-replicas-than-servers", "no-jetstream", "url-elsewhere"])
def test_a_bundled_nats_that_cannot_hold_the_buckets_is_refused(
    charts_dir: Path, values: dict[str, Any], message: str  # noqa: F811
) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(charts_dir, "tessera", values)
    fixed = merge(values, {"global": {"config": {"busReplicas": 1},
                                      "nats": {"url": "nats://tessera-nats.tessera-system.svc:4222"}},
                           "nats": {"config": {"jetstream": {"enabled": True}}}})
    assert nats_servers(render(charts_dir, "tessera", fixed)) is not None
