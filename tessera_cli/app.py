"""The `tessera` CLI. Each command lives in its own module with `register(app)`."""

from __future__ import annotations

import importlib

import typer

# One line per command module; each defines `register(app: typer.Typer) -> None`.
COMMAND_MODULES = [
    "tessera_cli.up",
    "tessera_cli.events",
    "tessera_cli.pods",
    "tessera_cli.sim",
    "tessera_cli.certs",
    "tessera_cli.quota",
    "tessera_cli.limits",
    "tessera_cli.run",
    "tessera_cli.nats_config",
    "tessera_cli.describe",
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
