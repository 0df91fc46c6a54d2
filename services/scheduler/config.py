"""Settings only the scheduler reads (TESSERA_* env, listed by `--help` with the shared ones)."""

from __future__ import annotations

import os

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tessera.validation import MAX_PREEMPTION_MARGIN_S


class SchedulerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TESSERA_", env_file=os.environ.get("TESSERA_ENV_FILE"), extra="ignore"
    )

    claim_ttl_s: float = Field(
        30.0,
        gt=0,
        description="a pod's in-flight claim (bind -> Allocate) lapses after this; pods of "
        "another shape waiting for the node then go ahead",
    )
    max_in_flight_per_node: int = Field(
        0,
        ge=0,
        description="cap on pods in flight (bind -> Allocate) per node; 0 = no cap (pods of one "
        "shape go in flight together), 1 = the old one-claim-per-node behaviour",
    )
    bind_timeout_s: float = Field(
        20.0,
        gt=0,
        description="how long bind waits for another pod's claim (keep below "
        "kube-scheduler's extender httpTimeout)",
    )
    device_cordon: str = Field(
        "",
        description="comma list of GPU UUIDs excluded from new allocations on every node "
        "(added to each node's hami.io/device-cordon annotation when the cluster port can read it)",
    )
    avoid_busy_nodes: bool = Field(
        True,
        description="place on nodes with no bind in flight (claim or unbound reservation) "
        "before the node policy's favourite, so a burst is not serialised on one node's claim",
    )
    orphaned_bind_s: float = Field(
        3.0,
        gt=0,
        description="a claim held this long by a pod still `reserved` but bound in the "
        "cluster means its binder died mid-bind: the sweeper marks it bound",
    )
    mark_bound_at_bind: bool = Field(
        False,
        description="write the `bound` mark in the bind itself (one more ledger write per "
        "pod); by default a bind whose pod is in flight with time to spare leaves the mark to "
        "the node agent's Allocate (`allocated`), or to the sweeper after orphaned_bind_s",
    )
    sweep_interval_s: float = Field(
        1.0, gt=0, description="how often expired reservations and lapsed claims are swept"
    )
    reconcile_interval_s: float = Field(
        30.0, gt=0, description="how often allocations of pods that no longer exist are released"
    )
    release_missing_pods: bool = Field(
        True,
        description="release the allocations of pods the cluster does not list (deleted while "
        "no replica watched), before ready and every reconcile_interval_s (stale.py); off only "
        "where the cluster is a stand-in that lists no pods (benchmarks)",
    )
    tls_cert: str | None = Field(None, description="PEM certificate: serve the extender over TLS")
    tls_key: str | None = Field(None, description="PEM key for tls_cert")
    tls_client_ca: str | None = Field(
        None,
        description="PEM CA: with tls_cert, callers must present a client certificate it "
        "signed (kube-scheduler's extender tlsConfig certFile/keyFile); others are refused",
    )
    probe_listen: str | None = Field(
        None,
        description="host:port of a plain HTTP listener with only /healthz, /readyz and "
        "/metrics (for kubelet probes and Prometheus when the extender is mTLS or loopback)",
    )
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0, description="largest request accepted")
    instance: str = Field(
        "", description="this replica's name in claims and events (default: hostname-pid)"
    )
    # --- the backlog of unschedulable pods (backlog.py) ---
    backlog_share: float = Field(
        0.25, ge=0,
        description="the most CPU (a share of the scheduler's one thread) that calls refusing "
        "pods may take while other pods are placed; beyond it a retry of a refused pod is "
        "answered BacklogDeferred (kube-scheduler retries after its backoff); 1 = no bound",
    )
    backlog_burst_s: float = Field(
        0.25, ge=0, description="CPU seconds of refusals allowed at once above backlog_share"
    )
    backlog_max_defer_s: float = Field(
        30.0, gt=0,
        description="a refused pod is evaluated again at the latest this long after its last "
        "evaluation, whatever the backlog's share",
    )
    # --- preemption (preemption_run.py) ---
    preemption: bool = Field(
        True, description="evict lower-priority pods (spec.priority) for a pod that fits no node"
    )
    preemption_margin_s: float = Field(
        15.0, ge=0, le=MAX_PREEMPTION_MARGIN_S,
        description="a nomination is re-evaluated this long after its victims' "
        "grace period if their GPU memory is not back by then",
    )
    preemption_retry_s: float = Field(
        2.0, ge=0, description="least time between two preemption attempts for one pod"
    )

    def cordoned_uuids(self) -> frozenset[str]:
        return frozenset(u.strip() for u in self.device_cordon.split(",") if u.strip())
