"""Validation of values read from the bus, before any service applies them.

An authenticated client can still write nonsense (a bug, a stolen credential, a corrupt store):
a registration with capacity no GPU has, a ledger grant beyond its device, garbage bytes. Every
reader runs these pure checks on what it decodes; a value with a problem is rejected (not
applied) and reported through `Rejections` (a counter `tessera_bus_rejected_total{source,reason}`
and a `ValueRejectedEvent` on `tessera.events.rejected.<kind>`).

Checks return a `Problem` (a machine-readable code and a sentence) or None. No I/O here except
in `Rejections`, which publishes best effort.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter

from tessera.bus import publish_event
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    LimitsSetRequest,
    NodeLedger,
    NodeRegistration,
    QuotaAmount,
    QuotaState,
    RejectedKind,
    ValueRejectedEvent,
)
from tessera.settings import TesseraSettings

log = logging.getLogger("tessera.validation")

# Physical bounds of any GPU Tessera may meet (the largest shipping card has 288 GB).
MAX_GPU_MEMORY_MIB = 300 * 1024
MAX_DEVICES_PER_NODE = 64
MAX_NUMA_NODE = 63
MAX_LINK_SCORE = 100 * 18 + 60  # 18 NVLinks
MAX_NAME_CHARS = 253  # a Kubernetes object name
MAX_CONTAINERS = 256
# Memory of well-known NVIDIA models whose NVML name does not say it (MiB, largest variant).
KNOWN_MODEL_MIB = {
    "T4": 16384, "A2": 16384, "A10": 24576, "A10G": 24576, "A16": 16384, "A30": 24576,
    "A40": 49152, "L4": 24576, "L40": 49152, "L40S": 49152, "V100": 32768, "P100": 16384,
    "P4": 8192, "P40": 24576, "H100": 96 * 1024, "H200": 141 * 1024, "GH200": 144 * 1024,
    "B200": 192 * 1024,
}  # fmt: skip
_GB_IN_NAME = re.compile(r"(\d{1,4})\s*GB\b", re.IGNORECASE)
_NAME_TOLERANCE = 1.1  # NVML reports a little more than the marketing GB
# Preemption marks (Allocation.preempted_by / preempted_until) free a victim's capacity until the
# nomination's deadline: the victims' longest grace period (counted at most MAX_GRACE_S) plus
# TESSERA_PREEMPTION_MARGIN_S (at most MAX_PREEMPTION_MARGIN_S). A mark reaching further is forged.
MAX_GRACE_S = 86400
MAX_PREEMPTION_MARGIN_S = 3600
MAX_NOMINATION_S = MAX_GRACE_S + MAX_PREEMPTION_MARGIN_S
# Clocks of the writer and the reader (both the NATS server's, measured) may differ this much:
# a mark ending within it is judged lapsed, whatever it names.
MARK_SKEW_S = 5.0
# HAMi's annotation encodings use these as separators: a UUID carrying one would corrupt them.
_UUID_FORBIDDEN = set(",:;= \t\n")


@dataclass(frozen=True)
class Problem:
    """Why a value was rejected: `code` for metrics, `detail` for people."""

    code: str
    detail: str


@dataclass(frozen=True)
class Bounds:
    """What a well-formed value may hold, from the cluster-wide settings."""

    memory_scaling: float = 1.0
    core_scaling: float = 1.0
    max_split_count: int = 1024
    max_gpu_memory_mib: int = MAX_GPU_MEMORY_MIB
    max_devices: int = MAX_DEVICES_PER_NODE

    @classmethod
    def of(cls, settings: TesseraSettings) -> Bounds:
        return cls(
            memory_scaling=max(settings.device_memory_scaling,
                               settings.max_device_memory_scaling or 0),
            core_scaling=max(settings.device_core_scaling, settings.max_device_core_scaling or 0),
            max_split_count=max(settings.device_split_count, 1024),
        )

    @property
    def max_cores(self) -> int:
        return int(100 * self.core_scaling)

    @property
    def max_advertised_mib(self) -> int:
        return int(self.max_gpu_memory_mib * self.memory_scaling)


# --- node registrations -------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)  # pure; a cluster has a handful of GPU types
def model_memory_ceiling(device_type: str) -> int | None:
    """The most memory a card of this NVML type can have (MiB), when the name tells."""
    match = _GB_IN_NAME.search(device_type)
    if match:
        return int(int(match.group(1)) * 1024 * _NAME_TOLERANCE)
    tokens = re.split(r"[\s\-_]+", device_type.upper())
    known = [KNOWN_MODEL_MIB[t] for t in tokens if t in KNOWN_MODEL_MIB]
    return int(max(known) * _NAME_TOLERANCE) if known else None


def device_problem(device: DeviceInfo, bounds: Bounds) -> Problem | None:
    return _device_problem(device, bounds, _capacity_judge(bounds))


@functools.lru_cache(maxsize=16)
def _capacity_judge(bounds: Bounds) -> Callable[..., tuple[str, str] | None]:
    """`_capacity_problem` under these bounds, cached on the card's values alone: a
    registration's cards are judged without hashing the bounds (a Python-level hash) each."""

    @functools.lru_cache(maxsize=4096)
    def judge(*shape: object) -> tuple[str, str] | None:
        return _capacity_problem(*shape, bounds)  # type: ignore[arg-type]

    return judge


