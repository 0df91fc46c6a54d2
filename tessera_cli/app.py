"""The `tessera` CLI. Each command lives in its own module with `register(app)`.

Commands are imported only when they run: `tessera --help` lists them from the table below
without importing any, and `tessera get pods` imports the pods module alone (bench/cli.py).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import typer


class CommandEntry(NamedTuple):
    module: str
    help: str  # the one-line summary `tessera --help` shows (a test keeps it the command's own)


# One line per command: the module that registers it (`register(app: typer.Typer) -> None`).
COMMANDS: dict[str, CommandEntry] = {
    "up": CommandEntry(
        "tessera_cli.up",
        "Start NATS, kube-sim with simulated GPU nodes, and every service; Ctrl-C stops all.",
    ),
    "down": CommandEntry(
        "tessera_cli.up", "Stop the stack `tessera up --wait` started (services first, then NATS)."
    ),
    "apply": CommandEntry(
        "tessera_cli.pods", "Create or update the objects in YAML files, as `kubectl apply -f`."
    ),
    "get": CommandEntry(
        "tessera_cli.pods", "List pods with their state, node, GPU slices and, when pending, why."
    ),
    "describe": CommandEntry(
        "tessera_cli.describe",
        "Show a pod's GPU slices, the scheduler's explanation and its events.",
    ),
    "delete": CommandEntry("tessera_cli.pods", "Delete pods (or quotas) by name, or from files."),
    "events": CommandEntry(
        "tessera_cli.events",
        "Tail Tessera's event stream (allocations, nodes, admission, quota, OOM).",
    ),
    "quota": CommandEntry(
        "tessera_cli.quota", "Namespace GPU quotas: limits and what pods hold against them."
    ),
    "limits": CommandEntry("tessera_cli.limits", "Change the limits of running GPU containers."),
    "run": CommandEntry(
        "tessera_cli.run",
        "Run CMD under libvgpu with GPU limits: tessera run --gpumem 4000 --gpucores 30 -- CMD",
    ),
    "sim": CommandEntry("tessera_cli.sim", "what-if simulations against simulated nodes"),
    "certs": CommandEntry(
        "tessera_cli.certs",
        "Generate a CA and a serving certificate (admission webhook, scheduler extender), "
        "and optionally client certificates for mutual TLS.",
    ),
    "node-config": CommandEntry(
        "tessera_cli.node_config", "Per-node device configuration (HAMi's nodeconfig)."
    ),
    "nats-config": CommandEntry(
        "tessera_cli.nats_config",
        "Print nats-server's authorization block: one user per Tessera service and per node "
        "agent, each limited to the subjects it needs.",
    ),
}


DESCRIPTION = ("Tessera: GPU sharing for Kubernetes (HAMi-compatible). Run a local stack, apply "
               "and inspect pods, watch events, manage quotas and limits.")


def build_app() -> typer.Typer:
    import typer

    from .group import LazyGroup

    app = typer.Typer(
        name="tessera",
        cls=LazyGroup,
        help=DESCRIPTION,
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode=None,  # plain help: no rich import for `tessera --help`
        pretty_exceptions_show_locals=False,
    )

    @app.callback()
    def _root() -> None:
        """Tessera: GPU sharing for Kubernetes."""

    return app


def top_level_help(width: int = 80) -> str:
    """What `tessera --help` prints, from the table alone (no CLI framework imported): the
    same text click renders for the app (a test compares them)."""
    import textwrap

    name_width = max(len(name) for name in COMMANDS)
    lines = ["Usage: tessera [OPTIONS] COMMAND [ARGS]...", ""]
    lines += textwrap.wrap(DESCRIPTION, width - 2, initial_indent="  ", subsequent_indent="  ")
    lines += ["", "Options:", "  --help  Show this message and exit.", "", "Commands:"]
    indent = " " * (name_width + 4)
    for name, entry in COMMANDS.items():
        wrapped = textwrap.wrap(entry.help, width - len(indent)) or [""]
        lines.append(f"  {name.ljust(name_width)}  {wrapped[0]}")
        lines += [indent + rest for rest in wrapped[1:]]
    return "\n".join(lines)


def main() -> None:
    args = sys.argv[1:]
    if args == ["--help"]:  # the commonest call, answered without importing typer
        print(top_level_help())
        return
    if args[:1] == ["get"]:  # the commonest command, read without typer when it can be
        from .get import main_fast

        code = main_fast(args[1:])
        if code is not None:
            sys.exit(code)
    from .locate import quiet_connection_logs  # (the commands that reach NATS run from here)

    quiet_connection_logs()
    build_app()(prog_name="tessera")


if __name__ == "__main__":
    main()
