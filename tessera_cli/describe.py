"""`tessera describe pod NAME`: what `kubectl describe pod` shows, plus Tessera's part: the GPU
slices per container, the scheduler's explanation (why it waits, node by node, in words with
HAMi's codes) and the pod's Kubernetes Events (FilteringFailed, BindingSucceed, ...)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

from tessera import elastic
from tessera.gpuid import short_uuid
from tessera.reasons import readable

from .kube import KubeClient, api_client
from .locate import CliError, fail
from .pods import pod_gpus, pod_reason
from .table import render

FILTERING_FAILED = "FilteringFailed"


def pod_events(client: KubeClient, namespace: str, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The events whose involvedObject is this pod (by uid when known), oldest first."""
    meta = pod.get("metadata") or {}
    items = client.get(f"/api/v1/namespaces/{namespace}/events").get("items") or []
    uid = meta.get("uid")

    def about_pod(event: dict[str, Any]) -> bool:
        involved = event.get("involvedObject") or {}
        if involved.get("kind", "Pod") != "Pod" or involved.get("name") != meta.get("name"):
            return False
        return not uid or not involved.get("uid") or involved.get("uid") == uid

    chosen = [e for e in items if about_pod(e)]
    return sorted(chosen, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))


_MEMORY_REFUSAL = re.compile(r"\b(\d+/\d+ CardInsufficientMemory)\b(?! \()")


def free_memory(client: KubeClient, node: str) -> list[tuple[int, int]]:
    """(GPU memory, MiB not granted) of each GPU the node registered, from its register
    annotation and the grants recorded on the pods bound to it."""
    from tessera.hami import ANN_NODE_REGISTER, decode_node_register

    try:
        meta = client.get(f"/api/v1/nodes/{node}").get("metadata") or {}
        devices = decode_node_register((meta.get("annotations") or {})[ANN_NODE_REGISTER])
        bound = client.get(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}")
    except (CliError, KeyError, ValueError):
        return []
    used: dict[str, int] = {}
    for other in bound.get("items") or []:
        if (other.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for container in pod_gpus(other):
            for grant in container:
                used[grant["uuid"]] = used.get(grant["uuid"], 0) + grant["memory_mib"]
    return [(d.memory_mib, d.memory_mib - used.get(d.uuid, 0)) for d in devices]


def memory_figures(client: KubeClient, pod: dict[str, Any], node: str) -> str:
    """`needs 8000 MiB, best has 6000` for a node that refused the pod for memory ('' when
    the figures cannot be known)."""
    from tessera.hami import RequestError, parse_pod_request
    from tessera.settings import TesseraSettings

    try:
        requests = [r for r in parse_pod_request(pod, TesseraSettings()).all if r is not None]
    except RequestError:
        return ""
    gpus = free_memory(client, node)
    if not requests or not gpus:
        return ""
    total, best = max(gpus, key=lambda g: g[1])
    needs = max(r.memory_on(total) for r in requests)
    return f"needs {needs} MiB, best has {max(best, 0)}"


def with_figures(client: KubeClient, pod: dict[str, Any], line: str) -> str:
    """A node's refusal (`node: 2/2 CardInsufficientMemory`) with the memory figures added."""
    node, sep, reasons = line.partition(": ")
    if not sep or not _MEMORY_REFUSAL.search(reasons):
        return line
    figures = memory_figures(client, pod, node.strip())
    if not figures:
        return line
    return f"{node}: " + _MEMORY_REFUSAL.sub(lambda m: f"{m.group(1)} ({figures})", reasons, 1)


def explanation(pod: dict[str, Any], events: list[dict[str, Any]],
                client: KubeClient | None = None) -> list[str]:
    """Why the pod is where it is, from the scheduler: its latest refusal node by node (the
    FilteringFailed event), else kube-scheduler's summary; nothing once it is placed."""
    if (pod.get("spec") or {}).get("nodeName"):
        return []
    lines = []
    summary = pod_reason(pod)
    if summary:
        lines.append(readable(summary))
    refusals = [e for e in events if e.get("reason") == FILTERING_FAILED]
    if refusals:
        message = str(refusals[-1].get("message") or "")
        head, _, per_node = message.partition("): ")
        if per_node:
            lines.append(head + "):")
            for part in per_node.split("; "):
                if part.strip():
                    part = with_figures(client, pod, part.strip()) if client else part.strip()
                    lines.append(f"  {readable(part)}")
        else:
            lines.append(readable(message))
    return lines


def render_pod(pod: dict[str, Any], events: list[dict[str, Any]],
               client: KubeClient | None = None) -> str:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    out = [
        f"Name:         {meta.get('name', '')}",
        f"Namespace:    {meta.get('namespace', '')}",
        f"Node:         {spec.get('nodeName') or '<none>'}",
        f"Status:       {status.get('phase', 'Pending')}",
        f"Scheduler:    {spec.get('schedulerName') or '<none>'}",
    ]
    nominated = status.get("nominatedNodeName")
    if nominated:  # a preemption is under way for it on that node
        out.append(f"Nominated:    {nominated}")
    grants = pod_gpus(pod)
    claims: list[str] = []
    if not any(grants) and spec.get("resourceClaims") and client is not None:
        from .dra import claim_grants  # a DRA pod: its slices are its claims' allocations

        grants, claims = claim_grants(client, pod)
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    out.append("GPU slices:" + ("" if any(grants) else "   <none>"))
    burst = _burst_granted(meta.get("annotations") or {})
    for i, devices in enumerate(grants):
        name = containers[i].get("name", f"#{i}") if i < len(containers) else f"#{i}"
        for j, g in enumerate(devices):
            mem_limit, cores_limit = burst.get((i, j, g["uuid"]), (0, 0))
            mem = (f"{g['memory_mib']} MiB guaranteed, up to {mem_limit} MiB" if mem_limit
                   else f"{g['memory_mib']} MiB")
            cores = (f"{g['cores']}% compute guaranteed, up to {cores_limit}%" if cores_limit
                     else f"{g['cores']}% compute")
            out.append(f"  {name}: {short_uuid(g['uuid'])} ({g['type']}) "
                       f"{mem}, {cores}   [{g['uuid']}]")
    if any(mem for mem, _ in burst.values()):
        annotations_ = meta.get("annotations") or {}
        policy = annotations_.get("tessera.io/gpumem-reclaim", "fail")
        wait = annotations_.get("tessera.io/gpumem-wait-seconds", "0")
        out.append(f"Elastic:      memory beyond the guarantee is reclaimable (policy {policy}); "
                   f"allocations wait up to {wait} s")
    spill = (meta.get("annotations") or {}).get(elastic.ANN_GPUMEM_SPILL)
    if spill is not None and any(grants):  # docs/elastic.md "Spilling to host memory"
        names = [str(c.get("name", "")) for c in containers]
        per = {n: elastic.spill_bytes_of(meta.get("annotations") or {}, names, n) >> 20
               for n in names}  # fmt: skip
        shown = ", ".join(f"{n} {mib} MiB" for n, mib in per.items() if mib) or "none (malformed)"
        out.append(f"Spill:        allocations the GPU cannot hold go to host memory (much "
                   f"slower), at most: {shown}")
    if any(cores for _, cores in burst.values()):
        reclaims = sum(int(e.get("count") or 1) for e in events
                       if e.get("reason") == "ComputeReclaimed")
        out.append("Elastic:      compute beyond the guarantee is lent while the GPU has idle "
                   "compute and taken back when a neighbour wakes"
                   + (f" ({reclaims} ComputeReclaimed events)" if reclaims else ""))
    if claims:
        out.append("Claims:")
        out += [f"  {line}" for line in claims]
    why = explanation(pod, events, client)
    if why:
        out.append("Scheduling:")
        out += [f"  {line}" for line in why]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k != "kubectl.kubernetes.io/last-applied-configuration"}
    out.append("Annotations:" + ("" if annotations else "  <none>"))
    out += [f"  {key}: {annotations[key]}" for key in sorted(annotations)]
    out.append("Events:" + ("" if events else "       <none>"))
    if events:
        rows = []
        for event in events:
            source = (event.get("source") or {}).get("component") or event.get(
                "reportingComponent", "")
            rows.append([event.get("type", ""), event.get("reason", ""), source,
                         str(event.get("lastTimestamp") or event.get("eventTime") or ""),
                         readable(str(event.get("message", "")))])
        table = render(["TYPE", "REASON", "FROM", "LAST SEEN", "MESSAGE"], rows)
        out += [f"  {line}" for line in table.splitlines()]
    return "\n".join(out)


