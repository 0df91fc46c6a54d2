#!/bin/bash
# The container engine for `make image`, `make compose-up` and the container tests: podman with
# runc, set up on a Debian (bookworm) machine by root. Idempotent: each step says what it does
# and does nothing when it is already done.
#
#   scripts/container-engine.sh setup     packages + configuration (the default)
#   scripts/container-engine.sh service   setup, then podman's Docker API on $PODMAN_SOCKET and,
#                                         without systemd, the healthcheck runner (see there)
#   scripts/container-engine.sh stop      stops the API service and runner this script started
#   scripts/container-engine.sh ulimits   the --ulimit values podman can give here (`podman build`
#                                         does not read default_ulimits)
#   scripts/container-engine.sh check     exit 0 when podman can run a container here, else
#                                         say why (exit 3: it cannot be set up on this machine)
#
# What it configures (/etc/containers/containers.conf.d/50-tessera.conf), and why:
# - runtime = "runc": crun refuses cgroups in hybrid mode (v1 controllers + a v2 mount), which
#   is what machines like this one have; runc runs there.
# - default_ulimits at the current hard limits: podman's defaults raise nofile/nproc above them,
#   which needs CAP_SYS_RESOURCE, and a sandboxed root may not have it (every `podman run`
#   then fails on setrlimit).
# - cgroup_manager = "cgroupfs" and events_logger = "file": no systemd here.
# - network_backend = "netavark" (with aardvark-dns: compose services find each other by name).
set -eu

PODMAN_SOCKET="${PODMAN_SOCKET:-unix:///run/podman/podman.sock}"
SOCKET_PATH="${PODMAN_SOCKET#unix://}"
RUN_DIR="$(dirname "$SOCKET_PATH")"
CONF_DIR=/etc/containers/containers.conf.d
CONF="$CONF_DIR/50-tessera.conf"
PACKAGES="podman runc conmon uidmap slirp4netns netavark aardvark-dns fuse-overlayfs catatonit iptables mmdebstrap"

say() { echo "container-engine: $*"; }
cannot() { echo "container-engine: $*" >&2; exit 3; }

require_root_and_apt() {
    [ "$(id -u)" = 0 ] || cannot "not root: podman is installed and run here as root (apt-get, /etc/containers, /run/podman)"
    command -v apt-get >/dev/null 2>&1 || cannot "no apt-get: this script installs podman from Debian packages"
    command -v dpkg-query >/dev/null 2>&1 || cannot "no dpkg-query: not a Debian machine"
}

installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

install_packages() {
    missing=""
    for p in $PACKAGES; do installed "$p" || missing="$missing $p"; done
    if [ -z "$missing" ]; then
        say "packages present ($PACKAGES)"
        return
    fi
    say "installing:$missing"
    # shellcheck disable=SC2086 # one word per package
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $missing; } >/tmp/tessera-container-engine-apt.log 2>&1 || {
        cat /tmp/tessera-container-engine-apt.log >&2
        cannot "apt-get could not install:$missing"
    }
}

# The current hard limit, at most $2: what podman can give a container without raising a limit.
hard_limit() {
    value="$1"; ceiling="$2"
    if [ "$value" = unlimited ] || [ "$value" -gt "$ceiling" ]; then echo "$ceiling"; else echo "$value"; fi
}

# nproc at most 32768: podman lowers its own RLIMIT_NPROC to 32768 when it starts (seen in
# /proc/<podman>/limits here, with a hard limit of 96367 around it), and a container cannot be
# given more than podman and runc have. nofile at most podman's default, 1048576.
wanted_ulimits() {
    nofile=$(hard_limit "$(ulimit -Hn)" 1048576)
    nproc=$(hard_limit "$(ulimit -Hu)" 32768)
    echo "nofile=$nofile:$nofile nproc=$nproc:$nproc"
}

wanted_conf() {
    read -r nofile nproc <<<"$(wanted_ulimits)"
    cat <<EOF
# Written by tessera's scripts/container-engine.sh (see there why); rewritten when it differs.
[containers]
default_ulimits = ["$nofile", "$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
EOF
}

configure() {
    mkdir -p "$CONF_DIR"
    wanted="$(wanted_conf)"
    if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$wanted" ]; then
        say "configuration current ($CONF)"
    else
        printf '%s\n' "$wanted" >"$CONF.tmp" && mv -f "$CONF.tmp" "$CONF"
        say "wrote $CONF: runtime runc, $(echo "$wanted" | sed -n 's/^default_ulimits = //p')"
    fi
    runtime=$(podman info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null || true)
    [ "$runtime" = runc ] || cannot "podman does not use runc after configuration (it says: '$runtime')"
}

service_answers() {
    [ -S "$SOCKET_PATH" ] && podman --url "$PODMAN_SOCKET" version >/dev/null 2>&1
}

# A process we left running whose working directory is gone (started from a checkout or CI
# clone since deleted): podman's conmon then fails every container with "Failed to get working
# directory" ("write child: broken pipe" to the client), so it is replaced, not reused.
cwd_gone() {
    case "$(readlink "/proc/$1/cwd" 2>/dev/null)" in
        *" (deleted)") return 0 ;;
        *) return 1 ;;
    esac
}

