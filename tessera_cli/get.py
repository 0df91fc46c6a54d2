"""`tessera get`: list objects as kubectl does, pods with their GPU slices and why they pend.

Typer-free on purpose: `tessera get ...` is the command people type most, so `tessera_cli.app`
runs it without the CLI framework when every argument is one `get` takes (`parse_get`; anything
else, `--help` included, goes through typer, which calls the same `run_get`). A test checks that
both read every argument alike (tests/cli/test_get_fast.py); bench/get_pods_vs_kubectl.py times it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from tessera.gpuid import short_uuid
from tessera.reasons import readable

from .kube import api_client
from .locate import CliError, error_line
from .resources import Kind, by_name, discover_by_name, known_names
from .table import render


class GetArgs(NamedTuple):
    resource: str = "pods"
    names: tuple[str, ...] = ()
    namespace: str | None = None
    all_namespaces: bool = False
    output: str = "table"
    state_dir: Path | None = None
    kubeconfig: Path | None = None


def pod_gpus(pod: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The pod's slices per container, as the node agent last recorded them (it rewrites
    `hami.io/…-devices-allocated` from the ledger on `tessera limits set`), else as the
    scheduler granted them (each device family's keys: tessera.device_kinds.pod_grants)."""
    # (imported here: the device families' registry is most of what `tessera apply`, which
    # imports this module through pods.py, would otherwise spend starting)
    from tessera.device_kinds.pod_grants import pod_grants_text
    from tessera.hami import parse_pod_devices

    annotations = pod.get("metadata", {}).get("annotations") or {}
    try:
        text = pod_grants_text(annotations)  # each device family's record
    except ValueError:
        return []
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


def resolve_kind(resource: str, client: Any = None) -> Kind:
    """A resource name as kubectl reads it: the kinds tessera knows, else (with a client) any
    the server's discovery lists (`priorityclasses`, `cm`, ...)."""
    kind = by_name(resource)
    if kind is None and client is not None:
        kind = discover_by_name(client, resource)
    if kind is None:
        raise CliError(f'the server doesn\'t have a resource type "{resource}" '
                       f"(tessera knows {known_names()}, and what the server lists)")
    return kind



# --- get --------------------------------------------------------------------------------------


def pods_table(pods: list[dict[str, Any]], all_namespaces: bool, wide: bool = False) -> str:
    headers = ["NAME", "STATUS", "NODE", "GPUS", "REASON"]
    rows = [[p["name"], p["phase"], p["node"] or "-", describe_gpus(p["gpus"]) or "-",
             p["reason"]] for p in pods]  # fmt: skip
    if wide:  # kubectl's wide adds columns: here the uid and the age's source
        headers[4:4] = ["UID", "CREATED"]
        rows = [[*row[:4], p["uid"], p["created"] or "-", row[4]]
                for p, row in zip(pods, rows, strict=True)]  # fmt: skip
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


# --- the command ------------------------------------------------------------------------------

OUTPUTS = ("table", "wide", "json", "name")


def run_get(args: GetArgs) -> int:
    """List, print; the exit code (errors said in one line on stderr)."""
    if args.output not in OUTPUTS:
        print(error_line(f'unable to match a printer suitable for the output format '
                         f'"{args.output}", allowed formats are: json, name, wide'),
              file=sys.stderr)  # fmt: skip
        return 1
    pods_on_nodes: list[dict[str, Any]] = []
    try:
        with api_client(args.state_dir, args.kubeconfig) as client:
            kind = resolve_kind(args.resource, client)
            ns = None if args.all_namespaces else (args.namespace or "default")
            items = client.get(kind.collection(ns)).get("items") or []
            dra_gpus: dict[str, Any] = {}
            if kind.kind == "Pod" and args.output != "name":
                from .dra import listed_claim_grants  # DRA pods' slices: their claims'

                dra_gpus = listed_claim_grants(client, items, ns)
            if kind.kind == "Node" and items and args.output != "name":
                pods_on_nodes = client.get("/api/v1/pods").get("items") or []
    except CliError as error:
        print(error_line(error), file=sys.stderr, flush=True)
        return 1
    if args.names:
        items = [i for i in items if (i.get("metadata") or {}).get("name") in args.names]
        missing = set(args.names) - {(i.get("metadata") or {}).get("name") for i in items}
        for name in sorted(missing):
            print(f'Error from server (NotFound): {kind.plural} "{name}" not found',
                  file=sys.stderr)
        if missing and not items:
            return 1
    try:
        print_items(items, kind, ns, args.output, args.all_namespaces, pods_on_nodes, dra_gpus)
        sys.stdout.flush()
    except BrokenPipeError:  # `tessera get pods | head`: the reader has all it wants
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0


