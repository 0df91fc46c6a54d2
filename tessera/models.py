"""Every message Tessera puts on the bus: KV values, events, usage samples, request/replies.

All times are unix seconds (float). Memory is MiB unless a field says bytes. A device's
`memory_mib` and `cores` are what it advertises (physical × the configured scaling).
"""

from __future__ import annotations

import time
import uuid
from enum import StrEnum
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tessera.codec import Message, decode, peek_schema


def now() -> float:
    return time.time()


# ---------------------------------------------------------------------------------------------
# Nodes (KV tessera-nodes)


class MigCapability(Message):
    """A GPU whose node runs dynamic MIG (`migstrategy: dynamic`, HAMi's `mig` mode): the
    scheduler fits pods to this model's instance profiles (tessera/mig.py) and the node agent
    creates the instances at Allocate."""

    model: str = Field(description="tessera.mig.MODELS key, e.g. A100-SXM4-80GB")
    geometries: list[dict[str, int]] = Field(
        default_factory=list,
        description="allowed geometries, each {profile: count}; empty = any the hardware holds",
    )


class StaticMigInstance(Message):
    """An existing MIG instance a node offers under migstrategy mixed (kubelet allocates it; the
    ledger does not hold it)."""

    uuid: str = Field(max_length=128, description="the MIG-… device UUID")
    profile: str = Field(max_length=32, description="e.g. 1g.10gb")
    start: int = Field(ge=0, le=64, description="first memory slice of its placement")
    size: int = Field(1, ge=1, le=64, description="memory slices of its placement")
    pod: str = Field("", max_length=320, description="namespace/name holding it ('' = free)")


class DeviceInfo(Message):
    """One physical GPU as the node agent advertises it."""

    uuid: str
    index: int = Field(ge=0)
    type: str = Field(description="NVML name prefixed with NVIDIA-, e.g. NVIDIA-H200")
    memory_mib: int = Field(ge=0, description="advertised memory = physical × memory scaling")
    physical_memory_mib: int = Field(0, ge=0)
    cores: int = Field(100, ge=0, description="advertised compute = 100 × core scaling")
    split_count: int = Field(10, ge=1, description="replica slots (pods) the GPU can hold")
    numa: int = 0
    healthy: bool = True
    mode: str = "hami-core"
    links: dict[str, int] = Field(
        default_factory=dict, description="peer GPU uuid -> HAMi link score (higher is better)"
    )
    mig: MigCapability | None = Field(
        None, description="set when the card serves dynamic MIG (its mode is then `mig`)"
    )
    mig_instances: list[StaticMigInstance] = Field(
        default_factory=list, max_length=16,
        description="static MIG (migstrategy mixed): the instances on this card the node offers "
        "as nvidia.com/mig-<profile>, with the pod kubelet gave each (for the dashboard)",
    )
    part_ids: list[str] = Field(
        default_factory=list, max_length=8,
        description="the vendor's IDs of the devices HAMi and kubelet count that this one device "
        "spans, in order (a 910C module: its two NPUs' die IDs, the first = uuid); empty: one",
    )


class NodeRegistration(Message):
    """KV tessera-nodes[node]: re-put on every heartbeat; the bucket TTL drops dead nodes."""

    node: str
    devices: list[DeviceInfo]
    heartbeat_at: float = Field(default_factory=now)
    agent_version: str = "0.1.0"


# ---------------------------------------------------------------------------------------------
# Ledger (KV tessera-ledger)


class AllocationState(StrEnum):
    RESERVED = "reserved"
    BOUND = "bound"
    ALLOCATED = "allocated"
    RELEASED = "released"
    FAILED = "failed"


ACTIVE_STATES = frozenset(
    {AllocationState.RESERVED, AllocationState.BOUND, AllocationState.ALLOCATED}
)


class MigState(StrEnum):
    PLANNED = "planned"  # placed by the scheduler; the node agent creates it at Allocate
    CREATED = "created"  # exists on the GPU; `mig_uuid` is the MIG device the container gets
    VANISHED = "vanished"  # it existed and is gone (reboot, an operator's nvidia-smi): reported
    FAILED = "failed"  # NVML refused to create it; the allocation is released with the reason


class MigInstanceGrant(Message):
    """The dynamic MIG instance (GPU instance + one compute instance spanning it) a grant is
    served by. The GPU is the grant's `uuid`; the grant's memory/cores are the profile's."""

    profile: str = Field(description="GPU instance profile, e.g. 3g.40gb")
    start: int = Field(ge=0, description="first memory slice of its placement")
    size: int = Field(ge=1, description="memory slices of its placement")
    mig_uuid: str = Field("", description="the MIG-… device UUID once created")
    state: MigState = MigState.PLANNED


