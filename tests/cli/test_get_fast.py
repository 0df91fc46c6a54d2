"""`tessera get` is read without typer when it can be (tessera_cli/get.py): it must read every
argument exactly as the typer command does, and leave to typer what it does not take for sure."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera_cli.app import build_app
from tessera_cli.get import GetArgs, parse_get

CASES = [
    [], ["pods"], ["po", "a", "b"], ["pods", "-A"], ["--all-namespaces", "pods"],
    ["pods", "-n", "team-a"], ["-nteam-a"], ["--namespace", "x", "pods", "p1"],
    ["--namespace=x"], ["-o", "json"], ["-ojson", "nodes"], ["--output=wide", "no"],
    ["pods", "--state-dir", "s", "--kubeconfig", "k"], ["--state-dir=s", "-A", "-o", "name"],
    ["-n", "a", "-n", "b"], ["quota", "-A", "-o", "json", "q1"],
]
LEFT_TO_TYPER = [["--help"], ["-h"], ["pods", "--"], ["-An", "x"], ["-n"], ["--output"],
                 ["--bogus"], ["-n=x"], ["pods", "-"]]  # fmt: skip


def typer_reads(argv: list[str]) -> GetArgs:
    group = build_app()
    import typer

    command = typer.main.get_group(group).get_command(None, "get")  # type: ignore[arg-type]
    params = command.make_context("get", list(argv)).params
    for key in ("state_dir", "kubeconfig"):  # typer makes them Paths when it calls the command
        params[key] = Path(params[key]) if params[key] is not None else None
    return GetArgs(params["resource"], tuple(params["names"] or ()), params["namespace"],
                   params["all_namespaces"], params["output"], params["state_dir"],
                   params["kubeconfig"])  # fmt: skip


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a) or "(none)")
def test_the_fast_reader_reads_as_typer_does(argv: list[str]) -> None:
    assert parse_get(argv) == typer_reads(argv)


@pytest.mark.parametrize("argv", LEFT_TO_TYPER, ids=" ".join)
def test_what_it_does_not_take_for_sure_goes_to_typer(argv: list[str]) -> None:
    assert parse_get(argv) is None


def test_paths_are_paths() -> None:
    assert parse_get(["--state-dir", "s"]) == GetArgs(state_dir=Path("s"))
