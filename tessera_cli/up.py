"""`tessera up`: the whole local stack in one command.

NATS (embedded unless NATS_URL is set), kube-sim with N simulated nodes of M GPUs, and every
service. `--apply DIR` then creates the pod YAMLs found there (what `make demo` does), and the
live table shows the services, the pods and the dashboard's URL until Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import typer
import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tessera_cli.stack import (
    LocalStack,
    SimNode,
    StackPorts,
    default_services,
    load_nodes,
    make_nodes,
)
from tessera_cli.stack_auth import ADMIN_ENV_NAME


def status_table(stack: LocalStack) -> Table:
    table = Table(title=f"Tessera local stack (NATS {stack.nats_url}, API {stack.api_url})")
    table.add_column("service")
    table.add_column("pid", justify="right")
    table.add_column("status")
    table.add_column("ready")
    table.add_column("up", justify="right")
    table.add_column("log")
    for running in stack.running:
        status = running.status
        style = "green" if status == "running" else "red"
        ready = stack.readiness(running.spec.name) if status == "running" else ""
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
    from tessera_cli.pods import describe_gpus, pod_summary

    try:
        reply = httpx.get(f"{stack.api_url}/api/v1/pods", timeout=2.0)
        pods = [pod_summary(p) for p in reply.json().get("items") or []]
    except (httpx.HTTPError, ValueError):
        return Text("(kube-sim not answering)")
    table = Table(title="pods (tessera get pods -A)", box=None)
    for column in ("NAMESPACE", "NAME", "STATUS", "NODE", "GPUS", "REASON"):
        table.add_column(column, overflow="fold")
    for pod in pods[:40]:
        table.add_row(
            pod["namespace"],
            pod["name"],
            pod["phase"],
            pod["node"] or "-",
            describe_gpus(pod["gpus"]) or "-",
            pod["reason"][:120],
        )
    return table


def screen(stack: LocalStack) -> Group:
    admin = (
        f"[bold]NATS as admin (tessera quota/limits/events):[/bold] "
        f"TESSERA_ENV_FILE={stack.state_dir / ADMIN_ENV_NAME}\n" if stack.auth else ""
    )
    footer = Text.from_markup(
        f"\n[bold]dashboard:[/bold] {stack.dashboard_url}    "
        f"[bold]metrics:[/bold] {stack.dashboard_url}metrics    "
        f"[bold]kubeconfig:[/bold] {stack.kubeconfig}\n"
        f"{admin}"
        "try: tessera get pods -A · tessera apply -f examples/… · tessera events · Ctrl-C stops"
    )
    return Group(status_table(stack), pods_table(stack), footer)


def apply_directory(stack: LocalStack, directory: Path, console: Console) -> None:
    """Create every Pod/ResourceQuota in the YAMLs of `directory` (by file name), as
    `tessera apply` does; other documents (a kubeconfig, say) are skipped."""
    from tessera_cli.pods import PLURALS, _create, api_client

    files = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml"))
    with api_client(stack.state_dir, stack.kubeconfig) as client:
        for path in files:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
            for doc in docs:
                if doc.get("kind") not in PLURALS:
                    continue
                try:
                    console.print(f"{path.name}: {_create(client, doc, 'default')}")
                except Exception as error:  # a denied example is part of the demo
                    console.print(f"{path.name}: [yellow]{error}[/yellow]")
                if doc.get("kind") == "ResourceQuota":
                    # The quota service learns quotas from its watch; give it a moment so the
                    # examples that follow are checked against this one.
                    time.sleep(2.0)


def wait_for_nodes(stack: LocalStack, nodes: list[SimNode], timeout_s: float) -> None:
    """Until every simulated node's agent has registered its GPUs (node annotation set)."""
    deadline = time.monotonic() + timeout_s
    wanted = {n.name for n in nodes if n.gpus > 0}
    while time.monotonic() < deadline:
        try:
            items = httpx.get(f"{stack.api_url}/api/v1/nodes", timeout=2.0).json()["items"]
            ready = {
                n["metadata"]["name"]
                for n in items
                if "hami.io/node-nvidia-register" in (n["metadata"].get("annotations") or {})
            }
            if wanted <= ready:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)