class DeviceGrant(Message):
    """One GPU given to one container: HAMi's `UUID,TYPE,MEM,CORES`."""

    uuid: str
    type: str
    memory_mib: int = Field(ge=0)
    cores: int = Field(ge=0)
    mig: MigInstanceGrant | None = Field(
        None, description="dynamic MIG: the instance serving this grant (None: a libvgpu slice)"
    )
    # Elastic sharing (issue 33, docs/elastic.md): `memory_mib` / `cores` are the guarantee the
    # scheduler packs by; these are the burst limits the container may reach while the card has
    # room (0: none, a hard slice exactly as before).
    memory_limit_mib: int = Field(
        0, ge=0, description="memory burst limit, MiB (0: none; else >= memory_mib)"
    )
    cores_limit: int = Field(0, ge=0, le=100, description="compute burst limit, % (0: none)")


class Allocation(Message):
    """A pod's grants on one node. `containers` is positional: init containers first."""

    pod_uid: str
    namespace: str
    name: str
    node: str
    containers: list[list[DeviceGrant]]
    init_count: int = Field(0, ge=0, description="how many leading entries are init containers")
    init_done: bool = Field(False, description="init containers finished: usage shrinks")
    state: AllocationState = AllocationState.RESERVED
    created_at: float = Field(default_factory=now)
    updated_at: float = Field(default_factory=now)
    expires_at: float | None = Field(None, description="a reservation not bound by then lapses")
    priority: int = 1
    core_policy: str = "default"
    scrub_on_free: bool = Field(
        False, description="the pod asked for tessera.io/scrub-on-free: zero memory before free"
    )
    reason: str = ""
    container_names: list[str] = Field(
        default_factory=list, description="names matching `containers`, positionally"
    )
    quota_held: bool = Field(False, description="a quota reservation exists for this pod")
    sidecars: list[int] = Field(
        default_factory=list,
        description="indices of init containers with restartPolicy: Always (native sidecars): "
        "they run alongside the app containers, so they are summed with them, not maxed",
    )
    preempted_by: str = Field(
        "", description="uid of the higher-priority pod this pod is being evicted for (preemption)"
    )
    preempted_until: float | None = Field(
        None,
        description="while now < this, the pod's capacity is held by the pod named in "
        "`preempted_by` (its nominated reservation), not by this one; after it, it counts again",
    )
    memory_reclaim: Literal["fail", "evict"] = Field(
        "fail", description="elastic memory: what happens to memory borrowed beyond a guarantee "
        "when a neighbour's guarantee needs it (tessera.io/gpumem-reclaim)",
    )
    memory_wait_s: float = Field(
        0.0, ge=0, le=3600, description="an allocation that does not fit waits this long for "
        "memory instead of failing at once (tessera.io/gpumem-wait-seconds; 0: never)",
    )

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def init_grants(self) -> list[list[DeviceGrant]]:
        """Init containers that run to completion, one after another (counted by max)."""
        sidecars = set(self.sidecars)
        return [g for i, g in enumerate(self.containers[: self.init_count]) if i not in sidecars]

    def mig_grants(self) -> list[DeviceGrant]:
        """The grants served by a dynamic MIG instance (GPU = `uuid`, instance = `mig`)."""
        return [g for grants in self.containers for g in grants if g.mig is not None]

    def app_grants(self) -> list[list[DeviceGrant]]:
        """App containers and native sidecars: they run together (summed)."""
        sidecars = [self.containers[i] for i in self.sidecars if i < self.init_count]
        return [*sidecars, *self.containers[self.init_count :]]


class InFlightClaim(Message):
    """A pod between bind and the node agent's resolution of it (DESIGN §3 step 3-5)."""

    pod_uid: str
    namespace: str
    name: str
    taken_at: float = Field(default_factory=now)
    expires_at: float
    holder: str = Field("", description="the scheduler instance that took it")


class NodeLedger(Message):
    """KV tessera-ledger[node]: every allocation on the node. Every write is a CAS."""

    node: str
    allocations: dict[str, Allocation] = Field(default_factory=dict)
    claim: InFlightClaim | None = Field(
        None, description="legacy single in-flight claim (older schedulers); read with `claims`"
    )
    claims: dict[str, InFlightClaim] = Field(
        default_factory=dict,
        description="pod uid -> claim: the pods in flight between bind and the agent's "
        "resolution; all of one shape at a time (interchangeable until PreStart)",
    )

    def in_flight(self) -> dict[str, InFlightClaim]:
        """Every claim, the legacy single one included."""
        if self.claim is None or self.claim.pod_uid in self.claims:
            return self.claims
        return {**self.claims, self.claim.pod_uid: self.claim}


