"""kube-sim's settings (`TESSERA_KUBE_SIM_*`), next to the shared `TesseraSettings`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tessera.simnodes import SimNode, load_nodes


class KubeSimSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_KUBE_SIM_", env_file=os.environ.get("TESSERA_ENV_FILE"), extra="ignore"
    )

    listen: str = Field("127.0.0.1:6443", description="host:port of the API server (plain HTTP)")
    kubeconfig: str = Field(
        ".tessera/kubeconfig", description="kubeconfig written here, pointing at this server"
    )
    advertise_host: str = Field(
        "", description="host name written into the kubeconfig (default: the listen host)"
    )
    nodes: str = Field(
        "", description='simulated nodes, JSON: [{"name": "sim-node-0", "gpus": 4, ...}]'
    )
    nodes_file: str = Field("", description="simulated nodes from a YAML/JSON file instead")
    webhook_url: str = Field(
        "https://127.0.0.1:9443/mutate", description="admission webhook ('' = no admission)"
    )
    webhook_ca: str = Field("", description="CA bundle (PEM) that signed the webhook's cert")
    webhook_timeout_s: float = Field(10.0, gt=0, le=30)
    webhook_failure_policy: Literal["Fail", "Ignore"] = "Fail"
    extender_url: str = Field(
        "http://127.0.0.1:8888", description="scheduler extender urlPrefix ('' = none)"
    )
    extender_timeout_s: float = Field(30.0, gt=0, description="extender httpTimeout")
    extender_ca: str = Field("", description="extender tlsConfig caFile (https:// urlPrefix)")
    extender_cert: str = Field(
        "", description="extender tlsConfig certFile: client certificate for an mTLS extender"
    )
    extender_key: str = Field("", description="extender tlsConfig keyFile")
    extender_weight: int = Field(1, ge=1)
    backoff_initial_s: float = Field(0.5, gt=0, description="first retry of a pending pod")
    backoff_max_s: float = Field(2.0, gt=0, description="longest wait between retries")
    kubelet_root: str = Field(
        "/tmp/tessera-kubelet", description="per-node kubelet sockets live in <root>/<node>/"
    )
    cdi_spec_dirs: str = Field(
        "", description="colon-separated CDI spec directories kubelets read for DRA devices, "
        "besides each node's <kubelet_root>/<node>/cdi"
    )
    kubelet_delay_s: float = Field(
        0.0, ge=0, description="each kubelet admits a bound pod (Allocate) this long after it "
        "appears, as a real kubelet does 0.1-1 s after the bind"
    )
    kubelet_jitter_s: float = Field(
        0.0, ge=0, description="± this much random spread on kubelet_delay_s, per pod"
    )
    run_containers: bool = Field(
        False, description="run containers that have a command as local processes"
    )
    container_log_dir: str = Field("", description="container logs (default <kubelet_root>/logs)")
    container_runtime: Literal["", "podman"] = Field(
        "", description="'podman': run containers that have a command as OCI containers (runc "
        "through podman, oci.py) with what Allocate returned; '': as run_containers says"
    )
    container_image: str = Field(
        "localhost/tessera-python-base:3.11-bookworm",
        description="the image a container runs when the engine lacks the pod's (none is pulled)",
    )
    container_user: str = Field(
        "65534:65534", description="uid:gid of a container whose securityContext names no user"
    )
    container_driver_dir: str = Field(
        "", description="the GPU driver's user-space libraries (libcuda.so.1, ...), mounted "
        "read-only into GPU containers at /usr/local/nvidia/lib64"
    )
    container_devices: str = Field(
        "", description="comma-separated device paths for GPU containers: character devices "
        "as devices, a directory (a fake driver's state) bound read-write"
    )

    def sim_nodes(self) -> list[SimNode]:
        if self.nodes_file:
            return load_nodes(Path(self.nodes_file))
        if self.nodes:
            return [SimNode.model_validate(n) for n in json.loads(self.nodes)]
        return []
