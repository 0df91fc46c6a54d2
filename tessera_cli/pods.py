"""`tessera apply`, `tessera get pods`, `tessera delete pod`: kubectl's basics for the local stack.

They speak the Kubernetes REST API to the server in the stack's kubeconfig (kube-sim under
`tessera up`), so they work against any API server that kubeconfig names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import typer
import yaml
from rich.console import Console
from rich.table import Table

from tessera.hami import ANN_DEVICES_ALLOCATED, ANN_DEVICES_TO_ALLOCATE, decode_pod_devices

PLURALS = {"Pod": "pods", "ResourceQuota": "resourcequotas"}
RESOURCE_ALIASES = {
    "pod": "pods",
    "pods": "pods",
    "po": "pods",
    "resourcequota": "resourcequotas",
    "resourcequotas": "resourcequotas",
    "quota": "resourcequotas",
}


class ApiError(Exception):
    pass


def server_from_kubeconfig(path: Path) -> str:
    config = yaml.safe_load(path.read_text())
    current = config.get("current-context")
    contexts = {c["name"]: c["context"] for c in config.get("contexts") or []}
    clusters = {c["name"]: c["cluster"] for c in config.get("clusters") or []}
    cluster_name = contexts.get(current, {}).get("cluster") if current else None
    cluster = clusters.get(cluster_name) if cluster_name else next(iter(clusters.values()), None)
    if not cluster or not cluster.get("server"):
        raise ApiError(f"{path}: no cluster server in the kubeconfig")
    return str(cluster["server"])


def api_client(state_dir: Path, kubeconfig: Path | None) -> httpx.Client:
    path = kubeconfig or Path(os.environ.get("TESSERA_KUBECONFIG") or state_dir / "kubeconfig")
    if not path.is_file():
        raise ApiError(f"no kubeconfig at {path}: is the stack running (`tessera up`)?")
    return httpx.Client(base_url=server_from_kubeconfig(path), timeout=30.0)


def _check(reply: httpx.Response) -> Any:
    if reply.status_code >= 400:
        try:
            message = reply.json().get("message") or reply.text
        except ValueError:
            message = reply.text
        raise ApiError(f"HTTP {reply.status_code}: {message}")
    return reply.json()


def _create(client: httpx.Client, doc: dict[str, Any], namespace: str) -> str:
    """Create an object; one that exists is replaced if it is a quota, reported otherwise."""
    kind = doc.get("kind", "Pod")
    plural = PLURALS.get(kind)
    if plural is None:
        raise ApiError(f"kind {kind!r} is not supported (Pod, ResourceQuota)")
    meta = doc.setdefault("metadata", {})
    namespace = meta.get("namespace") or namespace
    meta["namespace"] = namespace
    path = f"/api/v1/namespaces/{namespace}/{plural}"
    reply = client.post(path, json=doc)
    if reply.status_code == 409 and kind == "ResourceQuota":
        current = _check(client.get(f"{path}/{meta['name']}"))
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        _check(client.put(f"{path}/{meta['name']}", json=doc))
        return f"{plural}/{meta['name']} configured"
    if reply.status_code == 409:
        return f"{plural}/{meta.get('name')} unchanged (already exists)"
    created = _check(reply)
    return f"{plural}/{created['metadata']['name']} created"


def pod_gpus(pod: dict[str, Any]) -> list[list[dict[str, Any]]]:
    annotations = pod.get("metadata", {}).get("annotations") or {}
    text = annotations.get(ANN_DEVICES_ALLOCATED) or annotations.get(ANN_DEVICES_TO_ALLOCATE)
    if not text:
        return []
    try:
        return [[g.model_dump() for g in c] for c in decode_pod_devices(text)]
    except ValueError:
        return []


def pod_reason(pod: dict[str, Any]) -> str:
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason") or "")
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason") not in (None, "ContainerCreating"):
            return f"{waiting.get('reason')}: {waiting.get('message', '')}".strip(": ")
    return str(status.get("message") or "")


def pod_summary(pod: dict[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata", {})
    status = pod.get("status") or {}
    return {
        "namespace": meta.get("namespace", ""),
        "name": meta.get("name", ""),
        "uid": meta.get("uid", ""),
        "phase": status.get("phase", "Pending"),
        "node": (pod.get("spec") or {}).get("nodeName") or "",
        "gpus": pod_gpus(pod),
        "reason": pod_reason(pod),
        "created": meta.get("creationTimestamp", ""),
    }


def describe_gpus(gpus: list[list[dict[str, Any]]]) -> str:
    """`GPU-3fe337b5:3000MiB/30%` per device; containers separated by ` | `."""
    parts = []
    for container in gpus:
        if container:
            parts.append(" ".join(
                f"{g['uuid'][:12]}:{g['memory_mib']}MiB/{g['cores']}%" for g in container
            ))
    return " | ".join(parts)


def _fail(error: Exception) -> None:
    Console(stderr=True).print(f"[red]error:[/red] {error}")
    raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    state_option = typer.Option(Path(".tessera"), "--state-dir", help="the stack's state dir")
    kubeconfig_option = typer.Option(None, "--kubeconfig", help="default: <state-dir>/kubeconfig")

    @app.command("apply")
    def apply_command(
        filename: list[Path] = typer.Option(..., "-f", "--filename", help="pod/quota YAML"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        state_dir: Path = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """Create the pods (and ResourceQuotas) in YAML files, as `kubectl apply -f` would."""
        failed = False
        try:
            with api_client(state_dir, kubeconfig) as client:
                for path in filename:
                    for doc in yaml.safe_load_all(path.read_text()):
                        if not doc:
                            continue
                        try:
                            print(_create(client, doc, namespace))
                        except ApiError as error:
                            failed = True
                            name = doc.get("metadata", {}).get("name", "?")
                            Console(stderr=True).print(f"[red]{path}: {name}:[/red] {error}")
        except (ApiError, OSError, httpx.HTTPError, yaml.YAMLError) as error:
            _fail(error)
        if failed:
            raise typer.Exit(1)

    @app.command("get")
    def get_command(
        resource: str = typer.Argument("pods", help="pods (or resourcequotas)"),
        namespace: str | None = typer.Option(None, "-n", "--namespace"),
        all_namespaces: bool = typer.Option(False, "-A", "--all-namespaces"),
        output: str = typer.Option("table", "-o", "--output", help="table | json"),
        state_dir: Path = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """List pods with their state, node, GPU slices and, when pending, why."""
        plural = RESOURCE_ALIASES.get(resource.lower())
        if plural is None:
            _fail(ApiError(f"unknown resource {resource!r}"))
        ns = None if all_namespaces else (namespace or "default")
        path = f"/api/v1/namespaces/{ns}/{plural}" if ns else f"/api/v1/{plural}"
        try:
            with api_client(state_dir, kubeconfig) as client:
                items = _check(client.get(path)).get("items") or []
        except (ApiError, OSError, httpx.HTTPError) as error:
            _fail(error)
        if plural == "resourcequotas":
            _print_quotas(items, output)
            return
        pods = [pod_summary(p) for p in items]
        if output == "json":
            print(json.dumps(pods, indent=2))
            return
        table = Table(box=None, pad_edge=False)
        for column in ("NAMESPACE", "NAME", "STATUS", "NODE", "GPUS", "REASON"):
            table.add_column(column, overflow="fold")
        for pod in pods:
            table.add_row(
                pod["namespace"],
                pod["name"],
                pod["phase"],
                pod["node"] or "-",
                describe_gpus(pod["gpus"]) or "-",
                pod["reason"],
            )
        Console().print(table)

    @app.command("delete")
    def delete_command(
        resource: str = typer.Argument(..., help="pod"),
        names: list[str] = typer.Argument(None, help="names (none with --all)"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        all_pods: bool = typer.Option(False, "--all", help="every object in the namespace"),
        state_dir: Path = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """Delete pods (or quotas) by name."""
        plural = RESOURCE_ALIASES.get(resource.lower())
        if plural is None:
            _fail(ApiError(f"unknown resource {resource!r}"))
        path = f"/api/v1/namespaces/{namespace}/{plural}"
        failed = False
        try:
            with api_client(state_dir, kubeconfig) as client:
                targets = list(names or [])
                if all_pods:
                    targets = [i["metadata"]["name"] for i in _check(client.get(path))["items"]]
                for name in targets:
                    try:
                        _check(client.delete(f"{path}/{name}"))
                        print(f'{plural[:-1]} "{name}" deleted')
                    except ApiError as error:
                        failed = True
                        Console(stderr=True).print(f"[red]{name}:[/red] {error}")
        except (ApiError, OSError, httpx.HTTPError) as error:
            _fail(error)
        if failed:
            raise typer.Exit(1)


def _print_quotas(items: list[dict[str, Any]], output: str) -> None:
    if output == "json":
        print(json.dumps(items, indent=2))
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAMESPACE", "NAME", "HARD", "USED"):
        table.add_column(column)
    for quota in items:
        hard = (quota.get("spec") or {}).get("hard") or {}
        used = (quota.get("status") or {}).get("used") or {}
        table.add_row(
            quota["metadata"].get("namespace", ""),
            quota["metadata"]["name"],
            ", ".join(f"{k}={v}" for k, v in hard.items()),
            ", ".join(f"{k}={v}" for k, v in used.items()),
        )
    Console().print(table)
