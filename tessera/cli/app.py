"""The `tessera` CLI. Each command lives in its own module with `register(app)`."""

from __future__ import annotations

import importlib

import typer

# One line per command module; each defines `register(app: typer.Typer) -> None`.
COMMAND_MODULES = [
    "tessera.cli.up",
    "tessera.cli.events",
    "tessera.cli.pods",
    "tessera.cli.sim",
    "tessera.cli.certs",
    "tessera.cli.quota",
    "tessera.cli.limits",
    "tessera.cli.run",
    "tessera.cli.nats_config",
    "tessera.cli.describe",
    "tessera.cli.node_config",
]


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="tessera",
        help="Tessera: GPU sharing for Kubernetes (HAMi-compatible). Run a local stack, watch "
        "events, manage quotas and limits.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_show_locals=False,
    )
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(app)
    return app


def main() -> None:
    build_app()()


if __name__ == "__main__":
    main()
