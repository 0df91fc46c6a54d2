"""The kubeconfigs kube-sim writes so clients (services, CLI, kubectl) find it.

Written as JSON, which is YAML (kubectl and every YAML reader take it): the CLI then reads it
without importing a YAML parser (`tessera get pods` starts faster: bench/get_pods_vs_kubectl.py).
The main file authenticates as the admin user; each other client (identity.CLIENTS) gets its own
file beside it, `<name>-<client>` (e.g. `kubeconfig-scheduler`), with its own token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tessera.kube_sim.identity import CLIENTS, LEGACY_TOKEN, TokenTable


def kubeconfig_text(
    server: str, cluster: str = "kube-sim", token: str = LEGACY_TOKEN,
    user: str = "kube-sim-admin",
) -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": {"server": server}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": cluster, "context": {"cluster": cluster, "user": user}}],
        "current-context": cluster,
    }
    return json.dumps(config, indent=2) + "\n"


def client_kubeconfig_path(main: Path, client: str) -> Path:
    return main if client == "admin" else main.with_name(f"{main.name}-{client}")


def write_kubeconfig(
    path: Path, server: str, token: str = LEGACY_TOKEN, user: str = "kube-sim-admin"
) -> None:
    """Write beside, then rename: a reader never sees half a file. Mode as the umask leaves it
    (the compose stack's components read kube-sim's files as another user)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(kubeconfig_text(server, token=token, user=user))
    os.replace(temporary, path)


def write_kubeconfigs(main: Path, server: str, tokens: TokenTable) -> None:
    """One kubeconfig per client; the main (admin) one last, so whoever waits for it finds the
    others written."""
    for client in sorted(CLIENTS, key=lambda c: c == "admin"):
        user = CLIENTS[client].username
        write_kubeconfig(client_kubeconfig_path(main, client), server, tokens.issued[client], user)
