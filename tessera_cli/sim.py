"""`tessera sim replay`: replay a pod trace against simulated nodes, once per policy.

Each policy gets a fresh local stack (NATS, kube-sim, every service, one node agent per simulated
node) with `TESSERA_GPU_SCHEDULER_POLICY` and `TESSERA_NODE_SCHEDULER_POLICY` set to it; the
trace's pods are created and deleted through kube-sim's API in trace order, each waiting for the
scheduler's decision, so the placements are the real scheduler's (no copy of its rules here: a
CLI does not import a service). Reports pods placed, GPU memory/compute utilisation and
fragmentation per policy, and draws them in a PNG.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from tessera.hami import ANN_NODE_REGISTER, decode_node_register
from tessera_cli.plain_tables import show
from tessera_cli.stack import (
    LocalStack,
    SimNode,
    StackPorts,
    default_services,
    load_nodes,
    make_nodes,
    short_socket_root,
)
from tessera_cli.whatif import PolicyResult, TraceEvent, load_trace, render_chart, snapshot

DECISION_TIMEOUT_S = 15.0


def _decided(pod: dict[str, Any]) -> bool:
    """Bound, or the scheduler said why not."""
    if (pod.get("spec") or {}).get("nodeName"):
        return True
    # Unschedulable is a decision; a SchedulerError (a bind that lost a race) is retried.
    return any(
        c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


class Replayer:
    def __init__(self, client: httpx.AsyncClient, namespaces: set[str]) -> None:
        self.client = client
        self.namespaces = namespaces

    async def gpus(self) -> dict[str, int]:
        nodes = (await self.client.get("/api/v1/nodes")).json()["items"]
        gpus: dict[str, int] = {}
        for node in nodes:
            text = (node["metadata"].get("annotations") or {}).get(ANN_NODE_REGISTER)
            for device in decode_node_register(text) if text else []:
                gpus[device.uuid] = device.memory_mib
        return gpus

    async def pods(self) -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = []
        for namespace in sorted(self.namespaces):
            reply = await self.client.get(f"/api/v1/namespaces/{namespace}/pods")
            pods += reply.json()["items"]
        return pods

    async def pod(self, event: TraceEvent) -> dict[str, Any] | None:
        reply = await self.client.get(f"/api/v1/namespaces/{event.namespace}/pods/{event.name}")
        return reply.json() if reply.status_code == 200 else None

    async def create(self, event: TraceEvent) -> str:
        """'' once the scheduler decided about the pod, else why it was not created."""
        deadline = time.monotonic() + DECISION_TIMEOUT_S
        while True:
            reply = await self.client.post(
                f"/api/v1/namespaces/{event.namespace}/pods", json=event.to_pod()
            )
            if reply.status_code in (201, 409):
                break
            if reply.status_code < 500 or time.monotonic() > deadline:
                return str(reply.json().get("message", reply.text))
            await asyncio.sleep(0.2)
        while time.monotonic() < deadline:
            pod = await self.pod(event)
            if pod is None or _decided(pod):
                return ""
            await asyncio.sleep(0.05)
        return ""

    async def delete(self, event: TraceEvent) -> None:
        await self.client.delete(f"/api/v1/namespaces/{event.namespace}/pods/{event.name}")
        # The scheduler releases the slices when it sees the delete; pending pods then get a
        # chance (kube-sim retries them at once). A short settle keeps the replay in order.
        await asyncio.sleep(0.3)


async def replay_on(stack: LocalStack, events: list[TraceEvent], policy: str) -> PolicyResult:
    result = PolicyResult(policy)
    async with httpx.AsyncClient(base_url=stack.api_url, timeout=30.0) as client:
        replayer = Replayer(client, {e.namespace for e in events})
        gpus = await replayer.gpus()
        created: list[str] = []
        refused: dict[str, str] = {}
        for event in events:
            if event.op == "create":
                created.append(f"{event.namespace}/{event.name}")
                why = await replayer.create(event)
                if why:
                    refused[f"{event.namespace}/{event.name}"] = why
            else:
                await replayer.delete(event)
            pods = await replayer.pods()
            for pod in pods:
                if (pod.get("spec") or {}).get("nodeName"):
                    meta = pod["metadata"]
                    result.ever_placed.add(f"{meta['namespace']}/{meta['name']}")
            result.snapshots.append(snapshot(gpus, pods))
        result.never_placed = [
            f"{n}: {refused[n]}" if n in refused else n
            for n in created if n not in result.ever_placed
        ]
    return result


def run_policy(nodes: list[SimNode], events: list[TraceEvent], policy: str) -> PolicyResult:
    from tessera_cli.up import wait_until_ready

    state_dir = Path(tempfile.mkdtemp(prefix="tessera-sim-"))
    ports = StackPorts.free()
    stack = LocalStack(
        state_dir, default_services(nodes, state_dir, ports), ports=ports,
        extra_env={"TESSERA_GPU_SCHEDULER_POLICY": policy,
                   "TESSERA_NODE_SCHEDULER_POLICY": policy},
    )
    try:
        stack.start()
        wait_until_ready(stack, nodes, timeout_s=60.0)
        return asyncio.run(replay_on(stack, events, policy))
    finally:
        stack.stop()
        shutil.rmtree(short_socket_root(state_dir), ignore_errors=True)
        shutil.rmtree(state_dir, ignore_errors=True)


def results_table(results: list[PolicyResult]) -> Table:
    table = Table(title="what-if replay")
    summaries = [r.summary() for r in results]
    table.add_column("figure")
    for summary in summaries:
        table.add_column(str(summary["policy"]), justify="right")
    for key in summaries[0]:
        if key == "policy":
            continue
        table.add_row(key.replace("_", " "), *[str(s[key]) for s in summaries])
    return table


def register(app: typer.Typer) -> None:
    sim = typer.Typer(help="what-if simulations against simulated nodes", no_args_is_help=True)
    app.add_typer(sim, name="sim")

    @sim.command("replay")
    def replay_command(
        trace: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL pod trace"),
        nodes: int = typer.Option(2, "--nodes", min=1, help="simulated nodes"),
        gpus_per_node: int = typer.Option(4, "--gpus-per-node", min=1, max=64),
        gpu_memory: int = typer.Option(24576, "--gpu-memory", min=1, help="MiB per GPU"),
        gpu_model: str = typer.Option("NVIDIA A10", "--gpu-model"),
        nodes_file: Path | None = typer.Option(None, "--nodes-file", help="YAML list of nodes"),
        policy: list[str] = typer.Option(
            ["binpack", "spread"], "--policy", help="binpack and/or spread (repeatable)"
        ),
        chart: Path = typer.Option(Path("whatif.png"), "--chart", help="PNG to write"),
        as_json: bool = typer.Option(False, "--json", help="print the figures as JSON"),
    ) -> None:
        """Replay TRACE once per policy through the real scheduler; compare the outcomes.

        Each line of TRACE is a JSON object: {"t": 0, "op": "create", "name": "p1", "gpus": 1,
        "gpumem": 4000, "gpucores": 30} or {"t": 5, "op": "delete", "name": "p1"}; "pod" may
        hold a full pod spec instead, "annotations" HAMi's pod annotations.
        """
        console = Console(stderr=as_json, soft_wrap=True)
        for name in policy:
            if name not in ("binpack", "spread"):
                raise typer.BadParameter(f"unknown policy {name!r}", param_hint="--policy")
        try:
            events = load_trace(trace)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="TRACE") from error
        sim_nodes = (load_nodes(nodes_file) if nodes_file
                     else make_nodes(nodes, gpus_per_node, gpu_memory, gpu_model))
        results = []
        for name in policy:
            with console.status(f"replaying {len(events)} events with {name}..."):
                results.append(run_policy(sim_nodes, events, name))
        render_chart(results, chart)
        if as_json:
            print(json.dumps({"results": [r.summary() for r in results], "chart": str(chart)},
                             indent=2))
            return
        show(console, results_table(results))
        for result in results:
            for line in result.never_placed[:5]:
                console.print(f"[dim]{result.policy}: never placed {line}[/dim]")
        console.print(f"chart: {chart}")
