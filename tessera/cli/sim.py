"""`tessera sim`: what-if simulations (replay a pod trace against simulated nodes)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    sim = typer.Typer(help="what-if simulations", no_args_is_help=True)
    app.add_typer(sim, name="sim")
