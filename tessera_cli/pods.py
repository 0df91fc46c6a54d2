"""`tessera apply`, `tessera get`, `tessera delete`: kubectl's habits for the local stack.

They speak the Kubernetes REST API to the server the kubeconfig names (kube-sim under
`tessera up`; found as tessera_cli.locate says), so they work against any API server.
Imports stay light (no httpx, rich or pydantic): `tessera get pods` starts fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from tessera.gpuid import short_uuid
from tessera.hami import ANN_DEVICES_ALLOCATED, ANN_DEVICES_TO_ALLOCATE, parse_pod_devices
from tessera.reasons import readable

from .kube import ApiError, KubeClient, api_client
from .locate import CliError, fail
from .resources import Kind, by_name, known_names
from .table import render


def pod_gpus(pod: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The pod's slices per container, as the node agent last recorded them (it rewrites
    `hami.io/vgpu-devices-allocated` from the ledger on `tessera limits set`), else as the
    scheduler granted them."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    text = annotations.get(ANN_DEVICES_ALLOCATED) or annotations.get(ANN_DEVICES_TO_ALLOCATE)
    if not text:
        return []
    try:
        containers = parse_pod_devices(text)
    except ValueError:
        return []
    return [
        [{"uuid": u, "type": t, "memory_mib": m, "cores": c} for u, t, m, c in container]
        for container in containers
    ]


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
    reason = pod_reason(pod)
    return {
        "namespace": meta.get("namespace", ""),
        "name": meta.get("name", ""),
        "uid": meta.get("uid", ""),
        "phase": status.get("phase", "Pending"),
        "node": (pod.get("spec") or {}).get("nodeName") or "",
        "gpus": pod_gpus(pod),
        "reason": readable(reason),
        "created": meta.get("creationTimestamp", ""),
    }


def describe_gpus(gpus: list[list[dict[str, Any]]]) -> str:
    """`GPU-3fe337b5:3000MiB/30%` per device; containers separated by ` | `."""
    parts = []
    for container in gpus:
        if container:
            parts.append(" ".join(
                f"{short_uuid(g['uuid'])}:{g['memory_mib']}MiB/{g['cores']}%" for g in container
            ))
    return " | ".join(parts)


def resolve_kind(resource: str) -> Kind:
    kind = by_name(resource)
    if kind is None:
        raise CliError(f'the server doesn\'t have a resource type "{resource}" '
                       f"(tessera knows {known_names()})")
    return kind


# --- apply ------------------------------------------------------------------------------------


def apply_files(client: KubeClient, files: list[str], namespace: str, recursive: bool,
                out: Any = None, err: Any = None) -> bool:
    """Apply every document of `files` in order; False if any failed (each said why)."""
    from .apply import apply_one, quote_for
    from .manifests import load

    out = out or sys.stdout
    err = err or sys.stderr
    ok = True
    for manifest in load(files, recursive):
        try:
            result = apply_one(client, manifest, namespace)
            _print_warnings(client, err)
            print(result, file=out, flush=True)
        except ApiError as error:
            _print_warnings(client, err)
            if not error.status:  # the server is away: stop at the first
                raise
            ok = False
            quoted = quote_for(manifest, str(error))
            label = f"{manifest.kind.lower()}/{manifest.name}"
            print(f"error: {manifest.where}: {label}: {error}"
                  + (f"\n  {quoted}" if quoted else ""), file=err, flush=True)
        except CliError as error:
            ok = False
            print(f"error: {error}", file=err, flush=True)
    return ok


def _print_warnings(client: KubeClient, err: Any) -> None:
    """The API server's warnings (admission's, field validation's), as kubectl prints them."""
    for warning in client.take_warnings():
        print(f"Warning: {warning}", file=err, flush=True)


# --- get --------------------------------------------------------------------------------------


def pods_table(pods: list[dict[str, Any]], all_namespaces: bool) -> str:
    headers = ["NAME", "STATUS", "NODE", "GPUS", "REASON"]
    rows = [[p["name"], p["phase"], p["node"] or "-", describe_gpus(p["gpus"]) or "-",
             p["reason"]] for p in pods]  # fmt: skip
    if all_namespaces:
        headers.insert(0, "NAMESPACE")
        rows = [[p["namespace"], *row] for p, row in zip(pods, rows, strict=True)]
    return render(headers, rows)


def quotas_table(items: list[dict[str, Any]], all_namespaces: bool) -> str:
    rows = []
    for quota in items:
        hard = (quota.get("spec") or {}).get("hard") or {}
        used = (quota.get("status") or {}).get("used") or {}
        rows.append([quota["metadata"].get("namespace", ""), quota["metadata"]["name"],
                     ", ".join(f"{k}={v}" for k, v in hard.items()),
                     ", ".join(f"{k}={v}" for k, v in used.items())])  # fmt: skip
    return render(["NAMESPACE", "NAME", "HARD", "USED"], rows)


def generic_table(items: list[dict[str, Any]], kind: Kind, all_namespaces: bool) -> str:
    rows = []
    for item in items:
        meta = item.get("metadata") or {}
        row = [meta.get("name", ""), meta.get("creationTimestamp", "")]
        rows.append([meta.get("namespace", ""), *row] if kind.namespaced else row)
    headers = ["NAME", "CREATED"]
    return render(["NAMESPACE", *headers] if kind.namespaced else headers, rows)


def _nothing(kind: Kind, namespace: str | None) -> str:
    if kind.namespaced and namespace:
        return f"No resources found in {namespace} namespace."
    return "No resources found"


