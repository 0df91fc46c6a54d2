"""`tessera node-config set|get`: a node's device configuration over the bus (admin identity).

`set` sends the node's local entry (HAMi's per-node fields), layered over the ConfigMap
`tessera-node-config`; the node agent validates it and applies it live, or refuses with the
reason (for instance a split count below the pods already on a GPU)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from tessera.bus import node_config_get_subject, node_config_set_subject
from tessera.codec import CodecError, decode, encode
from tessera.models import NodeConfigSetRequest, NodeConfigStatus
from tessera.settings import TesseraSettings

from .locate import CliError, StackLocation, connect_nats, fail
from .signed import signed_request

STATE_DIR_HELP = "the stack's state dir (default: $TESSERA_STATE_DIR, else ./.tessera)"


def _entry(
    split_count: int | None, memory_scaling: float | None, core_scaling: float | None,
    mode: str | None, skip_uuid: list[str], skip_index: list[int],
    memory_reclaim: str | None = None,
) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    if split_count is not None:
        entry["devicesplitcount"] = split_count
    if memory_scaling is not None:
        entry["devicememoryscaling"] = memory_scaling
    if core_scaling is not None:
        entry["devicecorescaling"] = core_scaling
    if mode is not None:
        entry["operatingmode"] = mode
    if skip_uuid or skip_index:
        entry["filterdevices"] = {"uuid": list(skip_uuid), "index": list(skip_index)}
    if memory_reclaim is not None:
        entry["memoryreclaim"] = memory_reclaim
    return entry


def show(status: NodeConfigStatus, console: Console) -> None:
    console.print(f"node {status.node}: {json.dumps(status.effective, sort_keys=True)}")
    console.print(f"  from: {', '.join(status.sources)}")
    if status.local:
        console.print(f"  local entry: {json.dumps(status.local, sort_keys=True)}")
    if status.refused:
        console.print(f"  last change REFUSED: {status.refused}")
        if status.pending:
            console.print("  (the ConfigMap's change is retried and applied once it fits)")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Per-node device configuration (HAMi's nodeconfig).",
                        no_args_is_help=True)  # fmt: skip
    app.add_typer(group, name="node-config")

    @group.command("set")
    def set_command(
        node: str = typer.Argument(..., help="the node"),
        split_count: int | None = typer.Option(None, "--split-count",
                                               help="devicesplitcount: pods per GPU"),
        memory_scaling: float | None = typer.Option(None, "--memory-scaling",
                                                    help="devicememoryscaling"),
        core_scaling: float | None = typer.Option(None, "--core-scaling",
                                                  help="devicecorescaling"),
        mode: str | None = typer.Option(None, "--mode", help="operatingmode: hami-core|mig|mps"),
        skip_uuid: list[str] = typer.Option([], "--skip-uuid",
                                            help="filterdevices.uuid (repeat)"),
        skip_index: list[int] = typer.Option([], "--skip-index",
                                             help="filterdevices.index (repeat)"),
        memory_reclaim: str | None = typer.Option(
            None, "--memory-reclaim", help="memoryreclaim: evict (borrowers that keep a "
            "guarantee's memory past the grace bound) | borrower (only those that opted in)"),
        reset: bool = typer.Option(False, "--reset", help="drop the local entry"),
        state_dir: Path | None = typer.Option(None, "--state-dir", help=STATE_DIR_HELP),
    ) -> None:
        """Set the node's local entry (over the ConfigMap's); applied live or refused."""
        try:
            request = NodeConfigSetRequest(
                config=_entry(split_count, memory_scaling, core_scaling, mode, skip_uuid,
                              skip_index, memory_reclaim), reset=reset,
            )  # fmt: skip
        except ValueError as exc:  # pydantic's ValidationError is one
            fail(f"invalid node configuration: {_first_error(exc)}")
        status = _run(StackLocation.find(state_dir), node_config_set_subject(node),
                      encode(request), node)  # fmt: skip
        console = Console(highlight=False, soft_wrap=True)
        if not status.ok:
            console.print(f"refused: {status.reason}")
            raise typer.Exit(1)
        console.print(status.reason)
        show(status, console)

    @group.command("get")
    def get_command(
        node: str = typer.Argument(..., help="the node"),
        state_dir: Path | None = typer.Option(None, "--state-dir", help=STATE_DIR_HELP),
    ) -> None:
        """What the node applies, where it comes from, and the last refused change."""
        status = _run(StackLocation.find(state_dir), node_config_get_subject(node), b"{}", node)
        console = Console(highlight=False, soft_wrap=True)
        if not status.ok:
            console.print(status.reason)
            raise typer.Exit(1)
        show(status, console)


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    return str(exc)


def _run(location: StackLocation, subject: str, payload: bytes, node: str) -> NodeConfigStatus:
    """One request to the node agent; a stack that cannot be reached is one line (CliError)."""
    try:
        return asyncio.run(_request(location, subject, payload, node))
    except CliError as error:
        fail(error)


async def _request(
    location: StackLocation, subject: str, payload: bytes, node: str
) -> NodeConfigStatus:
    settings = TesseraSettings()
    nc = await connect_nats(location, "tessera-cli-node-config")
    try:
        msg = await signed_request(nc, subject, payload, max(5.0, settings.request_timeout_s))
    except Exception as exc:
        reason = str(exc) or type(exc).__name__
        return NodeConfigStatus(ok=False, node=node, reason=f"node {node} did not answer: {reason}")
    finally:
        await nc.close()
    try:
        return decode(msg.data, NodeConfigStatus)
    except CodecError as exc:
        return NodeConfigStatus(ok=False, node=node, reason=f"unreadable reply: {exc}")