start_service() {
    pidfile="$RUN_DIR/service.pid"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null && cwd_gone "$(cat "$pidfile")"; then
        kill "$(cat "$pidfile")" 2>/dev/null || true
        say "replaced the podman system service (pid $(cat "$pidfile")): its working directory is gone"
        rm -f "$pidfile"
        sleep 1
    fi
    if service_answers; then
        say "Docker API already served on $PODMAN_SOCKET"
        return
    fi
    mkdir -p "$RUN_DIR"
    rm -f "$SOCKET_PATH"
    say "starting podman system service on $PODMAN_SOCKET (log: $RUN_DIR/service.log)"
    # --time=0: it serves until stopped; setsid: it outlives the make or test that started it;
    # from /: it outlives the checkout too (see cwd_gone).
    (cd / && exec setsid podman system service --time=0 "$PODMAN_SOCKET" \
        >"$RUN_DIR/service.log" 2>&1 </dev/null) &
    echo $! >"$RUN_DIR/service.pid"
    waited=0
    until service_answers; do
        waited=$((waited + 1))
        if [ "$waited" -gt 60 ]; then
            cat "$RUN_DIR/service.log" >&2
            cannot "podman system service did not answer on $PODMAN_SOCKET within 30 s"
        fi
        sleep 0.5
    done
    say "Docker API up: DOCKER_HOST=$PODMAN_SOCKET"
}

# podman runs a container's healthcheck from a systemd timer; without systemd (as here) nobody
# runs it, the container stays "starting" and compose's `condition: service_healthy` never
# holds. This loop is that timer: every 2 s, `podman healthcheck run` on each running container
# that has a healthcheck (it records the result as the timer's run would).
# It ends after a minute with no such container (`service` starts it again when needed), so it
# costs nothing once a stack is down.
run_healthchecks() {
    idle=0
    while [ "$idle" -lt 30 ]; do
        ids=$(podman ps -q --filter health=starting --filter health=healthy \
            --filter health=unhealthy 2>/dev/null || true)
        if [ -z "$ids" ]; then idle=$((idle + 1)); else idle=0; fi
        for id in $ids; do
            podman healthcheck run "$id" >/dev/null 2>&1 || true
        done
        sleep 2
    done
    rm -f "$RUN_DIR/healthchecks.pid"
}

start_healthchecks() {
    if [ -d /run/systemd/system ]; then
        say "systemd runs podman's healthchecks"
        return
    fi
    pidfile="$RUN_DIR/healthchecks.pid"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        if ! cwd_gone "$(cat "$pidfile")"; then
            say "healthcheck runner already running (pid $(cat "$pidfile"))"
            return
        fi
        kill "$(cat "$pidfile")" 2>/dev/null || true
        say "replaced the healthcheck runner (pid $(cat "$pidfile")): its working directory is gone"
    fi
    script="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
    (cd / && exec setsid "$script" healthchecks >"$RUN_DIR/healthchecks.log" 2>&1 </dev/null) &
    echo $! >"$pidfile"
    say "started the healthcheck runner (no systemd to run podman's healthchecks; pid $!)"
}

stop_service() {
    pidfile="$RUN_DIR/service.pid"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        kill "$(cat "$pidfile")"
        say "stopped podman system service (pid $(cat "$pidfile"))"
    else
        say "no podman system service started by this script is running"
    fi
    rm -f "$pidfile"
    pidfile="$RUN_DIR/healthchecks.pid"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        kill "$(cat "$pidfile")"
        say "stopped the healthcheck runner (pid $(cat "$pidfile"))"
    fi
    rm -f "$pidfile"
}

check() {
    require_root_and_apt
    command -v podman >/dev/null 2>&1 || cannot "podman is not installed (run: $0 setup)"
    [ -f "$CONF" ] || cannot "podman is not configured (run: $0 setup)"
    say "podman $(podman version --format '{{.Client.Version}}'), runtime $(podman info --format '{{.Host.OCIRuntime.Name}}')"
}

case "${1:-setup}" in
    setup) require_root_and_apt; install_packages; configure ;;
    service) require_root_and_apt; install_packages; configure; start_service; start_healthchecks ;;
    healthchecks) run_healthchecks ;;
    healthcheck-runner) mkdir -p "$RUN_DIR"; start_healthchecks >/dev/null ;;
    stop) stop_service ;;
    check) check ;;
    ulimits) wanted_ulimits ;;
    *) echo "usage: $0 [setup|service|stop|check|ulimits|healthchecks|healthcheck-runner]" >&2; exit 2 ;;
esac
