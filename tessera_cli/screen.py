"""The live screen of `tessera up` on a terminal: services, pods and where to look next."""

from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from .kube import KubeClient, KubeConfig
from .locate import CliError
from .pods import describe_gpus, pod_summary
from .stack import LocalStack
from .stack_auth import ADMIN_ENV_NAME


def status_table(stack: LocalStack, probe: bool = True) -> Table:
    table = Table(title=f"Tessera local stack (NATS {stack.nats_url}, API {stack.api_url})")
    for column in ("service", "pid", "status", "ready", "up", "log"):
        table.add_column(column, justify="right" if column in ("pid", "up") else "left")
    for running in stack.running:
        status = running.status
        style = "green" if status == "running" else "red"
        ready = stack.readiness(running.spec.name) if probe and status == "running" else ""
        ready_style = "green" if ready == "ready" else "yellow"
        table.add_row(
            running.spec.name,
            str(running.proc.pid),
            f"[{style}]{status}[/{style}]",
            f"[{ready_style}]{ready}[/{ready_style}]" if ready else "",
            f"{time.time() - running.started_at:.0f}s",
            str(running.log_path),
        )
    return table


def pods_table(stack: LocalStack) -> Table | Text:
    try:
        with KubeClient(KubeConfig(server=stack.api_url), timeout_s=2.0) as client:
            pods = [pod_summary(p) for p in client.get("/api/v1/pods").get("items") or []]
    except CliError:
        return Text("(kube-sim not answering)")
    table = Table(title="pods (tessera get pods -A)", box=None)
    for column in ("NAMESPACE", "NAME", "STATUS", "NODE", "GPUS", "REASON"):
        table.add_column(column, overflow="fold")
    for pod in pods[:40]:  # Text: what the cluster says is shown as written, never as markup
        table.add_row(*(Text(str(cell)) for cell in (
            pod["namespace"], pod["name"], pod["phase"], pod["node"] or "-",
            describe_gpus(pod["gpus"]) or "-", pod["reason"][:160])))  # fmt: skip
    return table


def screen(stack: LocalStack) -> Group:
    admin = (
        f"[bold]NATS as admin (tessera quota/limits/events find it by themselves):[/bold] "
        f"TESSERA_ENV_FILE={stack.state_dir / ADMIN_ENV_NAME}\n" if stack.auth else ""
    )
    footer = Text.from_markup(
        f"\n[bold]dashboard:[/bold] {stack.dashboard_url}    "
        f"[bold]metrics:[/bold] {stack.dashboard_url}metrics    "
        f"[bold]kubeconfig:[/bold] {stack.kubeconfig}\n"
        f"{admin}"
        "try: tessera get pods -A · tessera apply -f examples/ · tessera events · Ctrl-C stops"
    )
    return Group(status_table(stack), pods_table(stack), footer)
