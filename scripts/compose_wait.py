"""Waits until the compose stack's API (kube-sim, through a kubeconfig) is ready and the wanted
number of nodes advertise GPUs (their node agents registered with kubelet): `make compose-up`
returns when pods can be placed. Exit 0 when ready, 1 with what was last seen at the deadline."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx
import yaml

GPU = "nvidia.com/gpu"


def api_from(kubeconfig: Path) -> tuple[str, dict[str, str]]:
    config = yaml.safe_load(kubeconfig.read_text())
    context = next(c["context"] for c in config["contexts"]
                   if c["name"] == config["current-context"])
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
    headers = {"Authorization": f"Bearer {user['token']}"} if user.get("token") else {}
    return cluster["server"].rstrip("/"), headers


def gpu_nodes(client: httpx.Client, server: str) -> dict[str, int]:
    """Node name -> GPUs it advertises (allocatable)."""
    nodes = client.get(f"{server}/api/v1/nodes").raise_for_status().json()["items"]
    return {n["metadata"]["name"]: int((n.get("status") or {}).get("allocatable", {}).get(GPU, 0))
            for n in nodes}


def wait(kubeconfig: Path, nodes: int, timeout: float) -> str | None:
    """None when ready, else what was last seen."""
    server, headers = api_from(kubeconfig)
    deadline = time.monotonic() + timeout
    seen = "nothing yet"
    with httpx.Client(headers=headers, timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                client.get(f"{server}/readyz").raise_for_status()
                found = gpu_nodes(client, server)
                if sum(1 for gpus in found.values() if gpus > 0) >= nodes:
                    return None
                seen = f"nodes and their GPUs: {found}"
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                seen = f"{server}: {exc!r}"
            time.sleep(1)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args()
    problem = wait(args.kubeconfig, args.nodes, args.timeout)
    if problem is not None:
        print(f"compose: not ready after {args.timeout:.0f} s; last seen: {problem}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
