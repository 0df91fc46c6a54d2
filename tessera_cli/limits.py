"""`tessera limits set`: change a running container's GPU memory / compute limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer
from rich.console import Console

from tessera.bus import node_limits_subject
from tessera.codec import CodecError, decode, encode
from tessera.models import LimitsSetReply, LimitsSetRequest
from tessera.settings import TesseraSettings

from .locate import CliError, StackLocation, connect_nats, fail
from .signed import signed_request


def register(app: typer.Typer) -> None:
    limits = typer.Typer(help="Change the limits of running GPU containers.", no_args_is_help=True)
    app.add_typer(limits, name="limits")

    @limits.command("set")
    def set_command(
        node: str = typer.Argument(..., help="the node the pod runs on"),
        pod: str = typer.Argument(..., help="NAMESPACE/NAME (or NAME in 'default')"),
        container: str = typer.Argument(..., help="container name"),
        memory: int | None = typer.Option(None, "--memory", min=0, help="MiB per GPU"),
        cores: int | None = typer.Option(None, "--cores", min=0, max=100, help="compute %"),
        gpu: str = typer.Option("", "--gpu", help="only this GPU UUID (default: all of them)"),
        uid: str = typer.Option("", "--uid", help="the pod's uid, when the name is ambiguous"),
        state_dir: Path | None = typer.Option(None, "--state-dir", help="the stack's state dir"),
    ) -> None:
        """Rewrite a running container's sealed limits (libvgpu applies them within 100 ms).

        Shrinking memory below what the container uses now is refused."""
        namespace, _, name = pod.rpartition("/")
        request = LimitsSetRequest(
            pod_uid=uid, namespace=namespace or "default", pod=name, container=container,
            device_uuid=gpu, memory_mib=memory, cores=cores,
        )
        try:
            reply = asyncio.run(_send(StackLocation.find(state_dir), node, request))
        except CliError as error:
            fail(error)
        console = Console(highlight=False, soft_wrap=True)
        if reply.ok:
            console.print(f"{namespace or 'default'}/{name} {container}: {reply.reason}")
            return
        console.print(f"refused: {reply.reason}")
        raise typer.Exit(1)


async def _send(
    location: StackLocation, node: str, request: LimitsSetRequest
) -> LimitsSetReply:
    settings = TesseraSettings()
    nc = await connect_nats(location, "tessera-cli-limits")
    try:
        msg = await signed_request(
            nc, node_limits_subject(node), encode(request),
            max(5.0, settings.request_timeout_s), user=location.nats_settings().user,
            admin_env=location.info.get("nats_admin_env"),
        )
    except Exception as exc:
        return LimitsSetReply(ok=False, reason=f"node {node} did not answer: {exc}")
    finally:
        await nc.close()
    try:
        return decode(msg.data, LimitsSetReply)
    except CodecError as exc:
        return LimitsSetReply(ok=False, reason=f"unreadable reply: {exc}")