# --- commands ---------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    state_option = typer.Option(
        None, "--state-dir", help="the stack's state dir (default: $TESSERA_STATE_DIR or .tessera)"
    )
    kubeconfig_option = typer.Option(
        None, "--kubeconfig",
        help="default: $TESSERA_KUBECONFIG, the running stack's, $KUBECONFIG, ~/.kube/config",
    )

    @app.command("apply")
    def apply_command(
        filename: list[str] = typer.Option(..., "-f", "--filename",
                                           help="file, directory or - (repeatable)"),
        recursive: bool = typer.Option(False, "-R", "--recursive",
                                       help="with a directory: its subdirectories too"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        state_dir: Path | None = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """Create or update the objects in YAML files, as `kubectl apply -f`."""
        try:
            with api_client(state_dir, kubeconfig) as client:
                ok = apply_files(client, filename, namespace, recursive)
        except CliError as error:
            fail(error)
        if not ok:
            raise typer.Exit(1)

    @app.command("get")
    def get_command(
        resource: str = typer.Argument("pods", help="pods, resourcequotas, nodes, events, ..."),
        names: list[str] = typer.Argument(None, help="only these"),
        namespace: str | None = typer.Option(None, "-n", "--namespace"),
        all_namespaces: bool = typer.Option(False, "-A", "--all-namespaces"),
        output: str = typer.Option("table", "-o", "--output", help="table | json | name"),
        state_dir: Path | None = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """List pods with their state, node, GPU slices and, when pending, why."""
        try:
            kind = resolve_kind(resource)
            ns = None if all_namespaces else (namespace or "default")
            with api_client(state_dir, kubeconfig) as client:
                items = client.get(kind.collection(ns)).get("items") or []
        except CliError as error:
            fail(error)
        if names:
            items = [i for i in items if (i.get("metadata") or {}).get("name") in names]
            missing = set(names) - {(i.get("metadata") or {}).get("name") for i in items}
            for name in sorted(missing):
                print(f'Error from server (NotFound): {kind.plural} "{name}" not found',
                      file=sys.stderr)
            if missing and not items:
                raise typer.Exit(1)
        if output == "name":
            print("\n".join(f"{kind.singular}/{i['metadata']['name']}" for i in items))
            return
        if kind.kind == "Pod":
            pods = [pod_summary(p) for p in items]
            if output == "json":
                print(json.dumps(pods, indent=2))
            elif pods:
                print(pods_table(pods, all_namespaces))
            else:
                print(_nothing(kind, ns), file=sys.stderr)
            return
        if output == "json":
            print(json.dumps(items, indent=2))
        elif not items:
            print(_nothing(kind, ns), file=sys.stderr)
        elif kind.kind == "ResourceQuota":
            print(quotas_table(items, all_namespaces))
        else:
            print(generic_table(items, kind, all_namespaces))

    @app.command("delete")
    def delete_command(
        resource: str = typer.Argument(None, help="pod, resourcequota, ... (not with -f)"),
        names: list[str] = typer.Argument(None, help="names (none with --all or -f)"),
        filename: list[str] = typer.Option(None, "-f", "--filename",
                                           help="delete the objects these files describe"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        all_objects: bool = typer.Option(False, "--all", help="every object in the namespace"),
        ignore_not_found: bool = typer.Option(False, "--ignore-not-found",
                                              help="an object already gone is not an error"),
        state_dir: Path | None = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """Delete pods (or quotas) by name, or from files."""
        try:
            targets = _delete_targets(resource, names, filename, namespace, all_objects)
            with api_client(state_dir, kubeconfig) as client:
                ok = _delete(client, targets, namespace, all_objects, ignore_not_found)
        except CliError as error:
            fail(error)
        if not ok:
            raise typer.Exit(1)


def _delete_targets(resource: str | None, names: list[str] | None, files: list[str] | None,
                    namespace: str, all_objects: bool) -> list[tuple[Kind, str | None, str]]:
    """(kind, namespace, name) to delete; name '' means every one (--all)."""
    if files:
        from .apply import kind_of
        from .manifests import load

        targets = []
        for manifest in load(files):
            kind = kind_of(manifest)
            ns = (manifest.doc["metadata"].get("namespace") or namespace) if kind.namespaced \
                else None  # fmt: skip
            targets.append((kind, ns, manifest.name))
        return targets
    if not resource:
        raise CliError("say what to delete: a resource and names, --all, or -f FILE")
    kind = resolve_kind(resource)
    ns = namespace if kind.namespaced else None
    if all_objects:
        return [(kind, ns, "")]
    if not names:
        raise CliError(f"resource(s) were provided, but no name was specified "
                       f"(tessera delete {resource} NAME, or --all)")
    return [(kind, ns, name) for name in names]


def _delete(client: KubeClient, targets: list[tuple[Kind, str | None, str]], namespace: str,
            all_objects: bool, ignore_not_found: bool) -> bool:
    ok = True
    for kind, ns, name in targets:
        if not name:  # --all
            items = client.get(kind.collection(ns)).get("items") or []
            if not items:
                print(_nothing(kind, ns), file=sys.stderr)
            names = [i["metadata"]["name"] for i in items]
        else:
            names = [name]
        for each in names:
            try:
                client.delete(kind.item(ns, each))
                print(f'{kind.singular} "{each}" deleted')
            except ApiError as error:
                if error.status == 404:
                    if not ignore_not_found:
                        ok = False
                        where = f" in namespace {ns}" if ns else ""
                        print(f'Error from server (NotFound): {kind.plural} "{each}" not found'
                              f"{where}", file=sys.stderr)
                    continue
                if not error.status:
                    raise
                ok = False
                print(f"error: {kind.singular}/{each}: {error}", file=sys.stderr)
    return ok
