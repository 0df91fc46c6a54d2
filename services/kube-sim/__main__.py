"""`python -m tessera.kube_sim`: local stand-in for apiserver, kube-scheduler and kubelet.

kube-sim is the Kubernetes of the local stack, not a Tessera service: it needs no NATS (so a
broker outage never takes the "cluster" down) and speaks only Kubernetes protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from tessera.kube_sim.settings import KubeSimSettings

from tessera.logging import configure_logging
from tessera.settings import TesseraSettings, settings_help

DESCRIPTION = "local stand-in for apiserver, kube-scheduler and kubelet"


async def _serve(settings: KubeSimSettings, tessera: TesseraSettings) -> None:
    from tessera.kube_sim.app import KubeSim

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await KubeSim(settings, tessera).run(stop)


def main() -> None:
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        from rich.console import Console
        from rich.table import Table

        console = Console()
        console.print(f"[bold]tessera-kube-sim[/bold]: {DESCRIPTION}\n")
        table = Table("variable", "default", "meaning")
        for row in settings_help(KubeSimSettings) + settings_help(TesseraSettings):
            table.add_row(*row)
        console.print(table)
        return
    tessera = TesseraSettings()
    configure_logging("kube-sim", tessera.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(KubeSimSettings(), tessera))


if __name__ == "__main__":
    main()
