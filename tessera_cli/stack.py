"""The local stack: embedded NATS, kube-sim and every service as a child process.

Used by `tessera up` and by end-to-end tests. Each service is started exactly as in production
(`python -m tessera.<service>`, configured by env vars), so what runs here is what ships. kube-sim
plays the Kubernetes control plane and one kubelet per simulated node; each simulated node gets
its own node agent with the static device source, talking to that node's kubelet over unix
sockets. The state directory holds NATS data, logs, the webhook certificates and the kubeconfig
the CLI reads (`tessera apply/get/delete`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tessera.settings import NatsSettings
from tessera.simnodes import SimNode, load_nodes, make_nodes  # noqa: F401 (re-exported)
from tessera_cli.locate import KUBECONFIG_NAME, STACK_FILE, read_stack_info  # noqa: F401
from tessera_cli.nats_embedded import EmbeddedNats, EmbeddedNatsCluster, free_port
from tessera_cli.stack_auth import ADMIN_ENV_NAME, StackAuth, identity_of


@dataclass
class StackPorts:
    """Where the HTTP faces listen. `tessera up` uses the documented defaults; tests pick free
    ports so stacks never collide."""

    kube_sim: int = 6443
    scheduler: int = 8888
    admission: int = 9443
    metrics: int = 9394

    @classmethod
    def free(cls) -> StackPorts:
        return cls(free_port(), free_port(), free_port(), free_port())


def short_socket_root(state_dir: Path) -> Path:
    """A short /tmp directory for kubelet sockets (unix socket paths must stay < 108 bytes)."""
    digest = hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:10]
    return Path("/tmp") / f"tessera-kl-{digest}"


@dataclass
class ServiceSpec:
    """One child process of the stack."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)


def _mig_env(node: SimNode) -> dict[str, str]:
    """A MIG node's strategy and simulated instances (a GPU model without MIG: none)."""
    from tessera import mig

    model = mig.model_for(node.gpu_model)
    if node.mig == "none" or model is None:
        return {}
    env = {"TESSERA_MIG_STRATEGY": node.mig}
    if node.mig in ("single", "mixed"):
        smallest = model.profiles[0]
        env["TESSERA_STATIC_MIG_INSTANCES"] = node.mig_instances or ",".join(
            f"{smallest.name}@{s}" for s in smallest.starts)
    return env


def _family_env(node: SimNode) -> dict[str, str]:
    """Another vendor's node (its model names it, docs/vendors.md): the node agent serves that
    device family, from the family's simulated management library."""
    from tessera.device_kinds.vendor_models import family_for_model, is_vendor_model

    if not is_vendor_model(node.gpu_model):
        return {}
    return {"TESSERA_DEVICE_FAMILY": family_for_model(node.gpu_model)}


def node_agent_env(node: SimNode, socket_root: Path, state_dir: Path) -> dict[str, str]:
    node_dir = socket_root / node.name
    env = {
        "TESSERA_NODE_NAME": node.name,
        "TESSERA_DEVICE_SOURCE": "static",
        "TESSERA_STATIC_GPU_COUNT": str(node.gpus),
        "TESSERA_STATIC_GPU_MODEL": node.gpu_model,
        "TESSERA_STATIC_GPU_MEMORY_MIB": str(node.gpu_memory_mib),
        "TESSERA_STATIC_NUMA_NODES": str(node.numa_nodes),
        "TESSERA_DEVICE_PLUGIN_DIR": str(node_dir / "device-plugins"),
        "TESSERA_POD_RESOURCES_SOCKET": str(node_dir / "pod-resources" / "kubelet.sock"),
        "TESSERA_REGION_HOST_DIR": str(state_dir / "regions" / node.name),
    }
    env.update(_mig_env(node))
    env.update(_family_env(node))
    if node.dra:
        from tessera_cli.dra import node_env

        env.update(node_env(node_dir))
    if node.mig == "dynamic" and env.get("TESSERA_MIG_STRATEGY") == "dynamic":
        # the simulated MIG instances outlive the agent, as real ones do
        env["TESSERA_STATIC_MIG_STATE"] = str(state_dir / "mig" / f"{node.name}.json")
    libvgpu = Path(__file__).resolve().parent.parent / "native/libvgpu/build/libvgpu.so"
    if libvgpu.is_file():
        env["TESSERA_LIBVGPU_HOST_PATH"] = str(libvgpu)
    return env


