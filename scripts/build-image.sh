#!/bin/bash
# `make image`: builds the one image (Dockerfile) as $IMAGE with $BUILDER (docker, podman or
# buildah).
#
# The Dockerfile's base is python:3.11-slim-bookworm (its PYTHON_IMAGE argument). Where that
# cannot be pulled (no registry reachable, as on the project's CI machines) and the builder is
# podman or docker, an equivalent base is built from Debian's own packages instead and passed
# as PYTHON_IMAGE: a minimal bookworm (mmdebstrap, as root) with Debian's python3 (3.11) in a
# virtual environment at /usr/local, so python, pip and the console scripts are in
# /usr/local/bin as in the python image. It is kept under $BASE_IMAGE: later builds reuse it.
# Where the base can be pulled, nothing changes: the Dockerfile builds on it.
set -euo pipefail

IMAGE="${IMAGE:?IMAGE is not set}"
BUILDER="${BUILDER:-}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON_IMAGE="${PYTHON_IMAGE:-$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$ROOT/Dockerfile" | head -n 1)}"
BASE_IMAGE="${BASE_IMAGE:-localhost/tessera-python-base:3.11-bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"

say() { echo "make image: $*"; }

# The builder: docker when its daemon answers (a docker client alone is not enough), else
# podman, else buildah. As root on a Debian machine, podman is set up first when it is the one
# (scripts/container-engine.sh: installs it if missing, runc, ulimits).
root_on_debian() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
if [ -z "$BUILDER" ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        BUILDER=docker
    elif command -v podman >/dev/null 2>&1 || root_on_debian; then
        BUILDER=podman
    elif command -v buildah >/dev/null 2>&1; then
        BUILDER=buildah
    else
        say "no OCI image builder found (install docker, podman or buildah, or set BUILDER=)" >&2
        exit 1
    fi
fi
if [ "$BUILDER" = podman ] && root_on_debian; then
    "$ROOT/scripts/container-engine.sh" setup
fi
say "builder: $BUILDER"

has_image() { "$BUILDER" image inspect "$1" >/dev/null 2>&1; }

# Debian bookworm with python3 in a venv at /usr/local, imported as $BASE_IMAGE.
build_debian_base() {
    [ "$(id -u)" = 0 ] || { say "building the base from Debian packages needs root" >&2; exit 1; }
    command -v mmdebstrap >/dev/null 2>&1 || {
        say "mmdebstrap is missing (scripts/container-engine.sh setup installs it)" >&2; exit 1; }
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    say "building $BASE_IMAGE from Debian bookworm packages (mmdebstrap; log: $work/mmdebstrap.log)"
    mmdebstrap --variant=minbase \
        --include=python3,python3-venv,ca-certificates,netbase,tzdata \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='chroot "$1" python3 -m venv /usr/local' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        --format=tar bookworm "$work/base.tar" \
        "deb $DEBIAN_MIRROR bookworm main" \
        "deb $DEBIAN_MIRROR bookworm-updates main" \
        "deb $DEBIAN_SECURITY_MIRROR bookworm-security main" \
        >"$work/mmdebstrap.log" 2>&1 || { cat "$work/mmdebstrap.log" >&2; exit 1; }
    "$BUILDER" import \
        --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        --change "LABEL org.opencontainers.image.description=\"Debian bookworm with python3 in a venv at /usr/local: tessera's stand-in for $PYTHON_IMAGE\"" \
        "$work/base.tar" "$BASE_IMAGE" >/dev/null
    say "$BASE_IMAGE: $("$BUILDER" image inspect --format '{{.Size}}' "$BASE_IMAGE") bytes"
}

# podman's builder raises nproc/nofile to its own defaults unless told (containers.conf's
# default_ulimits is not read by `podman build`): what scripts/container-engine.sh says podman
# can give without CAP_SYS_RESOURCE.
limits_args=()
if [ "$BUILDER" = podman ]; then
    for limit in $("$ROOT/scripts/container-engine.sh" ulimits); do limits_args+=(--ulimit "$limit"); done
fi

# A host that reaches PyPI through its own certificate authorities (a local CA in
# /usr/local/share/ca-certificates, e.g. a TLS-inspecting egress proxy) lends its CA bundle to
# the build's RUN steps: mounted over the base's bundle, which Debian's pip reads, only while
# they run (podman build -v: nothing of it is committed to a layer, the image stays as built
# anywhere else).
ca_args=()
HOST_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
if [ "$BUILDER" = podman ] && [ -f "$HOST_CA_BUNDLE" ] \
    && compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    say "lending the host's CA bundle to the build's RUN steps (local CAs in /usr/local/share/ca-certificates)"
    ca_args=(--volume "$HOST_CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro")
fi

base_args=()
case "$BUILDER" in
    podman|docker)
        if has_image "$PYTHON_IMAGE"; then
            say "base $PYTHON_IMAGE present"
        elif "$BUILDER" pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
            say "base $PYTHON_IMAGE pulled"
        else
            say "base $PYTHON_IMAGE cannot be pulled: using $BASE_IMAGE, built from Debian packages"
            has_image "$BASE_IMAGE" && say "$BASE_IMAGE present (kept from an earlier build)" \
                || build_debian_base
            base_args=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
        fi
        set -x
        "$BUILDER" build "${limits_args[@]}" "${ca_args[@]}" "${base_args[@]}" -f Dockerfile -t "$IMAGE" "$ROOT"
        ;;
    buildah)
        set -x
        buildah bud --layers -f Dockerfile -t "$IMAGE" "$ROOT"
        ;;
    *)
        say "unknown builder '$BUILDER' (docker, podman or buildah)" >&2
        exit 1
        ;;
esac
{ set +x; } 2>/dev/null
say "$IMAGE built: $("$BUILDER" image inspect --format '{{.Size}}' "$IMAGE") bytes"