def allocation_shape(allocation: Allocation) -> tuple:
    """What makes two pods interchangeable on one node: the same GPU containers in the same
    order with the same per-GPU memory and cores, and the same pattern of shared cards between
    containers (an app container on its init container's card). Swapping the grants of two pods
    of one shape moves no capacity: every card holds the same amounts as before."""
    first_seen: dict[str, int] = {}
    containers = []
    for grants in allocation.containers:
        containers.append(tuple(
            (g.memory_mib, g.cores, first_seen.setdefault(g.uuid, len(first_seen)))
            for g in grants
        ))  # fmt: skip
    # Native sidecars keep their devices (kubelet reuses only plain init containers' ones).
    return (allocation.init_count, tuple(allocation.sidecars), tuple(containers))


def allocation_layout(allocation: Allocation) -> tuple:
    """What kubelet sees of a pod's GPU request: its shape without the amounts (the same GPU
    containers with the same device counts, the same cards shared between them, the same native
    sidecars). Pods of one layout can exchange cards (`exchange_grants`)."""
    first_seen: dict[str, int] = {}
    containers = tuple(
        tuple(first_seen.setdefault(g.uuid, len(first_seen)) for g in grants)
        for grants in allocation.containers
    )
    return (allocation.init_count, tuple(allocation.sidecars), containers)


def exchange_grants(
    a: Allocation, b: Allocation
) -> tuple[list[list[DeviceGrant]], list[list[DeviceGrant]]]:
    """Two pods of one layout trade cards, each keeping its own amounts: (a's grants on b's
    cards, b's grants on a's cards), position by position as kubelet would hand them over."""

    def onto(mine: Allocation, theirs: Allocation) -> list[list[DeviceGrant]]:
        return [
            [g.model_copy(update={"uuid": t.uuid}) for g, t in zip(grants, other, strict=True)]
            for grants, other in zip(mine.containers, theirs.containers, strict=True)
        ]

    return onto(a, b), onto(b, a)


# ---------------------------------------------------------------------------------------------
# Quota (KV tessera-quota)


class QuotaAmount(Message):
    """Memory (MiB), cores (% units) and GPU count. None = unlimited (for limits)."""

    memory_mib: int | None = None
    cores: int | None = None
    gpus: int | None = None


class QuotaCharge(Message):
    """What one pod holds against its namespace quota."""

    pod_uid: str
    name: str = ""
    memory_mib: int = Field(0, ge=0)
    cores: int = Field(0, ge=0)
    gpus: int = Field(0, ge=0)
    at: float = Field(default_factory=now)
    handed_from: str = Field("", description="the pod whose DRA booking this charge was handed "
                             "on from (a shared claim): while the node's ledger books the claim "
                             "under that pod still, the charge is backed")  # fmt: skip


class QuotaUsage(Message):
    """Totals of the charges folded out of a namespace's state into their own keys."""

    memory_mib: int = Field(0, ge=0)
    cores: int = Field(0, ge=0)
    gpus: int = Field(0, ge=0)
    pods: int = Field(0, ge=0)


class QuotaState(Message):
    """KV tessera-quota[namespace]: the limits and the usage counter, one small value whatever
    the namespace's size (every write a CAS).

    Usage = `settled` (the totals of charges kept one per pod in KV tessera-quota-charges, key
    `<namespace>.<pod uid>`) + `charges` (recent reservations, folded into `settled` and their
    own keys a few seconds later). `releasing`: settled charges already taken out of `settled`
    whose keys are being deleted. A status reply carries every charge in `charges` instead.
    """

    namespace: str
    limits: QuotaAmount = Field(default_factory=QuotaAmount)
    charges: dict[str, QuotaCharge] = Field(default_factory=dict)
    source: str = Field("", description="where the limits came from (ResourceQuota name, cli)")
    settled: QuotaUsage = Field(default_factory=QuotaUsage)
    releasing: dict[str, QuotaCharge] = Field(default_factory=dict)

    def used(self) -> QuotaAmount:
        return QuotaAmount(
            memory_mib=self.settled.memory_mib + sum(c.memory_mib for c in self.charges.values()),
            cores=self.settled.cores + sum(c.cores for c in self.charges.values()),
            gpus=self.settled.gpus + sum(c.gpus for c in self.charges.values()),
        )

    def pods(self) -> int:
        return self.settled.pods + len(self.charges)


