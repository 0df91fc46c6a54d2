"""`tessera up`: the whole local stack in one command; `tessera down` stops one in the background.

NATS (embedded unless NATS_URL is set), kube-sim with N simulated nodes of M GPUs, and every
service. It prints one `ready` line once every service answers ready and every node registered
its GPUs (on a terminal or not), then shows a live screen on a terminal until Ctrl-C.
`--apply DIR` creates the manifests found there (what `make demo` does). `--wait` starts the
stack in the background and returns once it is ready, so a script never races the webhook;
`tessera down` stops it.

On Ctrl-C (or SIGTERM) the services stop first, then NATS: the children run in their own
sessions, so the terminal's signal reaches this process alone and it stops them in order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from .locate import STACK_FILE, CliError, fail, read_stack_info, state_dir_of
from .manifests import load
from .stack import LocalStack, SimNode, StackPorts, default_services, load_nodes, make_nodes

READY_TIMEOUT_S = 180.0


def ready_problems(stack: LocalStack, nodes: list[SimNode]) -> list[str]:
    """What is not ready yet ([] once every service answers ready and every node with GPUs
    has registered them)."""
    import json
    import urllib.request

    from tessera.device_kinds.vendor_models import node_registered

    problems = []
    for running in stack.running:
        if running.proc.poll() is not None:
            problems.append(f"{running.spec.name} exited ({running.proc.returncode}); "
                            f"see {running.log_path}")
        elif stack.readiness(running.spec.name) == "not ready":
            problems.append(f"{running.spec.name} not ready")
    wanted = {n.name for n in nodes if n.gpus > 0}
    try:
        with urllib.request.urlopen(f"{stack.api_url}/api/v1/nodes", timeout=2) as reply:
            items = json.loads(reply.read())["items"]
        models = {n.name: n.gpu_model for n in nodes}
        registered = {n["metadata"]["name"] for n in items  # (a vendor's node: its resource)
                      if node_registered(n, models.get(n["metadata"]["name"], ""))}
    except (OSError, ValueError, KeyError):
        registered = set()
    problems += [f"node {name} has not registered its GPUs" for name in sorted(wanted - registered)]
    if not problems:
        from .dra import slice_published

        problems += [f"node {n.name} has not published its ResourceSlice" for n in nodes
                     if n.dra and n.gpus > 0 and not slice_published(stack.api_url, n.name)]
    return problems


def wait_until_ready(stack: LocalStack, nodes: list[SimNode], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        problems = ready_problems(stack, nodes)
        if not problems:
            return
        if any("exited" in p for p in problems) or time.monotonic() > deadline:
            raise CliError(f"the stack is not ready after {timeout_s:.0f} s: "
                           + "; ".join(problems[:4]))
        time.sleep(0.2)


def apply_directory(stack: LocalStack, directory: Path, console: Any) -> None:
    """Apply every object of the manifests in `directory` (by file name), as `tessera apply -f`
    does (a kubeconfig is skipped)."""
    from .apply import apply_one, skipped
    from .kube import KubeClient, load_kubeconfig

    with KubeClient(load_kubeconfig(stack.kubeconfig)) as client:
        for manifest in load([str(directory)]):
            if skipped(manifest):
                continue
            name = Path(manifest.source).name
            try:
                console.print(f"{name}: {apply_one(client, manifest, 'default')}",
                              soft_wrap=True)  # one line each, also off a terminal
            except CliError as error:  # a denied example is part of the demo
                console.print(f"{name}: [yellow]{error}[/yellow]", soft_wrap=True)
            for warning in client.take_warnings():  # the API server's, as kubectl prints them
                console.print(f"{name}: [yellow]Warning: {warning}[/yellow]", soft_wrap=True)
            if manifest.kind == "ResourceQuota":
                # The quota service learns quotas from its watch; give it a moment so the
                # examples that follow are checked against this one.
                time.sleep(2.0)


def choose_nodes(nodes: int, gpus_per_node: int, gpu_memory: int, gpu_model: str,
                 numa_nodes: int, nodes_file: Path | None) -> list[SimNode]:  # fmt: skip
    if nodes_file is not None:
        return load_nodes(nodes_file)
    return make_nodes(nodes, gpus_per_node, gpu_memory, gpu_model, numa_nodes)


def ready_line(stack: LocalStack, seconds: float) -> str:
    return (f"tessera: ready in {seconds:.1f} s: API {stack.api_url}, dashboard "
            f"{stack.dashboard_url}, kubeconfig {stack.kubeconfig} "
            f"(tessera get pods -A; Ctrl-C or `tessera down` stops)")


def run_foreground(stack: LocalStack, nodes: list[SimNode], apply: Path | None,
                   duration: float | None, timeout_s: float) -> int:  # fmt: skip
    from rich.console import Console

    console = Console()
    interactive = sys.stdout.isatty()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, _interrupt)  # `tessera down`: as Ctrl-C, also while starting
    # Ctrl-C even where the shell that started us ignores SIGINT (a `&` job without job
    # control, `nohup`): Python then leaves it ignored, and the stack would not stop.
    signal.signal(signal.SIGINT, _interrupt)
    started = time.monotonic()
    code = 0
    try:
        print(f"tessera: starting NATS, kube-sim, {len(stack.services)} services in "
              f"{stack.state_dir} ...", flush=True)
        try:
            stack.start()
            wait_until_ready(stack, nodes, timeout_s)
        except (CliError, RuntimeError) as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return 1
        if any(n.dra for n in nodes):
            from .dra import install_device_class

            print(f"tessera: {install_device_class(stack.kubeconfig)}", flush=True)
        stack.write_stack_file(ready=True)
        print(ready_line(stack, time.monotonic() - started), flush=True)
        if apply is not None:
            apply_directory(stack, apply, console)
        if interactive:
            _live(stack, console, stop, duration)
        else:
            _quiet(stop, duration)
            print(_pods_listing(stack), flush=True)
    except KeyboardInterrupt:
        code = 0
    finally:
        # Stopping is not interrupted by a second Ctrl-C: every child gets its SIGTERM, then
        # NATS, within bounded time.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("tessera: stopping ...", flush=True)
        stack.stop()
        for running in stack.running:
            print(f"  {running.spec.name}: {running.status}", flush=True)
        print("tessera: stopped", flush=True)
    return code


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _pods_listing(stack: LocalStack) -> str:
    """`tessera get pods -A` as it stands (left in logs when the stack stops by itself)."""
    from .kube import KubeClient, KubeConfig
    from .pods import pod_summary, pods_table

    try:
        with KubeClient(KubeConfig(server=stack.api_url), timeout_s=5.0) as client:
            pods = [pod_summary(p) for p in client.get("/api/v1/pods").get("items") or []]
    except CliError as error:
        return f"(no pod list: {error})"
    return pods_table(pods, all_namespaces=True) if pods else "(no pods)"


def _quiet(stop: threading.Event, duration: float | None) -> None:
    started = time.monotonic()
    while not stop.is_set():
        if duration is not None and time.monotonic() - started >= duration:
            return
        stop.wait(0.5)


def _live(stack: LocalStack, console: Any, stop: threading.Event, duration: Any) -> None:
    from rich.live import Live

    from .screen import pods_table, screen

    with Live(screen(stack), console=console, refresh_per_second=1) as live:
        started = time.monotonic()
        while not stop.is_set():
            if duration is not None and time.monotonic() - started >= duration:
                break
            stop.wait(1.0)
            live.update(screen(stack))
    if duration is not None:
        console.print(pods_table(stack))
        console.print(f"[bold]dashboard:[/bold] {stack.dashboard_url}")


def refuse_a_second_stack(state_dir: Path) -> None:
    info = read_stack_info(state_dir)
    if info.get("pid") and int(info["pid"]) != os.getpid() and _alive(int(info["pid"])):
        raise CliError(f"a stack is already running from {state_dir} (pid {info['pid']}); "
                       "`tessera down` stops it")


def start_detached(args: list[str], state_dir: Path, timeout_s: float) -> None:
    """`tessera up ARGS` in the background (its own session, output in logs/up.log); returns
    once its stack file says ready, or CliError with what went wrong."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    refuse_a_second_stack(state_dir)
    log_path = state_dir / "logs" / "up.log"
    with log_path.open("ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "tessera_cli", "up", *args], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s + 15
    while True:
        info = read_stack_info(state_dir)
        if info.get("ready") and info.get("pid") == child.pid:
            return
        if child.poll() is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise CliError(f"the stack did not start (exit {child.returncode}): "
                           + " / ".join(tail) + f" (log: {log_path})")
        if time.monotonic() > deadline:
            child.terminate()
            raise CliError(f"the stack was not ready in {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_detached(state_dir: Path, timeout_s: float = 60.0) -> str:
    info = read_stack_info(state_dir)
    pid = int(info.get("pid") or 0)
    if not pid:
        return f"no stack is running from {state_dir}: nothing to stop"
    if not _alive(pid):
        (state_dir / STACK_FILE).unlink(missing_ok=True)
        return f"the stack of {state_dir} (pid {pid}) had already ended: nothing to stop"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            raise CliError(f"the stack (pid {pid}) did not stop in {timeout_s:.0f} s")
        time.sleep(0.1)
        with contextlib.suppress(ChildProcessError):  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
    return f"stopped the stack of {state_dir} (pid {pid})"


def with_mig(nodes: list[SimNode], strategy: str) -> list[SimNode]:
    """`--mig`: every node in that MIG strategy (typer.BadParameter when it cannot be)."""
    from tessera import mig

    if strategy not in mig.STRATEGIES:
        raise typer.BadParameter(f"--mig must be one of {', '.join(mig.STRATEGIES)}")
    unknown = sorted({n.gpu_model for n in nodes if mig.model_for(n.gpu_model) is None})
    if unknown:
        known = ", ".join(f"NVIDIA {m}" for m in mig.MODELS)
        raise typer.BadParameter(f"--mig needs a MIG-capable --gpu-model ({known}); "
                                 f"{unknown[0]!r} is not")
    if strategy == mig.STRATEGY_DYNAMIC:  # profiles are fractions of the model's memory
        return [n.model_copy(update={"mig": strategy, "gpu_memory_mib":
                                     mig.model_for(n.gpu_model).memory_mib})  # type: ignore
                for n in nodes]  # fmt: skip
    return [n.model_copy(update={"mig": strategy}) for n in nodes]


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up_command(
        state_dir: Path | None = typer.Option(
            None, "--state-dir", help="NATS data, logs, certs, kubeconfig (default: .tessera)"
        ),
        duration: float | None = typer.Option(
            None, help="stop by itself after this many seconds (default: run until Ctrl-C)"
        ),
        nodes: int = typer.Option(2, "--nodes", min=0, help="simulated nodes"),
        gpus_per_node: int = typer.Option(4, "--gpus-per-node", min=0, max=64),
        gpu_memory: int = typer.Option(24576, "--gpu-memory", min=1, help="MiB per GPU"),
        gpu_model: str = typer.Option("NVIDIA A10", "--gpu-model", help="NVML name of the GPUs"),
        numa_nodes: int = typer.Option(1, "--numa-nodes", min=1, help="NUMA nodes per node"),
        mig: str = typer.Option(
            "none", "--mig", help="MIG on every node: none, mixed, single (existing instances, "
            "the model's smallest profile on every GPU) or dynamic; needs a MIG-capable "
            "--gpu-model such as 'NVIDIA A100-SXM4-80GB' (nodes file: `mig`, `mig_instances`)"
        ),
        nodes_file: Path | None = typer.Option(
            None, "--nodes-file", help="YAML list of nodes {name, gpus, gpu_memory_mib, ...}"
        ),
        apply: Path | None = typer.Option(
            None, "--apply", help="apply the manifests in this directory once the stack is up"
        ),
        run_containers: bool = typer.Option(
            False, "--run-containers", help="run containers' commands as local processes"
        ),
        free_ports: bool = typer.Option(
            False, "--free-ports", help="pick free ports instead of 6443/8888/9443/9394"
        ),
        nats_cluster: int = typer.Option(
            1, "--nats-cluster", min=1, max=5,
            help="NATS servers: 3 runs a JetStream cluster (each its own store, buckets and "
            "stream with 3 replicas)",
        ),
        kubelet_delay: float = typer.Option(
            0.0, "--kubelet-delay", min=0.0,
            help="seconds each simulated kubelet waits before admitting a bound pod (Allocate), "
            "as real kubelets do 0.1-1 s after the bind",
        ),
        kubelet_jitter: float = typer.Option(
            0.0, "--kubelet-jitter", min=0.0, help="± random spread on --kubelet-delay, per pod"
        ),
        wait: bool = typer.Option(
            False, "--wait",
            help="start in the background and return once every service is ready "
            "(`tessera down` stops it)",
        ),
        timeout: float = typer.Option(
            READY_TIMEOUT_S, "--timeout", min=1.0, help="seconds to wait for ready"
        ),
        dra: bool = typer.Option(
            False, "--dra", help="DRA mode: every node's agent a kubelet DRA plugin, the "
            "webhook turning HAMi pods into ResourceClaims, Tessera's DeviceClass installed "
            "(nodes file: `dra: true` per node, for both modes in one cluster); docs/dra.md",
        ),
    ) -> None:
        """Start NATS, kube-sim with simulated GPU nodes, and every service; Ctrl-C stops all."""
        directory = state_dir_of(state_dir)
        if wait:
            args = ["--state-dir", str(directory), "--nodes", str(nodes),
                    "--gpus-per-node", str(gpus_per_node), "--gpu-memory", str(gpu_memory),
                    "--gpu-model", gpu_model, "--numa-nodes", str(numa_nodes),
                    "--nats-cluster", str(nats_cluster), "--kubelet-delay", str(kubelet_delay),
                    "--kubelet-jitter", str(kubelet_jitter), "--timeout", str(timeout),
                    "--mig", mig]
            args += ["--nodes-file", str(nodes_file)] if nodes_file else []
            args += ["--apply", str(apply)] if apply else []
            args += ["--duration", str(duration)] if duration is not None else []
            args += ["--run-containers"] if run_containers else []
            args += ["--free-ports"] if free_ports else []
            args += ["--dra"] if dra else []
            started = time.monotonic()
            try:
                start_detached(args, directory, timeout)
            except CliError as error:
                fail(error)
            info = read_stack_info(directory)
            print(f"tessera: ready in {time.monotonic() - started:.1f} s: API "
                  f"{info.get('api_url')}, dashboard {info.get('dashboard_url')}, kubeconfig "
                  f"{info.get('kubeconfig')} (pid {info.get('pid')}; `tessera down` stops it)")
            return
        try:
            refuse_a_second_stack(directory)
            sim_nodes = choose_nodes(nodes, gpus_per_node, gpu_memory, gpu_model, numa_nodes,
                                     nodes_file)  # fmt: skip
            if mig != "none" and nodes_file is None:
                sim_nodes = with_mig(sim_nodes, mig)
            if dra:
                sim_nodes = [n.model_copy(update={"dra": True}) for n in sim_nodes]
        except CliError as error:
            fail(error)
        except (OSError, ValueError) as error:
            fail(f"--nodes-file: {error}")
        ports = StackPorts.free() if free_ports else StackPorts()
        services = default_services(
            sim_nodes, directory, ports, run_containers, kubelet_delay, kubelet_jitter
        )
        stack = LocalStack(
            directory, services, nats_url=os.environ.get("NATS_URL"), ports=ports,
            nats_cluster=nats_cluster if nats_cluster > 1 else 0,
        )  # fmt: skip
        code = run_foreground(stack, sim_nodes, apply, duration, timeout)
        if code:
            raise typer.Exit(code)

    @app.command("down")
    def down_command(
        state_dir: Path | None = typer.Option(None, "--state-dir", help="the stack's state dir"),
    ) -> None:
        """Stop the stack `tessera up --wait` started (services first, then NATS)."""
        try:
            print(stop_detached(state_dir_of(state_dir)))
        except CliError as error:
            fail(error)
