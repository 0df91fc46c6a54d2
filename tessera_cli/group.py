"""The Typer group behind `tessera`: commands imported on first use (the table in app.py)."""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperGroup

from .app import COMMANDS


class LazyGroup(TyperGroup):
    """A Typer group whose commands are imported on first use."""

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            self.load(cmd_name)
        return self.commands.get(cmd_name)

    def load(self, cmd_name: str) -> None:
        module = importlib.import_module(COMMANDS[cmd_name].module)
        holder = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)
        module.register(holder)
        group = typer.main.get_group(holder)
        for name, command in group.commands.items():
            self.commands.setdefault(name, command)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in COMMANDS:
            from difflib import get_close_matches

            close = get_close_matches(name, list(COMMANDS))
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            ctx.fail(f"No such command {name!r}.{hint}")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        rows = [(name, entry.help) for name, entry in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)