def choose_nodes(
    nodes: int,
    gpus_per_node: int,
    gpu_memory: int,
    gpu_model: str,
    numa_nodes: int,
    nodes_file: Path | None,
) -> list[SimNode]:
    if nodes_file is not None:
        return load_nodes(nodes_file)
    return make_nodes(nodes, gpus_per_node, gpu_memory, gpu_model, numa_nodes)


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up_command(
        state_dir: Path = typer.Option(Path(".tessera"), help="NATS data, logs, certs, kubeconfig"),
        duration: float | None = typer.Option(
            None, help="stop by itself after this many seconds (default: run until Ctrl-C)"
        ),
        nodes: int = typer.Option(2, "--nodes", min=0, help="simulated nodes"),
        gpus_per_node: int = typer.Option(4, "--gpus-per-node", min=0, max=64),
        gpu_memory: int = typer.Option(24576, "--gpu-memory", min=1, help="MiB per GPU"),
        gpu_model: str = typer.Option("NVIDIA A10", "--gpu-model", help="NVML name of the GPUs"),
        numa_nodes: int = typer.Option(1, "--numa-nodes", min=1, help="NUMA nodes per node"),
        nodes_file: Path | None = typer.Option(
            None, "--nodes-file", help="YAML list of nodes {name, gpus, gpu_memory_mib, ...}"
        ),
        apply: Path | None = typer.Option(
            None, "--apply", help="create the pod YAMLs in this directory once the stack is up"
        ),
        run_containers: bool = typer.Option(
            False, "--run-containers", help="run containers' commands as local processes"
        ),
        free_ports: bool = typer.Option(
            False, "--free-ports", help="pick free ports instead of 6443/8888/9443/9394"
        ),
        nats_cluster: int = typer.Option(
            1, "--nats-cluster", min=1, max=5,
            help="NATS servers: 3 runs a JetStream cluster (each its own store, buckets and "
            "stream with 3 replicas)",
        ),
        kubelet_delay: float = typer.Option(
            0.0, "--kubelet-delay", min=0.0,
            help="seconds each simulated kubelet waits before admitting a bound pod (Allocate), "
            "as real kubelets do 0.1-1 s after the bind",
        ),
        kubelet_jitter: float = typer.Option(
            0.0, "--kubelet-jitter", min=0.0, help="± random spread on --kubelet-delay, per pod"
        ),
    ) -> None:
        """Start NATS, kube-sim with simulated GPU nodes, and every service; Ctrl-C stops all."""
        console = Console()
        sim_nodes = choose_nodes(
            nodes, gpus_per_node, gpu_memory, gpu_model, numa_nodes, nodes_file
        )
        ports = StackPorts.free() if free_ports else StackPorts()
        services = default_services(
            sim_nodes, state_dir, ports, run_containers, kubelet_delay, kubelet_jitter
        )
        stack = LocalStack(
            state_dir, services, nats_url=os.environ.get("NATS_URL"), ports=ports,
            nats_cluster=nats_cluster if nats_cluster > 1 else 0,
        )  # fmt: skip
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            with console.status("starting NATS, kube-sim and services..."):
                stack.start()
                stack.wait_ready()
                wait_for_nodes(stack, sim_nodes, timeout_s=30.0)
            if apply is not None:
                apply_directory(stack, apply, console)
            _live(stack, console, stop, duration)
        except KeyboardInterrupt:
            pass
        finally:
            with console.status("stopping..."):
                stack.stop()
            console.print(status_table(stack))
            console.print("[bold]stopped[/bold]")


def _live(stack: LocalStack, console: Console, stop: threading.Event, duration: Any) -> None:
    with Live(screen(stack), console=console, refresh_per_second=1) as live:
        started = time.monotonic()
        while not stop.is_set():
            if duration is not None and time.monotonic() - started >= duration:
                break
            stop.wait(1.0)
            live.update(screen(stack))
    if duration is not None:
        # Left on screen after the live view ends (make demo with a duration, CI logs).
        console.print(pods_table(stack))
        console.print(f"[bold]dashboard:[/bold] {stack.dashboard_url}")
