"""Settings shared by every service, from environment variables (or an env file).

Every setting is `TESSERA_<NAME>` except the NATS connection (`NATS_URL`, `NATS_CREDS`, ...),
which keeps the names NATS tooling already uses. `TESSERA_ENV_FILE` names a file of the same
variables, so compose, Helm and the CLI configure services alike.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

CorePolicy = Literal["default", "force", "disable"]
MigStrategy = Literal["none", "single", "mixed", "dynamic"]


class NatsSettings(BaseSettings):
    """How to reach the broker."""

    model_config = SettingsConfigDict(env_file=os.environ.get("TESSERA_ENV_FILE"), extra="ignore")

    url: str = Field("nats://127.0.0.1:4222", validation_alias="NATS_URL")
    creds: str | None = Field(None, validation_alias="NATS_CREDS")
    user: str | None = Field(None, validation_alias="NATS_USER")
    password: str | None = Field(None, validation_alias="NATS_PASSWORD")
    tls_ca: str | None = Field(None, validation_alias="NATS_TLS_CA")
    password_file: str | None = Field(
        None,
        validation_alias="NATS_PASSWORD_FILE",
        description="read the password from this file (a mounted Secret) instead of NATS_PASSWORD",
    )

    def resolved_password(self) -> str:
        """NATS_PASSWORD, else the first line of NATS_PASSWORD_FILE, else ''."""
        if self.password:
            return self.password
        if self.password_file:
            with open(self.password_file, encoding="utf-8") as handle:
                return handle.readline().strip()
        return ""


class TesseraSettings(BaseSettings):
    """Cluster-wide knobs with HAMi's defaults (see specs/hami-compat.md)."""

    model_config = SettingsConfigDict(
        env_prefix="TESSERA_",
        env_file=os.environ.get("TESSERA_ENV_FILE"),
        extra="ignore",
        populate_by_name=True,
    )

    # Resource names (HAMi's defaults; configurable like HAMi's chart values).
    resource_name: str = "nvidia.com/gpu"
    resource_mem: str = "nvidia.com/gpumem"
    resource_mem_percentage: str = "nvidia.com/gpumem-percentage"
    resource_cores: str = "nvidia.com/gpucores"
    resource_priority: str = "nvidia.com/priority"
    # Other device families' resource names over their HAMi defaults (tessera.device_kinds), as
    # HAMi's per-vendor resourceCountName/resourceMemoryName/resourceCoreName: a JSON map
    # family -> {"count": ..., "memory": ..., "cores": ...}. NVIDIA's are the five above.
    device_resource_names: dict[str, dict[str, str]] = Field(default_factory=dict)

    scheduler_name: str = "tessera-scheduler"
    allocation_mode: Literal["extender", "dra"] = Field(
        "extender", description="how GPU pods are placed: extender (the scheduler extender and "
        "device plugin) or dra (the webhook converts HAMi's resources into ResourceClaims for "
        "kube-scheduler's allocator; a pod's tessera.io/allocation-mode annotation overrides)"
    )
    device_split_count: int = Field(10, ge=1, le=1024)
    device_memory_scaling: float = Field(1.0, gt=0, le=100)
    device_core_scaling: float = Field(1.0, gt=0, le=100)
    default_mem: int = Field(0, ge=0, description="MiB per GPU when a request names none")
    default_cores: int = Field(0, ge=0, le=100)
    default_gpu_num: int = Field(1, ge=1)
    memory_factor: int = Field(1, ge=1)
    gpu_scheduler_policy: str = "spread"
    node_scheduler_policy: str = "binpack"
    core_policy: CorePolicy = "default"
    mig_strategy: MigStrategy = Field(
        "none", description="how MIG instances are offered: none, single, mixed (static "
        "instances, the NVIDIA device plugin's strategies) or dynamic (created per pod)"
    )
    env_overwrite: bool = Field(
        False, description="set NVIDIA_VISIBLE_DEVICES=none on containers that ask no GPU"
    )

    # Service plumbing.
    listen: str | None = None
    node_name: str | None = Field(None, validation_alias=AliasChoices("TESSERA_NODE_NAME"))
    log_level: str = "INFO"
    quota_enabled: bool = True
    cluster: Literal["auto", "kubernetes", "none"] = Field(
        "auto",
        description="cluster API: auto = kubernetes when TESSERA_KUBECONFIG or in-cluster",
    )
    reservation_ttl_s: float = Field(30.0, gt=0, description="unbound reservations expire")
    node_ttl_s: float = Field(15.0, gt=0, description="TTL of tessera-nodes entries")
    request_timeout_s: float = Field(2.0, gt=0, description="NATS request/reply timeout")
    quota_reconcile_interval_s: float = Field(
        10.0, gt=0, description="quota: how often usage is reconciled against the ledger"
    )
    quota_grace_margin_s: float = Field(
        10.0, ge=0, description="quota: an unbacked charge is dropped after reservation TTL + this"
    )

    # Signed commands (tessera.signing): this identity's key, and whose keys it trusts.
    command_key_file: str | None = Field(
        None, description="PEM Ed25519 key this process signs its commands with (quota "
        "reserve/release/set, limits.set, config.set); provisioned with its NATS credential",
    )
    command_trust_file: str | None = Field(
        None, description="JSON {\"keys\": {user: base64 public key}} of the identities whose "
        "commands this service takes; unset: commands are not signature-checked",
    )

    # Durability (the bus's own redundancy and recovery).
    bus_replicas: int = Field(
        1, ge=1, le=5, description="replicas of every bucket and stream (3 on a 3-server NATS)"
    )
    bus_check_interval_s: float = Field(
        1.0, gt=0, description="how often buckets/streams are checked and re-created if lost"
    )
    clock_sync_interval_s: float = Field(
        5.0, gt=0, description="how often the offset to the NATS server's clock is re-measured"
    )
    clock_skew_s: float = Field(
        0.0, ge=-86400, le=86400,
        description="drills only: shift this process's own clock (leases must not notice)",
    )

    # Metrics service.
    legacy_names: bool = Field(
        False, description="metrics: also publish HAMi's pre-hami_ names (GPUDeviceCoreLimit, "
        "HostCoreUtilization, ...) that older dashboards and HAMi's WebUI read",
    )
    metrics_auth_token_file: str | None = Field(
        None, description="metrics: a file holding a token every request but /healthz and "
        "/readyz must present (Authorization: Bearer <token>, or Basic with it as password)",
    )

    # Admission webhook.
    tls_cert: str | None = Field(None, description="webhook TLS certificate (PEM), reloaded")
    tls_key: str | None = Field(None, description="webhook TLS private key (PEM)")
    quota_failure_policy: Literal["deny", "allow"] = Field(
        "deny",
        description="admission when the quota service does not answer: deny GPU pods, or allow "
        "them unchecked (with a warning)",
    )
    admission_trusted_user_prefixes: str = Field(
        "",
        description="comma list of user-name prefixes (the scheduler's and node agent's service "
        "accounts) whose pod updates may change scheduler-owned annotations",
    )
    max_gpus_per_node: int = Field(
        16, ge=1, le=1024, description="admission: a container asking more GPUs than this can "
        "never fit on any node and is denied",
    )
    admission_max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=4096, description="larger AdmissionReview bodies get HTTP 413"
    )

    # Node agent (device discovery, device plugin, container regions).
    device_source: Literal["nvml", "static"] = Field(
        "nvml", description="nvml = real GPUs; static = simulated GPUs (local stack)"
    )
    device_family: str = Field(
        "", description="the device family this node serves (tessera.device_kinds): its devices "
        "come from the family's backend (its fake on the local stack) and kubelet knows them by "
        "its count resource; '' = NVIDIA GPUs from device_source"
    )
    static_gpu_count: int = Field(2, ge=0, le=64, description="static source: GPUs per node")
    static_gpu_model: str = Field(
        "NVIDIA A100-SXM4-80GB", description="static source: NVML name (type = NVIDIA-<name>)"
    )
    static_gpu_memory_mib: int = Field(81920, ge=1, description="static source: MiB per GPU")
    static_numa_nodes: int = Field(1, ge=1, description="static source: GPUs spread over these")
    static_mig_instances: str = Field(
        "", description="static source: MIG instances on every simulated GPU, "
        "'<profile>@<start>,…' (e.g. '1g.10gb@0,1g.10gb@1,3g.40gb@4'); set: GPUs in MIG mode"
    )
    static_mig_state: str = Field(
        "", description="static source: file holding the simulated dynamic MIG instances (they "
        "outlive the agent, as real ones do); empty: kept in memory"
    )
    static_fault_file: str | None = Field(
        None, description="static source: lines '<GPU index> <XID>' appended here are driver "
        "events (fault injection for the local stack)"
    )
    nvml_library: str | None = Field(
        None, description="path of libnvidia-ml.so.1 to load instead of the system one"
    )
    ignored_xids: str = Field(
        "13,31,43,45,68,109", description="XIDs that do not make a GPU unhealthy (HAMi's list)"
    )
    health_recovery_s: float = Field(
        60.0, gt=0, description="a GPU with no critical event for this long is healthy again"
    )
    node_heartbeat_s: float = Field(5.0, gt=0, description="re-put tessera-nodes this often")
    usage_interval_s: float = Field(1.0, gt=0, description="usage sampling period")
    device_plugin_dir: str = Field(
        "/var/lib/kubelet/device-plugins", description="kubelet's device plugin socket dir"
    )
    pod_resources_socket: str = Field(
        "/var/lib/kubelet/pod-resources/kubelet.sock", description="kubelet pod-resources API"
    )
    region_host_dir: str = Field(
        "/var/lib/tessera/containers", description="per-container limits and usage regions"
    )
    mps_control_binary: str = Field(
        "nvidia-cuda-mps-control",
        description="node agent: NVIDIA's MPS control program, run once per GPU in MPS mode",
    )
    mps_reconcile_s: float = Field(
        5.0, gt=0, description="node agent: how often MPS daemons and their limits are checked"
    )
    libvgpu_host_path: str = Field(
        "/usr/local/vgpu/libvgpu.so", description="libvgpu on the host, mounted into containers"
    )
    scrub_on_free: bool = Field(
        False,
        description="node agent: seal scrub-on-free (device memory zeroed before it is freed) "
        "into every container on this node; a pod can ask for it alone with the "
        "tessera.io/scrub-on-free annotation",
    )
    preload_host_path: str | None = Field(
        None,
        description="ld.so.preload installed on the host (Helm's init container); unset: the "
        "agent writes one in the region dir",
    )

    memory_leases: bool = Field(
        True,
        description="libvgpu leases device memory from the node agent (one socket per container): "
        "the container's account lives outside its reach, and a process using a limited GPU "
        "without a lease connection is caught by the watchdog at first sight; off: the usage "
        "region alone is the account (the watchdog then acts after its grace period)",
    )
    memory_reclaim_wait_s: float = Field(
        15.0, ge=0, le=600,
        description="elastic memory (docs/elastic.md): how long an allocation within a "
        "container's guarantee waits for memory borrowers hold on its GPU to come back (their "
        "unused leases recalled, their frees, evictions) before the account grants it anyway and "
        "the driver answers",
    )
    memory_reclaim_enforcement: Literal["evict", "borrower"] = Field(
        "evict",
        description="elastic memory: when a guarantee is due and borrowers on its GPU have not "
        "given the memory back within memory_reclaim_grace_s, evict them whatever their own "
        "tessera.io/gpumem-reclaim (evict: a guarantee is a guarantee), or only those that "
        "opted in (borrower: past the reclaim wait the driver decides, a CUDA OOM on a full card)",
    )
    memory_reclaim_grace_s: float = Field(
        5.0, ge=0, le=600,
        description="elastic memory: how long borrowers have to give memory back to a due "
        "guarantee before memory_reclaim_enforcement=evict evicts them",
    )
    memory_evict_grace_s: int = Field(
        5, ge=0, le=3600,
        description="elastic memory: the grace period of the eviction of a borrower that opted "
        "in (tessera.io/gpumem-reclaim: evict)",
    )
    compute_reclaim_event_window_s: float = Field(
        60.0, ge=0, le=86400,
        description="elastic compute: at most one ComputeReclaimEvent (and one ComputeReclaimed "
        "pod Event) per container and GPU per this many seconds; the first reclaim at once, "
        "the rest of the window summed at its end (0: every reclaim its own event)",
    )

    # Node agent: the watchdog on real usage (NVML), outside the tenant's reach.
    enforcement: Literal["observe", "kill"] = Field(
        "observe",
        description="watchdog policy on a breach: observe = event + metric; kill = also end the "
        "pod's processes on that GPU (HAMi's ACTIVE_OOM_KILLER)",
    )
    lease_enforcement: Literal["observe", "kill"] = Field(
        "kill",
        description="watchdog policy, with memory leases, on a process using a leased GPU without "
        "libvgpu's lease (unattested) or a pod holding more than it leased (unleased): acted on "
        "at first sight",
    )
    watchdog: Literal["auto", "on", "off"] = Field(
        "auto", description="the usage watchdog: auto = on with the nvml device source"
    )
    watchdog_poll_s: float = Field(
        0.6, gt=0, description="watchdog: NVML poll period (memory, compute, region claims)"
    )
    watchdog_lease_poll_s: float = Field(
        0.3, gt=0,
        description="watchdog, with memory leases: between full polls, NVML's processes against "
        "the lease service alone, this often (a bypass is killed within it)",
    )
    watchdog_memory_margin_pct: float = Field(
        5.0, ge=0, description="watchdog: memory margin, % above the sealed limit"
    )
    watchdog_memory_grace_s: float = Field(
        2.0, ge=0, description="watchdog: memory above limit + margin this long is a breach"
    )
    watchdog_compute_margin_pct: float = Field(
        10.0, ge=0, description="watchdog: compute margin, SM % points above the limit"
    )
    watchdog_compute_window_s: float = Field(
        10.0, gt=0,
        description="watchdog: mean SM % over this window above limit + margin is a breach",
    )
    watchdog_tamper_allowance_mib: int = Field(
        256, ge=0,
        description="watchdog: NVML may show this much more than a region claims (contexts) "
        "before the region is reported as tampered",
    )
    watchdog_proc_root: str = Field(
        "/proc", description="watchdog: the host's /proc (pid -> cgroup -> pod)"
    )

    # Per-node device configuration (ConfigMap tessera-node-config; services/node-agent).
    node_config_namespace: str = Field(
        "default", description="node agent: namespace of the tessera-node-config ConfigMap"
    )
    max_device_memory_scaling: float | None = Field(
        None, gt=0, le=100,
        description="ceiling of any node's memory scaling (per-node config included); the "
        "scheduler refuses registrations above it. Unset: device_memory_scaling",
    )
    max_device_core_scaling: float | None = Field(
        None, gt=0, le=100,
        description="ceiling of any node's core scaling; unset: device_core_scaling",
    )

    # Dynamic MIG (migstrategy dynamic; services/node-agent/mig_dynamic.py).
    mig_geometries: str = Field(
        "", description="dynamic MIG: allowed geometries per GPU model, JSON "
        '{"A100-SXM4-80GB": [{"3g.40gb": 2}, {"1g.10gb": 7}]}; a model not named: any layout '
        "NVIDIA's profile tables allow",
    )
    mig_reconcile_s: float = Field(
        2.0, gt=0, description="dynamic MIG: how often instances are reconciled with the ledger"
    )
    mig_orphan_grace_s: float = Field(
        30.0, ge=0, description="dynamic MIG: an instance no allocation holds is destroyed "
        "after this long (a pod's release destroys its instance at once)",
    )

    @field_validator("gpu_scheduler_policy", "node_scheduler_policy")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.strip().lower()

    def ignored_xid_set(self) -> frozenset[int]:
        """`ignored_xids` parsed ("13, 31" -> {13, 31}); junk items are an error at start-up."""
        items = [x.strip() for x in self.ignored_xids.replace(";", ",").split(",")]
        return frozenset(int(x) for x in items if x)

    def resource_names(self) -> list[str]:
        """Every resource name the scheduler extender manages."""
        return [
            self.resource_name,
            self.resource_mem,
            self.resource_mem_percentage,
            self.resource_cores,
            self.resource_priority,
        ]


def settings_help(model: type[BaseSettings]) -> list[tuple[str, str, str]]:
    """(env var, default, description) for every field: what `--help` lists."""
    rows: list[tuple[str, str, str]] = []
    prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, str):
            env = alias
        elif isinstance(alias, AliasChoices):
            env = str(alias.choices[0])
        else:
            env = f"{prefix}{name}".upper()
        rows.append((env, repr(field.default), field.description or ""))
    return rows
