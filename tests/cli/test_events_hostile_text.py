"""`tessera events` prints what it reads verbatim. An event's reason quotes what a tenant wrote
(the webhook's denial names the annotation value it refused), and the CLI printed it as rich
markup: `[/dim]` in a pod's annotation made every later `tessera events` of that stream stop
with a MarkupError, `[link=...]` put a hyperlink into the operator's terminal, and a lowercase
`[tag]` vanished. The real CLI in a subprocess, against the session's NATS."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from tessera import bus
from tessera.bus import ensure_events_stream
from tessera.models import AdmissionEvent

HOSTILE = ("tessera.io/gpumem-spill (main): MiB of host memory as a positive integer, not "
           "'[/dim][/bold][/]' [link=https://evil.example]click[/link] [gpu-a]")  # fmt: skip


async def test_a_denial_quoting_markup_is_printed_as_written(nc, nats_url) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    await ensure_events_stream(js)
    await bus.publish_event(js, AdmissionEvent(action="denied", namespace=namespace,
                                               name="[bold]pod[/bold]", reason=HOSTILE))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "TESSERA_"))}
    env["NATS_URL"] = nats_url
    shown = subprocess.run(
        [sys.executable, "-m", "tessera_cli", "events", "--no-follow",
         bus.admission_event_subject(namespace, "denied")],
        capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert HOSTILE in shown.stdout and "name=[bold]pod[/bold]" in shown.stdout, shown.stdout