# The extender speaks mutual TLS: kube-sim (as kube-scheduler) presents this client certificate,
# signed by the stack's CA; the scheduler refuses callers without one (docs/security.md §4.4).
EXTENDER_CLIENT_NAME = "kube-scheduler"


def extender_server_env(certs: Path, port: int) -> dict[str, str]:
    return {
        "TESSERA_LISTEN": f"127.0.0.1:{port}",
        "TESSERA_TLS_CERT": str(certs / "tls.crt"),
        "TESSERA_TLS_KEY": str(certs / "tls.key"),
        "TESSERA_TLS_CLIENT_CA": str(certs / "ca.crt"),
    }


def extender_client_env(certs: Path, port: int) -> dict[str, str]:
    return {
        "TESSERA_KUBE_SIM_EXTENDER_URL": f"https://127.0.0.1:{port}",
        "TESSERA_KUBE_SIM_EXTENDER_CA": str(certs / "ca.crt"),
        "TESSERA_KUBE_SIM_EXTENDER_CERT": str(certs / f"{EXTENDER_CLIENT_NAME}.crt"),
        "TESSERA_KUBE_SIM_EXTENDER_KEY": str(certs / f"{EXTENDER_CLIENT_NAME}.key"),
    }


# module -> the kube-sim client (its service account) it authenticates as; the webhook trusts
# these accounts' writes of scheduler-owned annotations, as the chart configures it.
KUBE_CLIENTS = {
    "tessera.scheduler": "scheduler",
    "tessera.node_agent": "node-agent",
    "tessera.admission": "admission",
    "tessera.quota": "quota",
    "tessera.metrics": "metrics",
}
COMPONENT_ACCOUNTS = "system:serviceaccount:tessera-system:"


def default_services(
    nodes: list[SimNode] | None = None,
    state_dir: Path = Path(".tessera"),
    ports: StackPorts | None = None,
    run_containers: bool = False,
    kubelet_delay_s: float = 0.0,
    kubelet_jitter_s: float = 0.0,
) -> list[ServiceSpec]:
    """kube-sim first (the others read its kubeconfig), then every service once, then one node
    agent per simulated node."""
    nodes = nodes if nodes is not None else make_nodes(1, 4, 24576, "NVIDIA A10")
    ports = ports or StackPorts()
    state_dir = state_dir.resolve()
    certs = state_dir / "certs"
    socket_root = short_socket_root(state_dir)
    kube_sim_env = {
        "TESSERA_KUBE_SIM_LISTEN": f"127.0.0.1:{ports.kube_sim}",
        "TESSERA_KUBE_SIM_KUBECONFIG": str(state_dir / KUBECONFIG_NAME),
        "TESSERA_KUBE_SIM_NODES": json.dumps([n.model_dump() for n in nodes]),
        "TESSERA_KUBE_SIM_WEBHOOK_URL": f"https://127.0.0.1:{ports.admission}/mutate",
        "TESSERA_KUBE_SIM_WEBHOOK_CA": str(certs / "ca.crt"),
        **extender_client_env(certs, ports.scheduler),
        "TESSERA_KUBE_SIM_KUBELET_ROOT": str(socket_root),
        "TESSERA_KUBE_SIM_RUN_CONTAINERS": "true" if run_containers else "false",
        "TESSERA_KUBE_SIM_KUBELET_DELAY_S": str(kubelet_delay_s),
        "TESSERA_KUBE_SIM_KUBELET_JITTER_S": str(kubelet_jitter_s),
        "TESSERA_KUBE_SIM_CONTAINER_LOG_DIR": str(state_dir / "containers"),
    }
    specs = [
        ServiceSpec("kube-sim", "tessera.kube_sim", kube_sim_env),
        ServiceSpec("quota", "tessera.quota"),
        ServiceSpec("scheduler", "tessera.scheduler", extender_server_env(certs, ports.scheduler)),
        ServiceSpec(
            "admission",
            "tessera.admission",
            {
                "TESSERA_LISTEN": f"127.0.0.1:{ports.admission}",
                "TESSERA_TLS_CERT": str(certs / "tls.crt"),
                "TESSERA_TLS_KEY": str(certs / "tls.key"),
                "TESSERA_ADMISSION_TRUSTED_USER_PREFIXES": COMPONENT_ACCOUNTS,
                # every node in DRA mode: HAMi pods become ResourceClaims (docs/dra.md)
                **({"TESSERA_ALLOCATION_MODE": "dra"}
                   if nodes and all(n.dra for n in nodes) else {}),
            },
        ),
        # Loopback: the dashboard and /metrics are for this machine (docs/security.md 4.5).
        ServiceSpec("metrics", "tessera.metrics", {"TESSERA_LISTEN": f"127.0.0.1:{ports.metrics}"}),
    ]
    for node in nodes:
        specs.append(
            ServiceSpec(
                f"node-agent/{node.name}",
                "tessera.node_agent",
                node_agent_env(node, socket_root, state_dir),
            )
        )
    return specs


