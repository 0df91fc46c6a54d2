"""`tessera up`'s live screen shows each pod's reason as written. A reason quotes what a tenant
wrote (an image name in ErrImagePull, an annotation in FailedScheduling); the screen printed it
as rich markup, so `[/dim]` in it stopped the screen with a MarkupError and `[link=...]` became
a hyperlink. kube-sim (the real API server double) holds the pod; the table is rendered as the
screen renders it."""

from __future__ import annotations

import io
import json
import urllib.request
from types import SimpleNamespace

from rich.console import Console

from tessera_cli.screen import pods_table

REASON = "Back-off pulling image \"registry.example/x:[/dim][/]\" [link=https://evil.example]y"


def test_a_pod_reason_with_markup_is_shown_as_written(kube_sim) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hostile"},
           "spec": {"containers": [{"name": "main", "image": "registry.example/x:1"}]}}
    body = json.dumps(pod).encode()
    request = urllib.request.Request(f"{kube_sim.url}/api/v1/namespaces/default/pods", body,
                                     {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=10) as reply:
        created = json.loads(reply.read())
    created["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": REASON}]}  # fmt: skip
    request = urllib.request.Request(
        f"{kube_sim.url}/api/v1/namespaces/default/pods/hostile/status",
        json.dumps(created).encode(), {"Content-Type": "application/json"}, method="PUT")
    with urllib.request.urlopen(request, timeout=10):
        pass
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(
        pods_table(SimpleNamespace(api_url=kube_sim.url)))  # type: ignore[arg-type]
    assert REASON in out.getvalue(), out.getvalue()
