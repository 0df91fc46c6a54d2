"""`tessera apply`, `tessera get`, `tessera delete`: kubectl's habits for the local stack.

They speak the Kubernetes REST API to the server the kubeconfig names (kube-sim under
`tessera up`; found as tessera_cli.locate says), so they work against any API server.
Imports stay light (no httpx, rich or pydantic): `tessera get pods` starts fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from .get import (  # noqa: F401 (re-exported: describe, screen, up and tests read them here)
    GetArgs,
    _nothing,
    describe_gpus,
    pod_gpus,
    pod_reason,
    pod_summary,
    pods_table,
    resolve_kind,
    run_get,
)
from .kube import ApiError, KubeClient, api_client
from .locate import CliError, fail
from .resources import Kind

# --- apply ------------------------------------------------------------------------------------


def apply_files(client: KubeClient, files: list[str], namespace: str, recursive: bool,
                out: Any = None, err: Any = None) -> bool:
    """Apply every document of `files` in order; False if any failed (each said why)."""
    from .apply import apply_one, quote_for
    from .manifests import load

    out = out or sys.stdout
    err = err or sys.stderr
    ok = True
    for manifest in load(files, recursive):
        try:
            result = apply_one(client, manifest, namespace)
            _print_warnings(client, err)
            print(result, file=out, flush=True)
        except ApiError as error:
            _print_warnings(client, err)
            if not error.status:  # the server is away: stop at the first
                raise
            ok = False
            quoted = quote_for(manifest, str(error))
            label = f"{manifest.kind.lower()}/{manifest.name}"
            print(f"error: {manifest.where}: {label}: {error}"
                  + (f"\n  {quoted}" if quoted else ""), file=err, flush=True)
        except CliError as error:
            ok = False
            print(f"error: {error}", file=err, flush=True)
    return ok


def _print_warnings(client: KubeClient, err: Any) -> None:
    """The API server's warnings (admission's, field validation's), as kubectl prints them."""
    for warning in client.take_warnings():
        print(f"Warning: {warning}", file=err, flush=True)


# --- commands ---------------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    state_option = typer.Option(
        None, "--state-dir", help="the stack's state dir (default: $TESSERA_STATE_DIR or .tessera)"
    )
    kubeconfig_option = typer.Option(
        None, "--kubeconfig",
        help="default: $TESSERA_KUBECONFIG, the running stack's, $KUBECONFIG, ~/.kube/config",
    )

    @app.command("apply")
    def apply_command(
        filename: list[str] = typer.Option(..., "-f", "--filename",
                                           help="file, directory or - (repeatable)"),
        recursive: bool = typer.Option(False, "-R", "--recursive",
                                       help="with a directory: its subdirectories too"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        state_dir: Path | None = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """Create or update the objects in YAML files, as `kubectl apply -f`."""
        try:
            with api_client(state_dir, kubeconfig) as client:
                ok = apply_files(client, filename, namespace, recursive)
        except CliError as error:
            fail(error)
        if not ok:
            raise typer.Exit(1)

    @app.command("get")
    def get_command(
        resource: str = typer.Argument("pods", help="pods, resourcequotas, nodes, events, ..."),
        names: list[str] = typer.Argument(None, help="only these"),
        namespace: str | None = typer.Option(None, "-n", "--namespace"),
        all_namespaces: bool = typer.Option(False, "-A", "--all-namespaces"),
        output: str = typer.Option("table", "-o", "--output", help="table | wide | json | name"),
        state_dir: Path | None = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """List pods with their state, node, GPU slices and, when pending, why."""
        code = run_get(GetArgs(resource, tuple(names or ()), namespace, all_namespaces, output,
                               state_dir, kubeconfig))  # fmt: skip
        if code:
            raise typer.Exit(code)

    @app.command("delete")
    def delete_command(
        resource: str = typer.Argument(None, help="pod, resourcequota, ... (not with -f)"),
        names: list[str] = typer.Argument(None, help="names (none with --all or -f)"),
        filename: list[str] = typer.Option(None, "-f", "--filename",
                                           help="delete the objects these files describe"),
        namespace: str = typer.Option("default", "-n", "--namespace"),
        all_objects: bool = typer.Option(False, "--all", help="every object in the namespace"),
        ignore_not_found: bool = typer.Option(False, "--ignore-not-found",
                                              help="an object already gone is not an error"),
        state_dir: Path | None = state_option,
        kubeconfig: Path | None = kubeconfig_option,
    ) -> None:
        """Delete pods (or quotas) by name, or from files."""
        try:
            with api_client(state_dir, kubeconfig) as client:
                targets = _delete_targets(client, resource, names, filename, namespace,
                                          all_objects)  # fmt: skip
                ok = _delete(client, targets, namespace, all_objects, ignore_not_found)
        except CliError as error:
            fail(error)
        if not ok:
            raise typer.Exit(1)


def _delete_targets(client: KubeClient, resource: str | None, names: list[str] | None,
                    files: list[str] | None, namespace: str, all_objects: bool,
                    ) -> list[tuple[Kind, str | None, str]]:  # fmt: skip
    """(kind, namespace, name) to delete; name '' means every one (--all)."""
    if files:
        from .apply import kind_for, skipped
        from .manifests import load

        targets = []
        for manifest in load(files):
            if skipped(manifest):
                continue
            kind = kind_for(client, manifest)
            ns = (manifest.doc["metadata"].get("namespace") or namespace) if kind.namespaced \
                else None  # fmt: skip
            targets.append((kind, ns, manifest.name))
        return targets
    if not resource:
        raise CliError("say what to delete: a resource and names, --all, or -f FILE")
    kind = resolve_kind(resource, client)
    ns = namespace if kind.namespaced else None
    if all_objects:
        return [(kind, ns, "")]
    if not names:
        raise CliError(f"resource(s) were provided, but no name was specified "
                       f"(tessera delete {resource} NAME, or --all)")
    return [(kind, ns, name) for name in names]


def _delete(client: KubeClient, targets: list[tuple[Kind, str | None, str]], namespace: str,
            all_objects: bool, ignore_not_found: bool) -> bool:
    ok = True
    for kind, ns, name in targets:
        if not name:  # --all
            items = client.get(kind.collection(ns)).get("items") or []
            if not items:
                print(_nothing(kind, ns), file=sys.stderr)
            names = [i["metadata"]["name"] for i in items]
        else:
            names = [name]
        for each in names:
            try:
                client.delete(kind.item(ns, each))
                print(f'{kind.singular} "{each}" deleted')
            except ApiError as error:
                if error.status == 404:
                    if not ignore_not_found:
                        ok = False
                        where = f" in namespace {ns}" if ns else ""
                        print(f'Error from server (NotFound): {kind.plural} "{each}" not found'
                              f"{where}", file=sys.stderr)
                    continue
                if not error.status:
                    raise
                ok = False
                print(f"error: {kind.singular}/{each}: {error}", file=sys.stderr)
    return ok