# ---------------------------------------------------------------------------------------------
# Usage samples (core NATS tessera.usage.<node>, loss tolerant)


class DeviceUsage(Message):
    uuid: str
    used_bytes: int = Field(0, ge=0)
    limit_bytes: int = Field(0, ge=0)
    sm_util: float = Field(0.0, ge=0, description="achieved compute %, last window")
    sm_limit: int = Field(0, ge=0)
    last_kernel_at: float | None = None
    # elastic memory (docs/elastic.md): `limit_bytes` is the guarantee; the burst limit above it
    # (0: a hard slice) and what the container uses beyond its guarantee (borrowed)
    burst_limit_bytes: int = Field(0, ge=0)
    borrowed_bytes: int = Field(0, ge=0)
    # elastic compute: `sm_limit` is the guarantee; the burst limit (0: a hard slice) and the
    # allowance the node agent's lender has in force (% of the GPU; above sm_limit = lent)
    sm_burst_limit: int = Field(0, ge=0, le=100)
    sm_allowance: float = Field(0.0, ge=0, le=100)


class ContainerUsage(Message):
    pod_uid: str
    namespace: str
    pod: str
    container: str
    devices: list[DeviceUsage]
    oom_count: int = 0
    # spill to host memory (docs/elastic.md): what the container's device allocations took of
    # host memory (all its GPUs; not in any device's used_bytes) and its bound (0: no spill)
    spilled_bytes: int = Field(0, ge=0)
    spill_limit_bytes: int = Field(0, ge=0)


class HostDeviceUsage(Message):
    uuid: str
    used_bytes: int = Field(0, ge=0)
    total_bytes: int = Field(0, ge=0)
    utilization: float = Field(0.0, ge=0)


class UsageSample(Message):
    node: str
    at: float = Field(default_factory=now)
    containers: list[ContainerUsage] = Field(default_factory=list)
    devices: list[HostDeviceUsage] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Events (stream TESSERA_EVENTS, subjects tessera.events.<family>.<scope>.<action>)


class Event(Message):
    """Common envelope fields of every event. `event_id` is the Nats-Msg-Id (dedupe key)."""

    SUBJECT: ClassVar[str] = "tessera.events.>"
    event_id: str = Field(
        default_factory=lambda: uuid.uuid4().hex,
        description="unique id, also the Nats-Msg-Id: a re-publish with the same id is dropped",
    )
    at: float = Field(default_factory=now, description="unix seconds when it happened")
    source: str = Field("", description="the service instance that published it")
    reason: str = Field("", description="why, in words a person can act on")


AllocAction = Literal["reserved", "bound", "allocated", "released", "failed", "mismatch"]
NodeAction = Literal["registered", "unhealthy", "lost", "configured", "config_refused"]
AdmissionAction = Literal["allowed", "denied", "mutated"]
QuotaAction = Literal["changed", "exceeded"]


class AllocationEvent(Event):
    """A pod's allocation changed state on a node."""

    SUBJECT: ClassVar[str] = "tessera.events.alloc.<node>.<action>"
    action: AllocAction
    node: str
    pod_uid: str
    namespace: str
    name: str
    containers: list[list[DeviceGrant]] = Field(default_factory=list)


class NodeEvent(Event):
    """A node registered or was lost, a GPU turned (un)healthy, or its device config changed."""

    SUBJECT: ClassVar[str] = "tessera.events.node.<node>.<action>"
    action: NodeAction
    node: str
    device_uuids: list[str] = Field(default_factory=list)


class AdmissionEvent(Event):
    """The webhook allowed, denied or mutated a pod."""

    SUBJECT: ClassVar[str] = "tessera.events.admission.<namespace>.<action>"
    action: AdmissionAction
    namespace: str
    name: str = ""
    pod_uid: str = ""
    never_placed: str = Field("", description="why the admitted pod can never be placed as "
                              "written (a misspelt GPU resource): it counts as pending")


class QuotaEvent(Event):
    """A namespace's quota limits changed, or a request would exceed them."""

    SUBJECT: ClassVar[str] = "tessera.events.quota.<namespace>.<action>"
    action: QuotaAction
    namespace: str
    limits: QuotaAmount = Field(default_factory=QuotaAmount)
    used: QuotaAmount = Field(default_factory=QuotaAmount)
    pod_uid: str = ""


