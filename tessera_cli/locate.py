"""How every command finds the stack: one set of rules, in one place.

- The state directory: `--state-dir`, else `$TESSERA_STATE_DIR`, else `./.tessera`.
- The stack file `tessera up` writes there (`stack.json`): the API's kubeconfig, the NATS URL
  and the admin's NATS credentials of the running stack.
- The Kubernetes API: `--kubeconfig`, else `$TESSERA_KUBECONFIG`, else the running stack's
  kubeconfig, else `$KUBECONFIG` (a real cluster), else `~/.kube/config`.
- NATS: `$NATS_URL` or `$TESSERA_ENV_FILE` when set (as the services read them), else the
  running stack's NATS with its admin identity, else nats://127.0.0.1:4222.

Light on purpose (no pydantic, no nats): `tessera get pods` must start fast.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

    from tessera.settings import NatsSettings

STACK_FILE = "stack.json"
KUBECONFIG_NAME = "kubeconfig"
DEFAULT_STATE_DIR = Path(".tessera")
# Connecting to NATS or the API: a command that cannot reach it says so within this time.
CONNECT_TIMEOUT_S = 4.0


class CliError(Exception):
    """Something to tell the person at the terminal in one line (exit code 1)."""


def error_line(error: object) -> str:
    """`error: <the message on one line>`."""
    text = str(error).strip().splitlines()
    message = text[0] if len(text) == 1 else " ".join(line.strip() for line in text)
    return f"error: {message}"


def fail(error: object, code: int = 1) -> NoReturn:
    """One line on stderr, then exit: never a traceback for a user's mistake or a stack away."""
    import typer

    print(error_line(error), file=sys.stderr, flush=True)
    raise typer.Exit(code)


def state_dir_of(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    env = os.environ.get("TESSERA_STATE_DIR")
    return Path(env) if env else DEFAULT_STATE_DIR


def read_stack_info(state_dir: Path) -> dict[str, Any]:
    """What a running stack wrote about itself (ports, kubeconfig, NATS URL); {} if none."""
    try:
        data = json.loads((state_dir / STACK_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class StackLocation:
    """Where the stack's API and NATS are, as every command finds them."""

    state_dir: Path
    info: dict[str, Any]

    @classmethod
    def find(cls, state_dir: Path | None = None) -> StackLocation:
        directory = state_dir_of(state_dir)
        return cls(directory, read_stack_info(directory))

    def kubeconfig(self, explicit: Path | None = None) -> Path:
        """The kubeconfig to use; CliError (saying where it looked) when there is none."""
        candidates: list[tuple[str, Path]] = []
        if explicit is not None:
            candidates.append(("--kubeconfig", explicit))
        elif os.environ.get("TESSERA_KUBECONFIG"):
            candidates.append(("TESSERA_KUBECONFIG", Path(os.environ["TESSERA_KUBECONFIG"])))
        else:
            if self.info.get("kubeconfig"):
                candidates.append(("the stack file", Path(str(self.info["kubeconfig"]))))
            candidates.append(("--state-dir", self.state_dir / KUBECONFIG_NAME))
            for entry in (os.environ.get("KUBECONFIG") or "").split(os.pathsep):
                if entry:
                    candidates.append(("KUBECONFIG", Path(entry)))
            if "KUBECONFIG" not in os.environ:
                candidates.append(("~/.kube/config", Path.home() / ".kube" / "config"))
        for _, path in candidates:
            if path.is_file():
                return path
        where = ", ".join(f"{path} ({origin})" for origin, path in candidates)
        raise CliError(f"no kubeconfig found (looked at {where}): is the stack running "
                       "(`tessera up`)? Or pass --state-dir / --kubeconfig")

    def nats_settings(self) -> NatsSettings:
        """How to reach NATS (with which identity)."""
        from tessera.settings import NatsSettings

        if os.environ.get("NATS_URL") or os.environ.get("TESSERA_ENV_FILE"):
            return NatsSettings()
        admin_env = self.info.get("nats_admin_env")
        if admin_env and Path(str(admin_env)).is_file():
            return NatsSettings(_env_file=str(admin_env))  # type: ignore[call-arg]
        if self.info.get("nats_url"):
            return NatsSettings(NATS_URL=str(self.info["nats_url"]))  # type: ignore[call-arg]
        return NatsSettings()


def _refused(url: str, timeout_s: float) -> str | None:
    """Why a TCP connection to a NATS URL fails now (None when something accepts it)."""
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(url if "://" in url else f"nats://{url}")
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222),
                                      timeout=timeout_s):  # fmt: skip
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def quiet_connection_logs() -> None:
    """nats-py logs every failed attempt to connect with a traceback, and the bus a warning per
    retry; a command says it once (connect_nats's CliError). Process-wide: called by the
    program's entry point only, never by a command's code, which also runs inside other
    processes (tests, `CliRunner`) whose logs it must leave alone."""
    import logging

    logging.getLogger("nats").setLevel(logging.CRITICAL)
    logging.getLogger("tessera.bus").setLevel(logging.ERROR)


async def connect_nats(
    location: StackLocation, name: str, timeout_s: float = CONNECT_TIMEOUT_S
) -> NatsClient:
    """A NATS connection for one command, or CliError within `timeout_s` (nats-py itself would
    retry a server that is not there forever, printing a traceback each time)."""
    import asyncio

    from tessera import bus

    settings = location.nats_settings()
    hint = ("is the stack running (`tessera up`)? Set NATS_URL, TESSERA_ENV_FILE or "
            "--state-dir")
    urls = [u.strip() for u in settings.url.split(",") if u.strip()]
    refusals = [_refused(u, timeout_s / 2) for u in urls]
    if urls and all(refusals):
        raise CliError(f"cannot reach NATS at {settings.url} ({refusals[0]}): {hint}")
    try:
        return await asyncio.wait_for(
            bus.connect(settings, name=name, initial_attempts=1), timeout_s
        )
    except Exception as exc:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError):
            reason = f"no connection in {timeout_s:.0f} s: wrong credentials or TLS settings?"
        raise CliError(f"cannot reach NATS at {settings.url} ({reason}): {hint}") from None
