"""`tessera quota set|get|list`: namespace GPU quotas, through the quota service over NATS.

    tessera quota set team-a --memory 16Gi --cores 200 --gpus 2
    tessera quota get team-a
    tessera quota list

`set` replaces all three limits at once (the service writes them in one step, so there is never
a moment without a limit): an option left out is unlimited, `0` blocks all GPU use.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tessera import bus
from tessera.codec import CodecError, Message, encode
from tessera.hami import RequestError, parse_quantity
from tessera.models import (
    DeviceQuota,
    QuotaAmount,
    QuotaReply,
    QuotaSetRequest,
    QuotaState,
    QuotaStatusRequest,
    RemoteError,
    decode_reply,
)
from tessera.settings import TesseraSettings

from .locate import CliError, StackLocation, connect_nats, fail
from .plain_tables import show
from .signed import signed_request

UNLIMITED_WORDS = {"", "none", "unlimited", "-", "inf"}


class QuotaCliError(CliError):
    """Something to tell the person at the terminal (exit code 1)."""


def parse_memory_limit(text: str | None) -> int | None:
    """MiB from "8000" / "8k" (MiB, as in a ResourceQuota), "16Gi"/"512Mi"/"16G" (bytes), or
    unlimited: the ResourceQuota rule (`tessera.quantity.namespace_mib`)."""
    from tessera.quantity import QuantityError, namespace_mib

    if text is None or text.strip().lower() in UNLIMITED_WORDS:
        return None
    try:
        value = namespace_mib(text.strip(), "--memory")
    except QuantityError as exc:
        raise QuotaCliError(str(exc)) from None
    if value < 0:
        raise QuotaCliError(f"--memory {text.strip()!r} is negative")
    return value


def parse_count_limit(text: str | None, option: str) -> int | None:
    """A whole, non-negative number, or unlimited."""
    if text is None or text.strip().lower() in UNLIMITED_WORDS:
        return None
    try:
        value = parse_quantity(text, option)
    except RequestError as exc:
        raise QuotaCliError(f"{option}: {exc}") from None
    if value < 0 or value != value.to_integral_value():
        raise QuotaCliError(f"{option} {text!r} must be a whole number, 0 or more")
    return int(value)


async def request(
    subject: str, body: Message, timeout_s: float, location: StackLocation | None = None
) -> QuotaReply:
    location = location or StackLocation.find()
    nc = await connect_nats(location, "tessera-cli-quota")
    try:
        try:
            msg = await signed_request(
                nc, subject, encode(body), timeout_s, user=location.nats_settings().user,
                admin_env=location.info.get("nats_admin_env"),
            )
        except Exception as exc:  # no responders, timeout
            raise QuotaCliError(
                f"the quota service did not answer on {subject} ({type(exc).__name__}); "
                "is it running (tessera up)?"
            ) from None
    finally:
        await nc.close()
    try:
        return decode_reply(msg.data, QuotaReply)
    except RemoteError as error:
        raise QuotaCliError(error.reason) from None
    except CodecError as exc:
        raise QuotaCliError(f"unreadable reply from the quota service: {exc}") from None


async def every_namespace(timeout_s: float, location: StackLocation | None = None,
                          max_pages: int = 10_000) -> QuotaReply:  # fmt: skip
    """The status of every namespace, following the service's pages (one reply is bounded by
    NATS's max_payload: services/quota/status_pages.py)."""
    location = location or StackLocation.find()
    states: list[QuotaState] = []
    quotas: list[DeviceQuota] = []
    after = ""
    for _ in range(max_pages):
        reply = await request(bus.QUOTA_STATUS, QuotaStatusRequest(after=after), timeout_s,
                              location)  # fmt: skip
        states.extend(reply.states)
        quotas.extend(reply.device_quotas)
        if not reply.continue_after:
            return QuotaReply(ok=True, states=states, device_quotas=quotas)
        if reply.continue_after <= after:
            raise QuotaCliError(f"the quota service's pages went back to "
                                f"{reply.continue_after!r} after {after!r}")  # fmt: skip
        after = reply.continue_after
    raise QuotaCliError(f"more than {max_pages} pages of quota status")


# --- rendering --------------------------------------------------------------------------------


def _cell(used: int | None, limit: int | None, unit: str) -> str:
    used_text = f"{used:,}{unit}"
    if limit is None:
        return f"{used_text} / [dim]unlimited[/dim]"
    if limit == 0:
        return f"{used_text} / [bold red]0 (blocked)[/bold red]"
    style = "red" if (used or 0) > limit else "green" if (used or 0) < limit else "yellow"
    pct = f" ({100 * (used or 0) / limit:.0f}%)"
    return f"[{style}]{used_text}[/{style}] / {limit:,}{unit}{pct}"