class OomEvent(Event):
    """A container hit its memory limit (libvgpu refused an allocation)."""

    SUBJECT: ClassVar[str] = "tessera.events.oom.<node>"
    node: str
    pod_uid: str = ""
    namespace: str = ""
    pod: str = ""
    container: str = ""
    device_uuid: str = ""
    oom_count: int = 0


class SchedulingFailedEvent(Event):
    """The scheduler could not place a pod; `node_reasons` as HAMi reports them."""

    SUBJECT: ClassVar[str] = "tessera.events.sched.<namespace>.failed"
    namespace: str
    name: str
    pod_uid: str = ""
    node_reasons: dict[str, str] = Field(default_factory=dict)


RejectedKind = Literal["registration", "ledger", "quota", "limits", "event", "command"]


class ValueRejectedEvent(Event):
    """A bus value (registration, ledger, quota, limits request, event) failed validation."""

    SUBJECT: ClassVar[str] = "tessera.events.rejected.<kind>"
    kind: RejectedKind
    key: str = Field("", description="the KV key or subject the value came from")
    problem: str = Field("", description="machine-readable reason, e.g. memory_out_of_range")


MpsAction = Literal["started", "stopped"]


class MpsEvent(Event):
    """A node agent started (or adopted, after its own restart) or stopped the MPS control
    daemon of one container on a GPU in MPS mode (services/node-agent/mps.py), with the limits
    its server holds."""

    SUBJECT: ClassVar[str] = "tessera.events.mps.<node>.<action>"
    action: MpsAction
    node: str
    device_uuid: str
    daemon_pid: int = Field(0, ge=0, description="the control daemon's pid on the host")
    adopted: bool = Field(False, description="started: a daemon of an earlier run was adopted")
    pod: str = Field("", description="namespace/name of the pod whose container the daemon "
                     "serves (one daemon per container and MPS card)")
    container: str = ""
    memory_mib: int = Field(0, ge=0, description="the server's pinned device memory limit")
    thread_pct: int = Field(0, ge=0, le=100, description="the server's active thread %")


class LimitBreachedEvent(Event):
    """The node agent's watchdog saw a pod hold more of a GPU than its sealed limits, from
    outside the container (NVML's per-process memory and utilisation), for longer than the grace
    period; or saw its usage region claim less than the GPU shows (`breach` = `tampered`); or,
    at first sight, a process on a GPU the pod leases memory for with no lease connection
    (`unattested`: libvgpu bypassed), or the pod holding more than it leased (`unleased`).
    `action` says what the enforcement policy did: `observed` (event and metric only) or
    `killed` (the pod's processes on that GPU were ended)."""

    SUBJECT: ClassVar[str] = "tessera.events.limit.<node>.breached"
    node: str
    pod_uid: str
    namespace: str = ""
    pod: str = ""
    container: str = Field("", description="the pod's containers holding that GPU, comma-joined")
    device_uuid: str
    breach: Literal["memory", "compute", "tampered", "unattested", "unleased"]
    unit: Literal["bytes", "percent"] = Field(
        description="of limit / seen / region_claim: bytes (memory, tampered) or SM % (compute)"
    )
    limit: float = Field(description="the sealed limit (0 = unlimited)")
    seen: float = Field(description="what NVML shows (compute: the mean over the window)")
    region_claim: float | None = Field(
        None, description="what the container's usage region claims; null when unreadable"
    )
    since: float = Field(description="unix seconds when the condition began")
    policy: Literal["observe", "kill"] = "observe"
    action: Literal["observed", "killed"] = "observed"
    pids: list[int] = Field(default_factory=list, description="host pids on that GPU")


class PodGoneEvent(Event):
    """A pod the scheduler never placed was deleted: it leaves every pending list at once."""

    SUBJECT: ClassVar[str] = "tessera.events.sched.<namespace>.gone"
    namespace: str
    name: str
    pod_uid: str = ""


MigAction = Literal["created", "destroyed", "vanished"]


class MigEvent(Event):
    """Dynamic MIG on a node: the agent created a GPU + compute instance for a pod
    (`created`), destroyed one no allocation holds any more (`destroyed`), or found the instance
    of an allocation gone (`vanished`: after a reboot or someone's nvidia-smi)."""

    SUBJECT: ClassVar[str] = "tessera.events.mig.<node>.<action>"
    node: str
    action: MigAction
    device_uuid: str = Field(description="the GPU holding the instance")
    mig_uuid: str = Field("", description="the instance's MIG-… UUID (empty when not made)")
    profile: str = Field(description="GPU instance profile, e.g. 1g.10gb")
    start: int = Field(ge=0, description="first memory slice of its placement")
    pod_uid: str = ""


