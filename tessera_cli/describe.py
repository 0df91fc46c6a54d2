"""`tessera describe pod NAME`: a pod's GPU slices, annotations and Kubernetes Events, as
`kubectl describe pod` shows them (the scheduler's FilteringFailed / BindingSucceed, ...)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from tessera_cli.pods import ApiError, _check, _fail, api_client, describe_gpus, pod_summary


def pod_events(client: httpx.Client, namespace: str, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The events whose involvedObject is this pod (by uid when known), oldest first."""
    meta = pod.get("metadata") or {}
    items = _check(client.get(f"/api/v1/namespaces/{namespace}/events")).get("items") or []
    uid = meta.get("uid")

    def about_pod(event: dict[str, Any]) -> bool:
        involved = event.get("involvedObject") or {}
        if involved.get("kind", "Pod") != "Pod" or involved.get("name") != meta.get("name"):
            return False
        return not uid or not involved.get("uid") or involved.get("uid") == uid

    chosen = [e for e in items if about_pod(e)]
    return sorted(chosen, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))


def render(pod: dict[str, Any], events: list[dict[str, Any]], console: Console) -> None:
    summary = pod_summary(pod)
    meta = pod.get("metadata") or {}
    console.print(f"Name:        {summary['name']}")
    console.print(f"Namespace:   {summary['namespace']}")
    console.print(f"Node:        {summary['node'] or '<none>'}")
    console.print(f"Status:      {summary['phase']}")
    console.print(f"GPUs:        {describe_gpus(summary['gpus']) or '<none>'}")
    if summary["reason"]:
        console.print(f"Reason:      {summary['reason']}")
    annotations = meta.get("annotations") or {}
    console.print("Annotations:" + ("" if annotations else " <none>"))
    for key in sorted(annotations):
        console.print(f"  {key}: {annotations[key]}")
    console.print("Events:" + ("" if events else " <none>"))
    if events:
        table = Table(box=None, pad_edge=False)
        for column in ("TYPE", "REASON", "FROM", "LAST SEEN", "MESSAGE"):
            table.add_column(column, overflow="fold")
        for event in events:
            source = (event.get("source") or {}).get("component") or event.get(
                "reportingComponent", "")
            table.add_row(event.get("type", ""), event.get("reason", ""), source,
                          str(event.get("lastTimestamp") or ""), event.get("message", ""))
        console.print(table)


def register(app: typer.Typer) -> None:
    @app.command("describe")
    def describe_command(
        resource: str = typer.Argument(..., help="pod"),
        name: str = typer.Argument(..., help="the pod's name"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        state_dir: Path = typer.Option(Path(".tessera"), "--state-dir",
                                       help="the stack's state dir"),
        kubeconfig: Path | None = typer.Option(None, "--kubeconfig",
                                               help="default: <state-dir>/kubeconfig"),
    ) -> None:
        """Show a pod's GPU slices, annotations and Kubernetes Events (kubectl describe pod)."""
        if resource.lower() not in ("pod", "pods", "po"):
            _fail(ApiError(f"unknown resource {resource!r} (pod)"))
        try:
            with api_client(state_dir, kubeconfig) as client:
                pod = _check(client.get(f"/api/v1/namespaces/{namespace}/pods/{name}"))
                events = pod_events(client, namespace, pod)
        except (ApiError, OSError, httpx.HTTPError) as error:
            _fail(error)
        render(pod, events, Console(width=200))