def _device_problem(
    device: DeviceInfo, bounds: Bounds, capacity: Callable[..., tuple[str, str] | None]
) -> Problem | None:
    uuid = device.uuid
    if not uuid or len(uuid) > 128 or not _UUID_FORBIDDEN.isdisjoint(uuid):
        return Problem("device_uuid", f"{_where(device)}: a UUID must be 1-128 chars without "
                       ", : ; =")  # fmt: skip
    if device.index >= bounds.max_devices:
        return Problem("device_index", f"{_where(device)}: index {device.index} out of range")
    problem = capacity(
        device.physical_memory_mib or device.memory_mib, device.memory_mib, device.type,
        device.cores, device.split_count, device.numa, device.mode,
    )  # fmt: skip
    if problem is not None:
        return Problem(problem[0], f"{_where(device)}: {problem[1]}")
    links = device.links
    if links and (len(links) > bounds.max_devices or any(
        not 0 <= score <= MAX_LINK_SCORE for score in links.values()
    )):  # fmt: skip
        return Problem("links_out_of_range", f"{_where(device)}: link scores out of range")
    return None


def _where(device: DeviceInfo) -> str:
    return f"GPU {device.uuid[:64]!r}"


@functools.lru_cache(maxsize=4096)  # pure; a cluster has a handful of GPU shapes
def _capacity_problem(
    physical: int, memory_mib: int, device_type: str, cores: int, split_count: int, numa: int,
    mode: str, bounds: Bounds,
) -> tuple[str, str] | None:
    """(code, detail) of what is wrong with a GPU's amounts, type and mode, if anything: the
    same for every card of one shape, so judged once per shape (40,000 cards at start-up)."""
    if not 0 < physical <= bounds.max_gpu_memory_mib:
        return ("memory_out_of_range", f"{physical} MiB of physical memory; no GPU has more "
                f"than {bounds.max_gpu_memory_mib} MiB")  # fmt: skip
    ceiling = model_memory_ceiling(device_type)
    if ceiling is not None and physical > ceiling:
        return ("memory_out_of_range",
                f"a {device_type} has at most {ceiling} MiB, not {physical} MiB")  # fmt: skip
    if memory_mib > physical * bounds.memory_scaling + 1:
        return ("memory_out_of_range", f"advertises {memory_mib} MiB, more than {physical} MiB "
                f"× memory scaling {bounds.memory_scaling}")  # fmt: skip
    if cores > bounds.max_cores:
        return ("cores_out_of_range",
                f"{cores} cores, more than {bounds.max_cores} (100 × core scaling)")
    if split_count > bounds.max_split_count:
        return ("split_count_out_of_range",
                f"split count {split_count} above {bounds.max_split_count}")
    if not 0 <= numa <= MAX_NUMA_NODE:
        return ("numa_out_of_range", f"NUMA node {numa}")
    if len(device_type) > 128 or len(mode) > 32:
        return ("device_type", "type or mode name too long")
    return None