PreemptionAction = Literal["started", "done"]


class PreemptionEvent(Event):
    """GPU-aware priority preemption of a pod that fit no node. `started`: the pod is nominated on
    `node` (a reservation no other pod may take) and its victims are being evicted; `done`: the
    victims' GPU memory is back and the pod may be placed (`outcome` placed), or the nomination
    ended otherwise (`re-evaluated` past its deadline or refused by a PodDisruptionBudget,
    `pod-deleted`)."""

    SUBJECT: ClassVar[str] = "tessera.events.preemption.<namespace>.<action>"
    action: PreemptionAction
    namespace: str
    name: str
    pod_uid: str
    node: str
    priority: int = Field(0, description="the pod's spec.priority")
    victims: list[str] = Field(default_factory=list, description="namespace/name of each victim")
    victim_uids: list[str] = Field(default_factory=list)
    deadline: float | None = Field(None, description="unix seconds: re-evaluated if not done")
    outcome: Literal["", "placed", "re-evaluated", "pod-deleted"] = ""


MemoryAction = Literal["reclaimed", "evicted"]


class MemoryReclaimEvent(Event):
    """Elastic memory (docs/elastic.md): a guaranteed container needed memory that a borrower
    held beyond its own guarantee on the same GPU. `reclaimed`: the borrower's unused leases were
    recalled and its allocations beyond its guarantee are refused while the GPU is short;
    `evicted`: the node agent evicted the borrower's pod — it opted in to eviction
    (tessera.io/gpumem-reclaim: evict), or kept the memory past the node's grace bound
    (`by_node`)."""

    SUBJECT: ClassVar[str] = "tessera.events.memory.<node>.<action>"
    action: MemoryAction
    node: str
    device_uuid: str
    pod_uid: str = Field(description="the borrower")
    namespace: str = ""
    pod: str = ""
    container: str = ""
    borrowed_bytes: int = Field(0, ge=0, description="what it held beyond its guarantee")
    short_bytes: int = Field(0, ge=0, description="what the guaranteed request lacked")
    for_pod: str = Field("", description="namespace/name of the pod whose guarantee was due")
    by_node: bool = Field(
        False, description="evicted by the node's enforcement (TESSERA_MEMORY_RECLAIM_ENFORCEMENT"
        "=evict): the borrower kept the memory past the grace bound whatever its own policy",
    )


ComputeAction = Literal["reclaimed"]


class ComputeReclaimEvent(Event):
    """Elastic compute (docs/elastic.md): compute lent to a busy container beyond its guarantee
    was taken back because neighbours on the same GPU woke (the node agent lowered its
    allowance). Lending follows who is busy every 20 ms, so reclaims are coalesced: at most one
    event per container and GPU per window (`TESSERA_COMPUTE_RECLAIM_EVENT_WINDOW_S`, 60 s):
    the first reclaim at once, those that follow within the window in one summary at its end."""

    SUBJECT: ClassVar[str] = "tessera.events.compute.<node>.<action>"
    action: ComputeAction = "reclaimed"
    node: str
    device_uuid: str
    pod_uid: str = Field(description="the container that had been lent compute")
    namespace: str = ""
    pod: str = ""
    container: str = ""
    reclaims: int = Field(1, ge=1, description="how many times its allowance was lowered in "
                          "this event's window")
    max_taken_pct: float = Field(0, ge=0, le=100, description="the most lent compute taken "
                                 "back at once in the window, % of the GPU")
    allowance_pct: float = Field(0, ge=0, le=100, description="its allowance after the last "
                                 "reclaim of the window, % of the GPU")
    guarantee_pct: int = Field(0, ge=0, le=100, description="its guaranteed compute share")
    burst_limit_pct: int = Field(0, ge=0, le=100, description="its compute burst limit")
    for_pods: list[str] = Field(default_factory=list, description="namespace/name of the busy "
                                "neighbours the compute was taken back for")
    first_at: float = Field(0, description="unix seconds of the window's first reclaim")
    last_at: float = Field(0, description="unix seconds of the window's last reclaim")
    window_s: float = Field(0, ge=0, description="the coalescing window")


EVENT_TYPES: tuple[type[Event], ...] = (
    AllocationEvent,
    NodeEvent,
    AdmissionEvent,
    QuotaEvent,
    OomEvent,
    SchedulingFailedEvent,
    ValueRejectedEvent,
    LimitBreachedEvent,
    PodGoneEvent,
    MigEvent,
    MpsEvent,
    PreemptionEvent,
    MemoryReclaimEvent,
    ComputeReclaimEvent,
)


