"""`tessera run --gpumem 4000 --gpucores 30 -- CMD`: run a local command under libvgpu.

GPU sharing on a workstation, without Kubernetes: the command (and every process it starts)
sees at most --gpumem MiB on each GPU and gets at most --gpucores % of its compute. This writes
a limits file and a usage region in a state directory, preloads libvgpu, and runs the command.
Several commands started with the same --state-dir share one set of limits, like the processes
of one container.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

from tessera import region

LIBVGPU_ENV = "TESSERA_LIBVGPU"
INSTALLED_LIBVGPU = Path("/usr/local/vgpu/libvgpu.so")


def find_libvgpu(explicit: Path | None = None) -> Path:
    """The library to preload: --lib, $TESSERA_LIBVGPU, this checkout's build, the installed one."""
    repo_build = Path(__file__).resolve().parents[1] / "native" / "libvgpu" / "build" / "libvgpu.so"
    candidates = [explicit, Path(os.environ[LIBVGPU_ENV]) if os.environ.get(LIBVGPU_ENV) else None]
    for c in [*candidates, repo_build, INSTALLED_LIBVGPU]:
        if c is not None and c.is_file():
            return c.resolve()
    raise FileNotFoundError(
        "libvgpu.so not found: build it with `make native` (or `make -C native/libvgpu`), "
        f"or point --lib / ${LIBVGPU_ENV} at it"
    )


def container_limits(
    state_dir: Path,
    gpumem_mib: int,
    gpucores: int,
    *,
    devices: int = region.MAX_DEVICES,
    policy: str = "force",
    priority: int = region.PRIORITY_LOW,
    scrub: bool = False,
    spill_mib: int = 0,
) -> region.ContainerLimits:
    """The same limit on every GPU, matched by CUDA ordinal (no NVML needed); `spill_mib`: host
    memory allocations the GPU cannot hold may take (docs/elastic.md, spill)."""
    dev = region.DeviceLimit("", mem_limit_bytes=gpumem_mib << 20, sm_limit_pct=gpucores)
    return region.ContainerLimits(
        devices=(dev,) * devices,
        priority=priority,
        core_policy=policy,
        scrub_on_free=scrub,
        region_path=str(state_dir / "region"),
        spill_bytes=spill_mib << 20,
    )


def prepare(state_dir: Path, limits: region.ContainerLimits, lib: Path) -> dict[str, str]:
    """Seal the limits, create the region, and return the environment for the command."""
    region.prepare_region_file(state_dir / "region")
    region.seal_limits(state_dir / "limits", limits)
    env = dict(os.environ)
    preload = [p for p in env.get("LD_PRELOAD", "").split() if p != str(lib)]
    env["LD_PRELOAD"] = " ".join([*preload, str(lib)])  # runtimes that must come first stay first
    env[region.ENV_LIMITS_DIR] = str(state_dir / "limits")
    return env


def summary(state_dir: Path, limits: region.ContainerLimits | None = None) -> str:
    """One line: peak and limit per GPU used. The limit is the one libvgpu applied; where it
    recorded none (an older libvgpu, or a device it never resolved), the one sealed here — every
    GPU gets the same, so a process that only used NVML is not reported as unlimited."""
    usage = region.read_region(state_dir / "region")
    if usage is None or not usage.devices:
        return "tessera run: no GPU was used"
    sealed = limits.devices[0].mem_limit_bytes if limits and limits.devices else 0
    parts = []
    for d in usage.devices:
        limit_bytes = d.limit_bytes or sealed
        limit = f"{limit_bytes >> 20} MiB" if limit_bytes else "unlimited"
        parts.append(
            f"GPU {d.index}: peak {d.peak_bytes >> 20} MiB of {limit}, {d.oom_count} refused"
        )
    if usage.spill_limit_bytes:
        parts.append(f"peak {usage.spilled_peak_bytes >> 20} MiB spilled to host memory of "
                     f"{usage.spill_limit_bytes >> 20} MiB")  # fmt: skip
    return "tessera run: " + "; ".join(parts)


def register(app: typer.Typer) -> None:
    @app.command(
        "run",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    def run_command(
        ctx: typer.Context,
        gpumem: int = typer.Option(
            0, "--gpumem", help="MiB of device memory per GPU (0: no limit)"
        ),
        gpucores: int = typer.Option(0, "--gpucores", help="% of each GPU's compute (0: no limit)"),
        policy: str = typer.Option("force", help="compute policy: force, default, disable"),
        priority: int = typer.Option(1, help="0 high, 1 low"),
        scrub: bool = typer.Option(False, "--scrub", help="zero device memory before it is freed"),
        spill: int = typer.Option(
            0, "--spill", help="MiB of host memory that allocations the GPU cannot hold may "
            "take instead of failing (much slower; 0: off)"),
        state_dir: Path | None = typer.Option(
            None, help="share limits and usage with other runs (default: a fresh temporary one)"
        ),
        lib: Path | None = typer.Option(None, help="libvgpu.so to preload"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no summary at exit"),
    ) -> None:
        """Run CMD under libvgpu with GPU limits: tessera run --gpumem 4000 --gpucores 30 -- CMD"""
        cmd = list(ctx.args)
        if not cmd:
            raise typer.BadParameter("give the command after --", param_hint="CMD")
        if gpumem < 0 or not 0 <= gpucores <= 100 or spill < 0:
            raise typer.BadParameter("--gpumem and --spill must be >= 0 and --gpucores within "
                                     "0..100")
        if policy not in region.CORE_POLICIES:
            raise typer.BadParameter(f"--policy must be one of {', '.join(region.CORE_POLICIES)}")
        try:
            libvgpu = find_libvgpu(lib)
        except FileNotFoundError as e:
            typer.echo(str(e), err=True)
            raise typer.Exit(127) from None
        temporary = state_dir is None
        sdir = Path(tempfile.mkdtemp(prefix="tessera-run-")) if temporary else state_dir
        sdir.mkdir(parents=True, exist_ok=True)
        try:
            limits = container_limits(
                sdir, gpumem, gpucores, policy=policy, priority=priority, scrub=scrub,
                spill_mib=spill,
            )
            env = prepare(sdir, limits, libvgpu)
            try:
                rc = subprocess.call(cmd, env=env)
            except FileNotFoundError:
                typer.echo(f"tessera run: {cmd[0]}: command not found", err=True)
                rc = 127
            except KeyboardInterrupt:
                rc = 130
            if not quiet:
                typer.echo(summary(sdir, limits), err=True)
        finally:
            if temporary:
                shutil.rmtree(sdir, ignore_errors=True)
        sys.stdout.flush()
        raise typer.Exit(rc if rc >= 0 else 128 - rc)