def states_table(states: list[QuotaState], title: str = "GPU quotas") -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("namespace", style="bold")
    table.add_column("memory used / limit")
    table.add_column("cores used / limit")
    table.add_column("GPUs used / limit")
    table.add_column("pods", justify="right")
    table.add_column("limits from", style="dim")
    for state in states:
        used = state.used()
        table.add_row(
            state.namespace,
            _cell(used.memory_mib, state.limits.memory_mib, " MiB"),
            _cell(used.cores, state.limits.cores, "%"),
            _cell(used.gpus, state.limits.gpus, ""),
            str(state.pods()),
            state.source or "-",
        )
    return table


def device_quotas_table(quotas: list[DeviceQuota]) -> Table:
    """kube-apiserver's DRA device quotas (it counts and enforces them; the ResourceQuota's
    `status.used` as its quota controller wrote it)."""
    table = Table(title="DRA device quotas (ResourceQuota, enforced by Kubernetes)",
                  title_justify="left")  # fmt: skip
    for column in ("namespace", "ResourceQuota", "key", "used / hard"):
        table.add_column(column)
    for quota in quotas:
        table.add_row(quota.namespace, quota.quota, quota.key,
                      f"{quota.used or '?'} / {quota.hard}")  # fmt: skip
    return table


def charges_table(state: QuotaState) -> Table:
    table = Table(title=f"pods holding quota in {state.namespace}", title_justify="left")
    numeric = ("memory", "cores", "GPUs")
    for column in ("pod", "uid", "memory", "cores", "GPUs", "since"):
        table.add_column(column, justify="right" if column in numeric else "left")
    for uid, charge in sorted(state.charges.items(), key=lambda kv: kv[1].at):
        since = dt.datetime.fromtimestamp(charge.at).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            charge.name or "-", uid, f"{charge.memory_mib:,} MiB", f"{charge.cores}%",
            str(charge.gpus), since,
        )
    return table


# --- commands ---------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    quota_app = typer.Typer(
        help="Namespace GPU quotas: limits and what pods hold against them.",
        no_args_is_help=True,
    )
    app.add_typer(quota_app, name="quota")

    state_option = typer.Option(None, "--state-dir", help="the stack's state dir")

    def run(coro_factory: object) -> None:
        console = Console(highlight=False, soft_wrap=True)
        try:
            asyncio.run(coro_factory(console))  # type: ignore[operator]
        except CliError as exc:
            fail(exc)

    @quota_app.command("set")
    def set_command(
        namespace: str = typer.Argument(..., help="the namespace"),
        memory: str | None = typer.Option(
            None, "--memory", "-m",
            help="GPU memory: MiB (8000) or with a unit (16Gi); 0 blocks; omit for unlimited",
        ),
        cores: str | None = typer.Option(
            None, "--cores", "-c", help="GPU compute in % of one GPU (200 = two whole GPUs)"
        ),
        gpus: str | None = typer.Option(None, "--gpus", "-g", help="number of GPUs"),
        override: bool = typer.Option(
            False, "--override",
            help="replace limits that come from a ResourceQuota (until it next changes)",
        ),
        state_dir: Path | None = state_option,
    ) -> None:
        """Replace a namespace's limits (all at once; an option left out means unlimited)."""

        async def go(console: Console) -> None:
            limits = QuotaAmount(
                memory_mib=parse_memory_limit(memory),
                cores=parse_count_limit(cores, "--cores"),
                gpus=parse_count_limit(gpus, "--gpus"),
            )
            settings = TesseraSettings()
            reply = await request(
                bus.QUOTA_SET,
                QuotaSetRequest(namespace=namespace, limits=limits, source="cli",
                                override=override),
                settings.request_timeout_s,
                StackLocation.find(state_dir),
            )
            show(console, states_table(reply.states, title=f"quota of {namespace}"))
            if reply.reason:
                console.print(reply.reason)

        run(go)

    @quota_app.command("get")
    def get_command(
        namespace: str = typer.Argument(..., help="the namespace"),
        state_dir: Path | None = state_option,
    ) -> None:
        """A namespace's limits, its usage and the pods holding quota."""

        async def go(console: Console) -> None:
            reply = await request(
                bus.QUOTA_STATUS,
                QuotaStatusRequest(namespace=namespace),
                TesseraSettings().request_timeout_s,
                StackLocation.find(state_dir),
            )
            if reply.states or not reply.device_quotas:
                show(console, states_table(reply.states, title=f"quota of {namespace}"))
            for state in reply.states:
                if state.charges:
                    show(console, charges_table(state))
            if reply.states and reply.reason:  # e.g. only the newest charges fit one reply
                console.print(reply.reason, markup=False, highlight=False)
            if reply.device_quotas:
                show(console, device_quotas_table(reply.device_quotas))

        run(go)

    @quota_app.command("list")
    def list_command(state_dir: Path | None = state_option) -> None:
        """Every namespace with limits or usage."""

        async def go(console: Console) -> None:
            reply = await every_namespace(TesseraSettings().request_timeout_s,
                                          StackLocation.find(state_dir))  # fmt: skip
            if not reply.states and not reply.device_quotas:
                console.print("no namespace has GPU limits or usage yet")
                return
            if reply.states:
                show(console, states_table(reply.states))
            if reply.device_quotas:
                show(console, device_quotas_table(reply.device_quotas))

        run(go)