# ---------------------------------------------------------------------------------------------
# Request/reply bodies (NATS micro endpoints)


class QuotaShare(Message):
    """An amount a pod holds against its namespace quota (no limit: see QuotaAmount)."""

    memory_mib: int = Field(0, ge=0)
    cores: int = Field(0, ge=0)
    gpus: int = Field(0, ge=0)


class QuotaRequest(Message):
    """Body of tessera.quota.reserve / release. Charges as HAMi counts them (hami.quota_charge).

    reserve: `check_only` asks "would it fit?" without holding anything (admission); otherwise
    the charge is held under `pod_uid`, idempotently (the scheduler). release: frees `pod_uid`.

    Version 2 is a hand-on (`handed_from`): a quota service older than `handed_from_keeps` would
    read it as something else (the ended pod's charge freed whole, or not at all: the slice
    uncounted or counted twice) and so refuses version 2 (`CodecError`); the node agent's
    hand-on then waits, the slice counted once under the ended pod, until the quota service is
    upgraded (a mixed-version rollout). Every other request is written as version 1, which
    every quota service reads.
    """

    SCHEMA_VERSION: ClassVar[int] = 2
    READABLE_VERSIONS: ClassVar[frozenset[int]] = frozenset({1})

    namespace: str
    pod_uid: str = ""
    name: str = ""
    memory_mib: int = Field(0, ge=0)
    cores: int = Field(0, ge=0)
    gpus: int = Field(0, ge=0)
    check_only: bool = False
    handed_from: str = Field(
        "", description="reserve: the pod uid whose charge this pod takes over in the same write "
        "(a DRA claim shared by two pods of a node, handed on when the first ends)",
    )
    handed_from_keeps: QuotaShare | None = Field(
        None, description="reserve with handed_from: what that pod still holds after the "
        "hand-on (its other claims), its charge shrunk to it in the same write; None: it keeps "
        "nothing (its whole charge is freed)",
    )

    def wire_version(self) -> int:
        return 2 if self.handed_from or self.handed_from_keeps is not None else 1


class QuotaStatusRequest(Message):
    """Body of tessera.quota.status: one namespace, or every namespace when empty (in pages
    that fit one NATS message: services/quota/status_pages.py)."""

    namespace: str = ""
    after: str = Field("", max_length=253, description="every namespace: those after this one "
                       "(a reply's continue_after)")
    limit: int = Field(0, ge=0, description="every namespace: at most this many (0: as fit)")


class QuotaSetRequest(Message):
    """Body of tessera.quota.set (local stack / CLI): replace a namespace's limits atomically."""

    namespace: str
    limits: QuotaAmount
    source: str = "cli"
    override: bool = Field(
        False, description="replace limits that came from a ResourceQuota object (refused "
        "otherwise, naming the object)",
    )


class DeviceQuota(Message):
    """One DRA device key of a Kubernetes ResourceQuota (`<class>.deviceclass.resource.k8s.io/
    devices` and kin, tessera/dra_quota.py): counted and enforced by kube-apiserver, not by
    Tessera; shown beside Tessera's limits. `used` as the quota controller wrote it."""

    namespace: str
    quota: str = Field(description="the ResourceQuota's name")
    key: str
    hard: str
    used: str = ""


class QuotaReply(Message):
    """Reply of every quota endpoint. `ok` false carries a reason a person can act on."""

    ok: bool
    reason: str = ""
    states: list[QuotaState] = Field(default_factory=list)
    # status: the namespace's DRA device quotas, as the ResourceQuota objects say (DRA mode)
    device_quotas: list[DeviceQuota] = Field(default_factory=list)
    continue_after: str = Field("", description="status of every namespace: more follow; ask "
                                "again with `after` set to this")


class ExplainRequest(Message):
    """Body of tessera.scheduler.explain: why is this pod pending?"""

    namespace: str
    name: str = ""
    pod_uid: str = ""


class ExplainReply(Message):
    ok: bool
    pending: bool = False
    node: str = ""
    summary: str = ""
    node_reasons: dict[str, str] = Field(default_factory=dict)
    at: float | None = None


class LimitsSetRequest(Message):
    """Body of tessera.node.<node>.limits.set: change a running container's limits per GPU.

    A None value leaves that limit as it is. Memory in MiB, cores in %.
    """

    pod_uid: str = ""
    namespace: str = ""
    pod: str = ""
    container: str
    device_uuid: str = Field("", description="empty: every GPU of the container")
    memory_mib: int | None = Field(None, ge=0)
    cores: int | None = Field(None, ge=0, le=100)


