"""`tessera up`: the whole local stack in one command."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from tessera.stack import LocalStack, default_services


def status_table(stack: LocalStack) -> Table:
    table = Table(title=f"Tessera local stack (NATS {stack.nats_url})")
    table.add_column("service")
    table.add_column("pid", justify="right")
    table.add_column("status")
    table.add_column("up", justify="right")
    table.add_column("log")
    for running in stack.running:
        status = running.status
        style = "green" if status == "running" else "red"
        table.add_row(
            running.spec.name, str(running.proc.pid), f"[{style}]{status}[/{style}]",
            f"{time.time() - running.started_at:.0f}s", str(running.log_path),
        )
    return table


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up_command(
        state_dir: Path = typer.Option(Path(".tessera"), help="where NATS data and logs go"),
        duration: float | None = typer.Option(
            None, help="stop by itself after this many seconds (default: run until Ctrl-C)"
        ),
    ) -> None:
        """Start NATS (embedded, unless NATS_URL is set) and every service; Ctrl-C stops all."""
        console = Console()
        stack = LocalStack(state_dir, default_services(), nats_url=os.environ.get("NATS_URL"))
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with console.status("starting NATS and services..."):
            stack.start()
        try:
            with Live(status_table(stack), console=console, refresh_per_second=2) as live:
                started = time.monotonic()
                while not stop.is_set():
                    if duration is not None and time.monotonic() - started >= duration:
                        break
                    stop.wait(0.5)
                    live.update(status_table(stack))
        except KeyboardInterrupt:
            pass
        finally:
            with console.status("stopping..."):
                stack.stop()
            console.print(status_table(stack))
            console.print("[bold]stopped[/bold]")