def registration_problem(
    key: str, registration: NodeRegistration, bounds: Bounds
) -> Problem | None:
    """A node registration as the nodes KV holds it under `key`."""
    if registration.node != key or not key or len(key) > MAX_NAME_CHARS:
        return Problem(
            "key_mismatch", f"registration for node {registration.node!r} stored under {key!r}"
        )
    devices = registration.devices
    if len(devices) > bounds.max_devices:
        return Problem(
            "device_count",
            f"node {key}: {len(devices)} GPUs, more than {bounds.max_devices} per node",
        )
    if len({d.uuid for d in devices}) != len(devices):
        return Problem("device_uuid", f"node {key}: a GPU UUID appears twice")
    if len({d.index for d in devices}) != len(devices):
        return Problem("device_index", f"node {key}: a GPU index appears twice")
    capacity = _capacity_judge(bounds)
    for device in devices:
        problem = _device_problem(device, bounds, capacity)
        if problem is None and device.mig is not None:
            problem = mig_capability_problem(device)
        if problem is not None:
            return Problem(problem.code, f"node {key}: {problem.detail}")
    return None


# --- ledger entries -----------------------------------------------------------------------------


def ledger_problem(
    key: str, ledger: NodeLedger, registration: NodeRegistration | None, bounds: Bounds,
    now: float | None = None,
) -> Problem | None:
    """A node's ledger entry: keys match, every grant within its device, every preemption mark
    backed (`mark_problem`; its time checks need `now`, the reader's clock). On the scheduler's
    hot path (every ledger write of every replica): plain loops, details only on failure."""
    if ledger.node != key:
        return Problem("key_mismatch", f"ledger of node {ledger.node!r} stored under {key!r}")
    capacity = (
        {d.uuid: (d.memory_mib, d.cores) for d in registration.devices}
        if registration is not None
        else {}
    )
    default = (bounds.max_advertised_mib, bounds.max_cores)
    has_mig = False
    for uid, allocation in ledger.allocations.items():
        containers = allocation.containers
        if (
            uid != allocation.pod_uid
            or allocation.node != key
            or len(containers) > MAX_CONTAINERS
            or allocation.init_count > len(containers)
        ):
            return _allocation_problem(key, uid, allocation, None)
        for grants in containers:
            for grant in grants:
                memory, cores = capacity.get(grant.uuid, default)
                if grant.memory_mib > memory or grant.cores > cores:
                    return _allocation_problem(key, uid, allocation, grant, memory, cores)
                if (grant.memory_limit_mib and not (
                    grant.memory_mib < grant.memory_limit_mib <= max(memory, grant.memory_mib)
                )) or (grant.cores_limit and not grant.cores < grant.cores_limit <= 100):
                    who = f"node {key}: pod {allocation.namespace}/{allocation.name}"
                    return Problem("burst_out_of_range", f"{who}: burst limit of {grant.uuid} "
                                   "below its guarantee or above the card")  # fmt: skip
                has_mig = has_mig or grant.mig is not None
            if len(grants) > 1 and len({g.uuid for g in grants}) != len(grants):
                who = f"node {key}: pod {allocation.namespace}/{allocation.name}"
                return Problem("grant_duplicate", f"{who}: one container granted a GPU twice")
        if allocation.preempted_by or allocation.preempted_until is not None:
            problem = mark_problem(key, ledger, allocation, now)
            if problem is not None:
                return problem
    return mig_problem(key, ledger, registration, now) if has_mig else None