class LimitsSetReply(Message):
    ok: bool
    reason: str = ""


class ErrorReply(Message):
    """What any endpoint answers to a request it cannot parse."""

    ok: bool = False
    reason: str


class RemoteError(Exception):
    """An endpoint answered with an ErrorReply; `reason` is its message."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


R = TypeVar("R", bound=Message)


def decode_reply(payload: bytes, model: type[R]) -> R:
    """A request/reply answer: `model`, or RemoteError when the endpoint sent an ErrorReply.
    CodecError (from tessera.codec) for anything else."""
    schema, _ = peek_schema(payload)
    if schema == ErrorReply.__name__:
        raise RemoteError(decode(payload, ErrorReply).reason)
    return decode(payload, model)


# ---------------------------------------------------------------------------------------------
# Per-node device configuration (ConfigMap tessera-node-config; tessera.node.<node>.config.*)

NODE_CONFIG_MAP = "tessera-node-config"
NODE_CONFIG_KEY = "config.json"
OperatingMode = Literal["hami-core", "mig", "mps"]
MigStrategyName = Literal["none", "single", "mixed", "dynamic"]


class DeviceFilter(BaseModel):
    """HAMi's `filterdevices`: GPUs this node does not offer, by UUID or by index."""

    model_config = ConfigDict(extra="forbid")
    uuid: list[str] = Field(default_factory=list, max_length=64)
    index: list[int] = Field(default_factory=list, max_length=64)

    @field_validator("index")
    @classmethod
    def _indices(cls, value: list[int]) -> list[int]:
        bad = [i for i in value if not 0 <= i < 64]
        if bad:
            raise ValueError(f"a GPU index is 0-63, not {bad[0]}")
        return value

    @field_validator("uuid")
    @classmethod
    def _uuids(cls, value: list[str]) -> list[str]:
        bad = [u for u in value if not u or len(u) > 128 or set(u) & set(",:;= \t\n")]
        if bad:
            raise ValueError(f"not a GPU UUID: {bad[0][:64]!r}")
        return value


class NodeDeviceConfig(BaseModel):
    """One entry of the ConfigMap, with HAMi's field names (its device-plugin `nodeconfig`).
    An absent field falls back to the `defaults` entry, then to the chart's settings."""

    model_config = ConfigDict(extra="forbid")
    devicesplitcount: int | None = Field(None, ge=1, le=1024, description="pods per GPU")
    devicememoryscaling: float | None = Field(
        None, gt=0, le=100, description="advertised memory = physical × this"
    )
    devicecorescaling: float | None = Field(
        None, gt=0, le=100, description="advertised compute = 100 × this"
    )
    operatingmode: OperatingMode | None = None
    migstrategy: MigStrategyName | None = Field(
        None, description="none | single | mixed (static MIG instances) | dynamic (per pod)"
    )
    filterdevices: DeviceFilter | None = None
    memoryreclaim: Literal["evict", "borrower"] | None = Field(
        None, description="elastic memory: evict borrowers that keep a due guarantee's memory "
        "past the grace bound whatever their policy (evict), or only those that opted in "
        "(borrower); TESSERA_MEMORY_RECLAIM_ENFORCEMENT (docs/elastic.md)",
    )

    def over(self, base: NodeDeviceConfig) -> NodeDeviceConfig:
        """This entry's fields where set, else `base`'s."""
        mine = self.model_dump(exclude_none=True)
        return base.model_copy(update={k: getattr(self, k) for k in mine})


class NodeConfigSetRequest(Message):
    """Body of tessera.node.<node>.config.set: the node's local entry (HAMi's field names),
    layered over the ConfigMap's. `reset` drops the local entry."""

    config: dict[str, Any] = Field(default_factory=dict)
    reset: bool = False


class NodeConfigStatus(Message):
    """What a node applies and why (reply of tessera.node.<node>.config.get and .set)."""

    ok: bool = True
    reason: str = ""
    node: str = ""
    effective: dict[str, Any] = Field(default_factory=dict)
    sources: list[str] = Field(default_factory=list, description="layers, lowest first")
    local: dict[str, Any] = Field(default_factory=dict, description="the entry set on the bus")
    refused: str = Field("", description="the last change refused, and why")
    pending: bool = Field(False, description="the ConfigMap's refused change is retried and "
                          "applied once it fits")
    refused_at: float | None = None
    applied_at: float | None = None