@dataclass
class RunningService:
    spec: ServiceSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float

    @property
    def status(self) -> str:
        code = self.proc.poll()
        return "running" if code is None else f"exited ({code})"


class LocalStack:
    """Start NATS (unless a URL is given), kube-sim and the services; stop them in reverse."""

    def __init__(
        self,
        state_dir: Path,
        services: list[ServiceSpec],
        nats_url: str | None = None,
        extra_env: dict[str, str] | None = None,
        ports: StackPorts | None = None,
        nats_cluster: int = 0,
        nats_auth: bool = True,
    ) -> None:
        self.state_dir = state_dir.resolve()
        self.services = services
        self.extra_env = extra_env or {}
        self.nats: EmbeddedNats | None = None
        self.nats_url = nats_url
        self.ports = ports or StackPorts()
        self.running: list[RunningService] = []
        # `nats_cluster` >= 2: NATS runs as a JetStream cluster of that many servers.
        self.nats_cluster_size = nats_cluster
        self.nats_cluster: EmbeddedNatsCluster | None = None
        # The embedded NATS enforces one identity per service (tessera.bus_permissions); an
        # external NATS_URL is used as given.
        self.auth: StackAuth | None = (
            StackAuth.generate(self._node_names()) if nats_auth and nats_url is None else None
        )

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / KUBECONFIG_NAME

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.kube_sim}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}/"

    def start(self, wait_ready_s: float = 30.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "logs").mkdir(exist_ok=True)
        self._ensure_certificates()
        if self.auth is not None:  # each identity signs its commands with its own key
            self.auth.write_keys(self.state_dir / "command-keys")
        if self.nats_url is None and self.nats_cluster_size >= 2:
            self._start_nats_cluster()
            if self.auth is not None:
                self.auth.write_admin_env(self.state_dir / ADMIN_ENV_NAME, self.nats_url)
        if self.nats_url is None:
            self.nats = EmbeddedNats(
                data_dir=self.state_dir / "nats",
                auth_config=self.auth.server_config() if self.auth else None,
            ).start()
            self.nats_url = self.nats.url
            if self.auth is not None:
                self.auth.write_admin_env(self.state_dir / ADMIN_ENV_NAME, self.nats_url)
        self.kubeconfig.unlink(missing_ok=True)
        for spec in self.services:
            self.start_service(spec)
            if spec.module == "tessera.kube_sim":
                self._wait_for_api(wait_ready_s)
        self.write_stack_file(ready=False)

    def write_stack_file(self, ready: bool) -> None:
        """What the CLI reads to find this stack (tessera_cli.locate); `ready` once every
        service answers ready (`tessera up --wait` returns then)."""
        info = {
            "nats_url": self.nats_url,
            "kubeconfig": str(self.kubeconfig),
            "api_url": self.api_url,
            "dashboard_url": self.dashboard_url,
            "scheduler_url": f"https://127.0.0.1:{self.ports.scheduler}",
            "pid": os.getpid(),
            "nats_admin_env": str(self.state_dir / ADMIN_ENV_NAME) if self.auth else None,
            "ready": ready,
        }
        path = self.state_dir / STACK_FILE
        scratch = path.with_suffix(".tmp")
        scratch.write_text(json.dumps(info, indent=2))
        scratch.replace(path)  # readers never see half a file

    def _start_nats_cluster(self) -> None:
        """NATS as a JetStream cluster; every bucket and stream then keeps a replica on up to
        three servers, so one server's lost disk loses nothing."""
        cluster = EmbeddedNatsCluster(
            self.nats_cluster_size,
            self.state_dir / "nats-cluster",
            auth_config=self.auth.server_config() if self.auth else None,
        )
        self.nats_cluster = cluster.start()
        self.nats_url = cluster.url
        self.extra_env.setdefault("TESSERA_BUS_REPLICAS", str(min(3, self.nats_cluster_size)))

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the scheduler extender and the webhook answer ready (they need NATS and their
        first sync): what kube-scheduler and kube-apiserver depend on."""
        import ssl

        certs = self.state_dir / "certs"
        context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        extender = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        extender.load_cert_chain(
            certs / f"{EXTENDER_CLIENT_NAME}.crt", certs / f"{EXTENDER_CLIENT_NAME}.key"
        )
        probes = [
            (f"https://127.0.0.1:{self.ports.scheduler}/readyz", extender),
            (f"https://127.0.0.1:{self.ports.admission}/readyz", context),
        ]
        deadline = time.monotonic() + timeout_s
        for url, tls in probes:
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=1, context=tls) as reply:
                        if reply.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} not ready in {timeout_s:.0f} s")
                time.sleep(0.1)

    def readiness(self, name: str) -> str:
        """'ready' / 'not ready' from the service's /readyz ('' for services without one here):
        a service that lost its buckets says so while it re-creates them and rebuilds."""
        import ssl

        urls = {
            "scheduler": (f"https://127.0.0.1:{self.ports.scheduler}/readyz", None),
            "metrics": (f"http://127.0.0.1:{self.ports.metrics}/readyz", None),
            "admission": (
                f"https://127.0.0.1:{self.ports.admission}/readyz",
                ssl.create_default_context(cafile=str(self.state_dir / "certs" / "ca.crt")),
            ),
        }
        if name not in urls:
            return ""
        url, tls = urls[name]
        try:
            if name == "scheduler":  # the extender: mutual TLS, as kube-scheduler calls it
                certs = self.state_dir / "certs"
                tls = ssl.create_default_context(cafile=str(certs / "ca.crt"))
                tls.load_cert_chain(certs / f"{EXTENDER_CLIENT_NAME}.crt",
                                    certs / f"{EXTENDER_CLIENT_NAME}.key")  # fmt: skip
            with urllib.request.urlopen(url, timeout=0.5, context=tls) as reply:
                return "ready" if reply.status == 200 else "not ready"
        except OSError:
            return "not ready"

    def _ensure_certificates(self) -> None:
        from tessera_cli.certs import (  # cryptography: only when starting
            write_certificates,
            write_client_certificate,
        )

        certs = self.state_dir / "certs"
        fresh = not (certs / "tls.crt").is_file() or not (certs / "ca.crt").is_file()
        if fresh:
            write_certificates(certs, ["localhost", "tessera-admission"], ["127.0.0.1"])
        if fresh or not (certs / f"{EXTENDER_CLIENT_NAME}.crt").is_file():
            write_client_certificate(certs, EXTENDER_CLIENT_NAME)

    def _wait_for_api(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.kubeconfig.is_file():
                try:
                    with urllib.request.urlopen(f"{self.api_url}/readyz", timeout=1) as reply:
                        if reply.status == 200:
                            return
                except OSError:
                    pass
            kube_sim = next(r for r in self.running if r.spec.module == "tessera.kube_sim")
            if kube_sim.proc.poll() is not None:
                raise RuntimeError(f"kube-sim exited; see {kube_sim.log_path}")
            time.sleep(0.05)
        raise RuntimeError(f"kube-sim did not answer on {self.api_url} in {timeout_s:.0f} s")

    def _node_names(self) -> list[str]:
        return [
            spec.env["TESSERA_NODE_NAME"] for spec in self.services
            if spec.module == "tessera.node_agent" and "TESSERA_NODE_NAME" in spec.env
        ]

    def nats_identity_env(self, spec: ServiceSpec) -> dict[str, str]:
        """The child's own NATS user (none for kube-sim, or when auth is off)."""
        identity = identity_of(spec.module, spec.env)
        if self.auth is None or identity is None or identity.user not in self.auth.passwords:
            return {}
        return self.auth.env(identity.user)

    def nats_settings(self, role: str = "admin", node: str | None = None) -> NatsSettings:
        """How a test or the CLI connects to this stack's NATS as `role` (default: admin)."""
        if self.auth is None:
            return NatsSettings(NATS_URL=str(self.nats_url))
        return self.auth.settings(str(self.nats_url), role, node)

    def client_kubeconfig(self, spec: ServiceSpec) -> Path:
        """Each component talks to kube-sim as its own service account, in the kubeconfig
        kube-sim writes for it (`<kubeconfig>-<client>`); anything else as the admin."""
        client = KUBE_CLIENTS.get(spec.module)
        if client is None:
            return self.kubeconfig
        return self.kubeconfig.with_name(f"{KUBECONFIG_NAME}-{client}")

    def service_env(self, spec: ServiceSpec) -> dict[str, str]:
        env = {
            **os.environ,
            **self.extra_env,
            "NATS_URL": str(self.nats_url),
            "TESSERA_KUBECONFIG": str(self.client_kubeconfig(spec)),
            **spec.env,
        }
        for key in ("NATS_USER", "NATS_PASSWORD", "NATS_PASSWORD_FILE", "NATS_CREDS"):
            if self.auth is not None:
                env.pop(key, None)  # a developer's shell must not override the identities
        return {**env, **self.nats_identity_env(spec)}

    def start_service(self, spec: ServiceSpec) -> RunningService:
        log_path = self.state_dir / "logs" / f"{spec.name.replace('/', '-')}.log"
        log_file = log_path.open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", spec.module],
            env=self.service_env(spec),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the CLI only; it stops children itself
        )
        log_file.close()
        running = RunningService(spec, proc, log_path, time.time())
        self.running = [r for r in self.running if r.spec.name != spec.name] + [running]
        return running

    @staticmethod
    def _terminate(group: list[RunningService], timeout_s: float = 8.0) -> None:
        for running in group:
            if running.proc.poll() is None:
                running.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for running in group:
            try:
                running.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                running.proc.kill()
                running.proc.wait()

    def find(self, name: str) -> RunningService:
        return next(r for r in self.running if r.spec.name == name)

    def kill_service(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        running = self.find(name)
        if running.proc.poll() is None:
            running.proc.kill()
            running.proc.wait()

    def restart_service(self, name: str) -> RunningService:
        running = self.find(name)
        self.stop_service(running)
        return self.start_service(running.spec)

    def stop_service(self, running: RunningService, timeout_s: float = 8.0) -> None:
        if running.proc.poll() is None:
            running.proc.send_signal(signal.SIGTERM)
            try:
                running.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                running.proc.kill()
                running.proc.wait()

    def stop(self) -> None:
        """In order: the services (together), then kube-sim once nothing watches it any more,
        then NATS once nothing uses it; each within bounded time (SIGTERM, then SIGKILL)."""
        services = [r for r in reversed(self.running) if r.spec.module != "tessera.kube_sim"]
        control_plane = [r for r in self.running if r.spec.module == "tessera.kube_sim"]
        for group in (services, control_plane):
            self._terminate(group)
        if self.nats is not None:
            self.nats.stop()
        if self.nats_cluster is not None:
            self.nats_cluster.stop()
        (self.state_dir / STACK_FILE).unlink(missing_ok=True)
        # The kubelets' sockets (default_services puts them there); kube-sim has stopped.
        shutil.rmtree(short_socket_root(self.state_dir), ignore_errors=True)