def mark_problem(
    key: str, ledger: NodeLedger, victim: Allocation, now: float | None
) -> Problem | None:
    """A victim's preemption mark. Only the scheduler's nomination sets one, in the same write
    as the nominee's reservation (preemption_ledger.nominate_mutate), and while it is in force
    the victim's capacity does not count: so a mark in force must name a `reserved` allocation
    of the same entry, itself unmarked, whose expiry (the nomination's deadline) the mark does
    not outlast, and it ends within MAX_NOMINATION_S. A lapsed mark (or one on an inactive
    allocation) frees nothing and names whatever it named. A node agent rewriting its own entry
    cannot free a running pod's capacity with a mark alone."""
    who = f"node {key}: pod {victim.namespace}/{victim.name}"
    until = victim.preempted_until
    if not victim.preempted_by or until is None or not math.isfinite(until):
        return Problem("preemption_mark", f"{who}: a preemption mark needs both the nominee "
                       "and a finite end")  # fmt: skip
    if victim.preempted_by == victim.pod_uid:
        return Problem("preemption_mark", f"{who}: marked as its own preemptor")
    if now is None or not victim.active or until <= now + MARK_SKEW_S:
        return None
    if until > now + MAX_NOMINATION_S:
        return Problem("preemption_mark_too_long", f"{who}: marked until {until:.0f}, more "
                       f"than {MAX_NOMINATION_S} s from now")  # fmt: skip
    nominee = ledger.allocations.get(victim.preempted_by)
    if (
        nominee is None
        or nominee.state != AllocationState.RESERVED
        or nominee.preempted_by
        or nominee.expires_at is None
        or until > nominee.expires_at
    ):
        return Problem("preemption_mark_unbacked", f"{who}: marked for {victim.preempted_by!r}, "
                       "which holds no reservation here lasting as long as the mark")  # fmt: skip
    return None


# --- dynamic MIG (tessera/mig.py) ---------------------------------------------------------------


def mig_capability_problem(device: DeviceInfo) -> Problem | None:
    """A card's dynamic-MIG capability: a model Tessera knows, matching the card's type, and
    geometries the model can hold."""
    from tessera import mig

    if device.mig is None:
        return None
    where = f"GPU {device.uuid[:64]!r}"
    model = mig.MODELS.get(device.mig.model)
    if model is None or mig.model_for(device.type) is not model:
        return Problem("mig_model", f"{where}: dynamic MIG model {device.mig.model[:64]!r} is "
                       f"not a MIG model of a {device.type[:64]}")  # fmt: skip
    if len(device.mig.geometries) > 64:
        return Problem("mig_geometry", f"{where}: more than 64 allowed geometries")
    try:
        mig.validate_geometries(model, device.mig.geometries)
    except mig.MigError as exc:
        return Problem("mig_geometry", f"{where}: {exc}")
    return None


def _holds_capacity(allocation: Allocation, at: float) -> bool:
    """As the scheduler counts it: active, not a lapsed reservation, not an eviction victim
    whose capacity a nominated pod holds meanwhile (its instance may be planned over)."""
    if not allocation.active:
        return False
    if allocation.preempted_by and allocation.preempted_until is not None and (
        at < allocation.preempted_until
    ):
        return False
    return not (allocation.state == "reserved" and allocation.expires_at is not None
                and allocation.expires_at <= at)  # fmt: skip


