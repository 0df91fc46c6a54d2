# The Tessera image: every service, the CLI and libvgpu in one image,
# ghcr.io/tessera/tessera:<version>. The command picks what runs (console scripts of pyproject.toml):
#   tessera-admission | tessera-scheduler | tessera-quota | tessera-node-agent | tessera-metrics
#   tessera-kube-sim | tessera <command>
# Build: `make image` (docker, podman or buildah), or
#   docker build -t ghcr.io/tessera/tessera:0.1.0 .
#
# Stages: libvgpu is compiled against the CUDA/NVML headers of the pip packages (no CUDA
# toolkit), the project is built into a wheel, and the final stage installs that wheel on the
# slim Python base: no compiler, no source tree, a non-root user by default.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- the C toolchain every native stage below builds with ---------------------------------------
FROM ${PYTHON_IMAGE} AS toolchain
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
COPY native/library.mk /src/native/library.mk

# --- libvgpu.so -------------------------------------------------------------------------------
FROM toolchain AS libvgpu
RUN pip install --no-cache-dir nvidia-cuda-runtime==13.5.37 nvidia-nvml-dev==13.5.37
COPY native/libvgpu /src/native/libvgpu
RUN make -C /src/native/libvgpu PYTHON=python3 build/libvgpu.so

# --- libtessera_names.so: the scheduler's native name resolver ---------------------------------
# (services/scheduler/native_names.py; without it the scheduler resolves kube-scheduler's node
# lists in numpy, as exactly, more slowly).
FROM toolchain AS names
COPY native/names /src/native/names
RUN make -C /src/native/names build/libtessera_names.so

# --- libtessera_refusals.so: the scheduler's native refusal steps --------------------------------
# (services/scheduler/native_steps.py; without it a refused pod's steps and groups are computed
# in numpy, as exactly, more slowly).
FROM toolchain AS refusals
COPY native/refusals /src/native/refusals
RUN make -C /src/native/refusals build/libtessera_refusals.so

# --- the wheel --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tessera ./tessera
COPY tessera_cli ./tessera_cli
COPY services ./services
COPY protos ./protos
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- the image --------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="tessera" \
      org.opencontainers.image.description="Tessera: GPU sharing for Kubernetes (HAMi-compatible). Every service, the CLI and libvgpu." \
      org.opencontainers.image.source="https://github.com/tessera/tessera" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /tmp/wheels
# The gRPC stubs of the kubelet APIs are generated now, into the package (read-only at run time).
RUN pip install --no-cache-dir /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels \
    && python -m tessera.kubeapi
# Where the node agent chart's init container finds the library (libvgpu.sourcePath). Not under
# /usr/local/vgpu: the chart mounts the host's directory over that path.
COPY --from=libvgpu /src/native/libvgpu/build/libvgpu.so /usr/local/lib/tessera/libvgpu.so
COPY --from=names /src/native/names/build/libtessera_names.so /usr/local/lib/tessera/libtessera_names.so
ENV TESSERA_NAMES_LIBRARY=/usr/local/lib/tessera/libtessera_names.so
COPY --from=refusals /src/native/refusals/build/libtessera_refusals.so /usr/local/lib/tessera/libtessera_refusals.so
ENV TESSERA_REFUSALS_LIBRARY=/usr/local/lib/tessera/libtessera_refusals.so
# Non-root by default (the restricted profile's 65532, "nonroot"). The node agent alone runs as
# root, set by its chart: kubelet's sockets are root-only.
USER 65532:65532
WORKDIR /
CMD ["tessera", "--help"]