def _burst_granted(annotations: dict[str, Any]) -> dict[tuple[int, int, str], tuple[int, int]]:
    """(container, device, uuid) -> (memory MiB, cores %) burst limits the scheduler granted
    (tessera.io/vgpu-burst-allocated; docs/elastic.md)."""
    from tessera.elastic import ANN_BURST_ALLOCATED, decode_burst

    text = annotations.get(ANN_BURST_ALLOCATED)
    try:
        containers = decode_burst(str(text)) if text else []
    except ValueError:
        return {}
    return {(i, j, uuid): (mem, cores) for i, devices in enumerate(containers)
            for j, (uuid, mem, cores) in enumerate(devices) if mem or cores}  # fmt: skip


def register(app: typer.Typer) -> None:
    @app.command("describe")
    def describe_command(
        resource: str = typer.Argument(..., help="pod"),
        name: str = typer.Argument(..., help="the pod's name"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        state_dir: Path | None = typer.Option(None, "--state-dir", help="the stack's state dir"),
        kubeconfig: Path | None = typer.Option(None, "--kubeconfig",
                                               help="default: as for `tessera get`"),
    ) -> None:
        """Show a pod's GPU slices, the scheduler's explanation and its events."""
        try:
            if resource.lower() not in ("pod", "pods", "po"):
                raise CliError(f"tessera describes pods (not {resource!r})")
            with api_client(state_dir, kubeconfig) as client:
                pod = client.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
                events = pod_events(client, namespace, pod)
                text = render_pod(pod, events, client)
        except CliError as error:
            fail(error)
        print(text)