def mig_problem(
    key: str, ledger: NodeLedger, registration: NodeRegistration | None,
    at: float | None = None,
) -> Problem | None:
    """The dynamic MIG instances a node's ledger records: each a profile of its card's model
    (the registration's, else the model its type names), of that profile's size and charge,
    at a start the profile may take; on each card, the instances that hold capacity (`at`:
    now, by default) never overlap, fit its compute slices, stay inside its allowed geometries,
    and share the card with no libvgpu slice."""
    from tessera import mig
    from tessera.models import now

    at = now() if at is None else at
    devices = {d.uuid: d for d in registration.devices} if registration is not None else {}
    per_card: dict[str, tuple[mig.MigModel, list[mig.Instance]]] = {}
    slices: dict[str, int] = {}
    for allocation in ledger.allocations.values():
        holds = _holds_capacity(allocation, at)
        who = f"node {key}: pod {allocation.namespace}/{allocation.name}"
        for grants in allocation.containers:
            for grant in grants:
                if grant.mig is None:
                    slices[grant.uuid] = slices.get(grant.uuid, 0) + int(holds)
                    continue
                device = devices.get(grant.uuid)
                if device is not None and device.mig is not None:
                    model = mig.MODELS.get(device.mig.model)
                else:
                    model = mig.model_for(grant.type)
                if model is None:
                    return Problem("mig_model", f"{who}: a MIG instance on {grant.uuid}, which "
                                   "has no dynamic-MIG model")  # fmt: skip
                inst = grant.mig
                try:
                    profile = model.profile(inst.profile)
                except mig.MigError as exc:
                    return Problem("mig_profile", f"{who}: {exc}")
                if inst.size != profile.memory_slices or inst.start not in profile.starts:
                    return Problem("mig_placement", f"{who}: {profile.name} at slice "
                                   f"{inst.start} size {inst.size} is not a placement "
                                   f"{model.name} allows")  # fmt: skip
                if (grant.memory_mib, grant.cores) != (model.profile_memory_mib(profile),
                                                      model.profile_cores(profile)):
                    return Problem("mig_charge", f"{who}: {profile.name} charged "
                                   f"{grant.memory_mib} MiB / {grant.cores}%, not the "
                                   "profile's size")  # fmt: skip
                if holds:
                    card = per_card.setdefault(grant.uuid, (model, []))
                    card[1].append(mig.Instance(profile.name, inst.start))
    for uuid, (model, instances) in per_card.items():
        device = devices.get(uuid)
        if slices.get(uuid):
            return Problem("mig_mixed", f"node {key}: GPU {uuid} holds MIG instances and "
                           f"{slices[uuid]} libvgpu slice(s)")  # fmt: skip
        try:
            mig.occupied(model, instances)
        except mig.MigError as exc:
            return Problem("mig_overlap", f"node {key}: GPU {uuid}: {exc}")
        geometries = device.mig.geometries if device is not None and device.mig else None
        if not mig.within_geometries(instances, geometries):
            held = ", ".join(f"{i.profile}@{i.start}" for i in instances)
            return Problem("mig_geometry", f"node {key}: GPU {uuid}: instances {held} are "
                           "outside the card's allowed geometries")  # fmt: skip
    return None


def _allocation_problem(
    key: str, uid: str, allocation: Allocation, grant: DeviceGrant | None, memory: int = 0,
    cores: int = 0,
) -> Problem:
    who = f"node {key}: pod {allocation.namespace}/{allocation.name}"
    if grant is not None:
        return Problem(
            "grant_above_capacity",
            f"{who}: grant of {grant.memory_mib} MiB / {grant.cores}% on {grant.uuid}, which "
            f"has {memory} MiB / {cores}%",
        )
    if uid != allocation.pod_uid or allocation.node != key:
        return Problem("key_mismatch", f"{who}: filed under uid {uid!r} / node mismatch")
    return Problem("container_count", f"{who}: {len(allocation.containers)} containers, "
                   f"{allocation.init_count} init")  # fmt: skip


# --- quota records and requests -----------------------------------------------------------------


def _amount_problem(amount: QuotaAmount, what: str) -> Problem | None:
    for field_name in ("memory_mib", "cores", "gpus"):
        value = getattr(amount, field_name)
        if value is not None and not 0 <= value <= 2**53:
            return Problem("quota_out_of_range", f"{what}.{field_name} = {value}")
    return None


