"""`tessera events`: tail the event stream, readable or as JSON lines."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from tessera.bus import EVENTS_ALL
from tessera.events import subscribe
from tessera.gpuid import short_uuid
from tessera.models import AllocationEvent, Event

from .locate import CliError, StackLocation, connect_nats, fail


def describe(event: Event) -> str:
    """One readable line for a person."""
    data = event.model_dump(exclude={"event_id", "at", "source", "reason"})
    if isinstance(event, AllocationEvent):
        gpus = ", ".join(
            f"{short_uuid(g.uuid)}({g.memory_mib}MiB,{g.cores}%)"
            for c in event.containers
            for g in c
        )
        text = f"{event.namespace}/{event.name} {event.action} on {event.node}"
        return text + (f" [{gpus}]" if gpus else "")
    parts = [f"{k}={v}" for k, v in data.items() if v not in (None, "", [], {})]
    return " ".join(parts)


def register(app: typer.Typer) -> None:
    @app.command("events")
    def events_command(
        subject: str = typer.Argument(EVENTS_ALL, help="filter, e.g. 'tessera.events.alloc.>'"),
        as_json: bool = typer.Option(False, "--json", help="one JSON object per line"),
        since_seq: int | None = typer.Option(None, "--since-seq", help="start at this sequence"),
        since: str | None = typer.Option(None, help="start at this ISO time (2026-11-29T10:00)"),
        new: bool = typer.Option(False, "--new", help="only events published from now on"),
        follow: bool = typer.Option(True, "--follow/--no-follow", help="keep waiting for more"),
        idle_exit_s: float = typer.Option(1.0, help="with --no-follow: stop after this quiet time"),
        state_dir: Path | None = typer.Option(None, "--state-dir", help="the stack's state dir"),
    ) -> None:
        """Tail Tessera's event stream (allocations, nodes, admission, quota, OOM)."""
        try:
            start_time = dt.datetime.fromisoformat(since) if since else None
        except ValueError:
            fail(f"--since {since!r} is not an ISO time (2026-11-29T10:00)")
        location = StackLocation.find(state_dir)
        try:
            asyncio.run(_tail(location, subject, as_json, since_seq, start_time, new, follow,
                              idle_exit_s))
        except CliError as error:
            fail(error)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


async def _tail(
    location: StackLocation,
    subject: str,
    as_json: bool,
    since_seq: int | None,
    start_time: dt.datetime | None,
    new: bool,
    follow: bool,
    idle_exit_s: float,
) -> None:
    console = Console(highlight=False, soft_wrap=True)
    nc = await connect_nats(location, "tessera-cli-events")
    stream = subscribe(
        nc, subject, start_sequence=since_seq, start_time=start_time, new_only=new
    )
    try:
        while True:
            try:
                received = await asyncio.wait_for(
                    anext(stream), timeout=None if follow else idle_exit_s
                )
            except (TimeoutError, StopAsyncIteration):
                break
            except Exception as exc:  # no event stream here, permissions, NATS gone
                reason = str(exc) or type(exc).__name__
                if "stream not found" in reason:
                    reason = "this NATS has no Tessera event stream (no service has run on it)"
                raise CliError(f"cannot read the event stream: {reason}") from None
            event = received.event
            if as_json:
                line = {"seq": received.sequence, "subject": received.subject,
                        "schema": type(event).__name__, "version": event.SCHEMA_VERSION,
                        **event.model_dump(mode="json")}
                print(json.dumps(line), flush=True)
            else:
                when = dt.datetime.fromtimestamp(event.at).strftime("%H:%M:%S.%f")[:-3]
                kind = received.subject.removeprefix("tessera.events.")
                # what the bus carries is text, never markup: reasons quote what tenants wrote
                reason = f"  [dim]{escape(event.reason)}[/dim]" if event.reason else ""
                console.print(f"{when} [bold]{escape(kind)}[/bold] "
                              f"{escape(describe(event))}{reason}")  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()
        await nc.close()