def print_items(items: list[dict[str, Any]], kind: Kind, ns: str | None, output: str,
                all_namespaces: bool, pods_on_nodes: list[dict[str, Any]],
                dra_gpus: dict[str, Any] | None = None) -> None:  # fmt: skip
    if output == "name":
        print("\n".join(f"{kind.singular}/{i['metadata']['name']}" for i in items))
        return
    if kind.kind == "Pod":
        pods = [pod_summary(p) for p in items]
        for summary in pods:  # a DRA pod's slices are its claims' (tessera_cli/dra.py)
            if not summary["gpus"] and (dra_gpus or {}).get(summary["uid"]):
                summary["gpus"] = dra_gpus[summary["uid"]]  # type: ignore[index]
        if output == "json":
            print(json.dumps(pods, indent=2))
        elif pods:
            print(pods_table(pods, all_namespaces, wide=output == "wide"))
        else:
            print(_nothing(kind, ns), file=sys.stderr)
        return
    if kind.kind == "Node" and items:
        from .nodes import nodes_table, summarise

        summaries = summarise(items, pods_on_nodes)
        print(json.dumps(summaries, indent=2) if output == "json"
              else nodes_table(summaries, wide=output == "wide"))  # fmt: skip
        return
    if output == "json":
        print(json.dumps(items, indent=2))
    elif not items:
        print(_nothing(kind, ns), file=sys.stderr)
    elif kind.kind == "ResourceQuota":
        print(quotas_table(items, all_namespaces))
    else:
        print(generic_table(items, kind, all_namespaces))


# --- reading the arguments without the CLI framework ------------------------------------------

_VALUED = {"-n": "namespace", "--namespace": "namespace", "-o": "output", "--output": "output",
           "--state-dir": "state_dir", "--kubeconfig": "kubeconfig"}  # fmt: skip
_FLAGS = {"-A": "all_namespaces", "--all-namespaces": "all_namespaces"}


def parse_get(argv: list[str]) -> GetArgs | None:
    """`get`'s arguments as typer reads them, or None for anything this reader does not take
    for certain (help, an unknown or malformed option, `--`): typer then reads them itself."""
    values: dict[str, Any] = {}
    positional: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--" or token == "-":
            return None
        if not token.startswith("-"):
            positional.append(token)
            continue
        name, eq, inline = token.partition("=")
        if name in _FLAGS and not eq:
            values[_FLAGS[name]] = True
        elif name in _VALUED and name.startswith("--"):
            if not eq:
                if i >= len(argv):
                    return None
                inline, i = argv[i], i + 1
            values[_VALUED[name]] = inline
        elif token[:2] in ("-n", "-o") and len(token) > 2 and not eq:
            values[_VALUED[token[:2]]] = token[2:]  # -ojson, as click reads it
        elif token in ("-n", "-o"):
            if i >= len(argv):
                return None
            values[_VALUED[token]], i = argv[i], i + 1
        else:
            return None
    for key in ("state_dir", "kubeconfig"):
        if key in values:
            values[key] = Path(values[key])
    if positional:
        values["resource"], values["names"] = positional[0], tuple(positional[1:])
    return GetArgs(**values)


def main_fast(argv: list[str]) -> int | None:
    """`tessera get ARGS` without typer: the exit code, or None when typer must read ARGS."""
    args = parse_get(argv)
    return None if args is None else run_get(args)