def quota_problem(key: str, state: QuotaState) -> Problem | None:
    """A namespace's quota record as the quota KV holds it."""
    if state.namespace != key:
        return Problem("key_mismatch", f"quota of {state.namespace!r} stored under {key!r}")
    problem = _amount_problem(state.limits, f"quota {key} limits")
    if problem is not None:
        return problem
    for uid, charge in state.charges.items():
        if uid != charge.pod_uid:
            return Problem(
                "key_mismatch", f"quota {key}: charge for {charge.pod_uid!r} under {uid!r}"
            )
        if charge.memory_mib > 2**40 or charge.cores > 2**31 or charge.gpus > 2**20:
            return Problem("quota_out_of_range", f"quota {key}: charge of pod {uid} is absurd")
    return None


def quota_salvage(key: str, state: QuotaState) -> QuotaState:
    """What can be kept of an invalid quota record: its namespace set to the key, out-of-range
    limits set to 0 (GPU use blocked until an operator sets them again: fail closed), bad
    charges dropped (the quota reconciler gives backed pods their charge back from the ledger)."""
    limits = state.limits.model_copy()
    for field_name in ("memory_mib", "cores", "gpus"):
        value = getattr(limits, field_name)
        if value is not None and not 0 <= value <= 2**53:
            setattr(limits, field_name, 0)
    charges = {
        uid: charge for uid, charge in state.charges.items()
        if uid == charge.pod_uid
        and charge.memory_mib <= 2**40 and charge.cores <= 2**31 and charge.gpus <= 2**20
    }  # fmt: skip
    return state.model_copy(update={"namespace": key, "limits": limits, "charges": charges})


def limits_problem(request: LimitsSetRequest, devices: Iterable[DeviceInfo]) -> Problem | None:
    """A limits.set request against the node's GPUs (the model already bounds cores to 0-100)."""
    by_uuid = {d.uuid: d for d in devices}
    if request.device_uuid and request.device_uuid not in by_uuid:
        return Problem("limits_unknown_device", f"no GPU {request.device_uuid!r} on this node")
    targets = [by_uuid[request.device_uuid]] if request.device_uuid else list(by_uuid.values())
    if request.memory_mib is not None:
        if request.memory_mib <= 0:
            return Problem("limits_out_of_range", "a memory limit must be at least 1 MiB")
        for device in targets:
            if request.memory_mib > device.memory_mib:
                return Problem(
                    "limits_out_of_range",
                    f"{request.memory_mib} MiB is more than GPU {device.uuid} has "
                    f"({device.memory_mib} MiB): not enough memory",
                )
    return None


# --- reporting ----------------------------------------------------------------------------------


class Rejections:
    """Counts and announces rejected values. One per service instance (own registry)."""

    def __init__(
        self,
        service: str,
        js: JetStreamContext | None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.service = service
        self.js = js
        self.counter = Counter(
            "tessera_bus_rejected_total",
            "Values read from the bus that failed validation and were not applied",
            ["source", "reason"],
            registry=registry,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self.seen: dict[tuple[str, str], Problem] = {}  # (kind, key) -> last problem

    def reject(self, kind: RejectedKind, key: str, problem: Problem, revision: int = 0) -> None:
        """Count, log and publish (best effort, deduplicated per key and revision)."""
        self.counter.labels(kind, problem.code).inc()
        self.seen[(kind, key)] = problem
        log.warning("bus value rejected", extra={
            "kind": kind, "key": key, "problem": problem.code, "detail": problem.detail,
        })  # fmt: skip
        if self.js is None:
            return
        event = ValueRejectedEvent(
            event_id=f"rejected:{kind}:{key}:{revision or problem.code}:{self.service}",
            kind=kind, key=key[:300], problem=problem.code, reason=problem.detail[:500],
            source=self.service,
        )  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._publish(event))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def accepted(self, kind: RejectedKind, key: str) -> None:
        self.seen.pop((kind, key), None)

    async def _publish(self, event: ValueRejectedEvent) -> None:
        assert self.js is not None
        with contextlib.suppress(Exception):
            await publish_event(self.js, event, attempts=3)

    async def drain(self, timeout: float = 2.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
