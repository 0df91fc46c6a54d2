"""Quota arithmetic: pure functions over QuotaState, no I/O.

Every function here is a `mutate` for `bus.cas_update` or feeds one: it gets the current state
(None when the namespace has no entry yet) and returns the new state, or raises NoChange /
QuotaRefused. The NATS side (services/quota/service.py) only reads, calls these and writes back
with a compare-and-set, so the same rules hold with any number of replicas.

Units: memory in MiB, cores in percent of one GPU (100 = a whole card), gpus a count.
A limit of None is unlimited; an explicit 0 blocks every request that asks for a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING

from tessera.quota import quota_units

from tessera.bus import NoChange
from tessera.hami import parse_quantity, quota_grants
from tessera.models import (
    Allocation,
    DeviceGrant,
    QuotaAmount,
    QuotaCharge,
    QuotaRequest,
    QuotaShare,
    QuotaState,
    QuotaUsage,
)

DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    # (field, HAMi resource word, unit shown to people)
    ("memory_mib", "gpumem", "MiB"),
    ("cores", "gpucores", "%"),
    ("gpus", "gpu", "GPUs"),
)

# Bounds that no real request or limit reaches; anything above is a mistake, not a quota.
MAX_MEMORY_MIB = 1 << 40
MAX_CORES = 100 * 1_000_000
MAX_GPUS = 1_000_000
_MAXIMA = {"memory_mib": MAX_MEMORY_MIB, "cores": MAX_CORES, "gpus": MAX_GPUS}

# Kubernetes namespace names are DNS-1123 labels.
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Pod uids are UUIDs; anything a KV key can hold after "<namespace>." is accepted.
_POD_UID = re.compile(r"^[-_=a-zA-Z0-9]{1,128}$")

RESOURCE_QUOTA_SOURCE = "resourcequota/"


class QuotaInputError(ValueError):
    """A request or limit that cannot be honoured as written (the caller gets an ErrorReply)."""


class QuotaRefused(Exception):
    """The request does not fit the namespace's quota; `reason` says which limit and by how much."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _copy(state: QuotaState) -> QuotaState:
    """A new state whose maps can be changed without touching `state` (charges themselves are
    never mutated, only replaced, so they are shared)."""
    return state.model_copy(update={
        "charges": dict(state.charges), "releasing": dict(state.releasing),
        "settled": state.settled.model_copy(),
    })  # fmt: skip


def add_usage(usage: QuotaUsage, charge: QuotaCharge, sign: int) -> None:
    """`usage` (in place) with `charge` added (sign +1) or taken out (-1), never below 0."""
    usage.memory_mib = max(0, usage.memory_mib + sign * charge.memory_mib)
    usage.cores = max(0, usage.cores + sign * charge.cores)
    usage.gpus = max(0, usage.gpus + sign * charge.gpus)
    usage.pods = max(0, usage.pods + sign)


def held_charge(
    state: QuotaState | None, pod_uid: str, own_settled: QuotaCharge | None
) -> QuotaCharge | None:
    """What the pod holds now: its journal entry, else its settled key (unless being released)."""
    if not pod_uid:
        return None
    if state is None:
        return own_settled
    if pod_uid in state.charges:
        return state.charges[pod_uid]
    if pod_uid in state.releasing:
        return None
    return own_settled


# --- validation -------------------------------------------------------------------------------


def check_namespace(namespace: object) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise QuotaInputError("namespace is required")
    if not _NAMESPACE.match(namespace):
        raise QuotaInputError(
            f"namespace {namespace!r} is not a valid Kubernetes namespace name "
            "(lowercase letters, digits and '-', at most 63 characters)"
        )
    return namespace


def check_request(request: QuotaRequest) -> None:
    """Reject what the model's own bounds let through: bad names and absurd quantities."""
    check_namespace(request.namespace)
    for field, word, unit in DIMENSIONS:
        value = getattr(request, field)
        if value > _MAXIMA[field]:
            raise QuotaInputError(
                f"{word} {value} {unit} is absurdly large (at most {_MAXIMA[field]})"
            )
    if len(request.pod_uid) > 128:
        raise QuotaInputError("pod_uid is longer than 128 characters")
    if request.pod_uid and not _POD_UID.match(request.pod_uid):
        raise QuotaInputError(
            "pod_uid must be 1-128 letters, digits, '-', '_' or '=' (a Kubernetes pod uid)"
        )
    if len(request.name) > 253:
        raise QuotaInputError("name is longer than 253 characters (not a Kubernetes pod name)")
    if request.handed_from and (len(request.handed_from) > 128
                                or not _POD_UID.match(request.handed_from)):  # fmt: skip
        raise QuotaInputError("handed_from must be a Kubernetes pod uid")
    if request.handed_from and (request.check_only or request.handed_from == request.pod_uid):
        raise QuotaInputError("handed_from names another pod, in a reservation (not check_only)")
    keeps = request.handed_from_keeps
    if keeps is not None and not request.handed_from:
        raise QuotaInputError("handed_from_keeps says what the pod named by handed_from keeps: "
                              "it needs handed_from")  # fmt: skip
    for field, word, unit in DIMENSIONS if keeps is not None else ():
        if getattr(keeps, field) > _MAXIMA[field]:
            raise QuotaInputError(f"handed_from_keeps: {word} {getattr(keeps, field)} {unit} is "
                                  f"absurdly large (at most {_MAXIMA[field]})")  # fmt: skip


def check_limits(limits: QuotaAmount) -> None:
    for field, word, unit in DIMENSIONS:
        value = getattr(limits, field)
        if value is None:
            continue
        if value < 0:
            raise QuotaInputError(f"limit {word} {value} {unit} is negative")
        if value > _MAXIMA[field]:
            raise QuotaInputError(
                f"limit {word} {value} {unit} is absurdly large (at most {_MAXIMA[field]})"
            )


# --- charges and fit --------------------------------------------------------------------------


def asks_gpu(amount: QuotaRequest | QuotaCharge) -> bool:
    return amount.gpus > 0 or amount.memory_mib > 0 or amount.cores > 0


def refusal(
    state: QuotaState | None, request: QuotaRequest, own_settled: QuotaCharge | None = None
) -> str | None:
    """Why `request` cannot fit on top of what the namespace already holds (None = it fits).

    A charge the same pod already holds (in the journal, or settled: `own_settled`) is not
    counted twice: a retried or resized reservation is checked as a replacement of the old one.
    """
    if state is None or not asks_gpu(request):
        return None
    own = held_charge(state, request.pod_uid, own_settled)
    used_now = state.used()
    reasons = []
    for field, word, unit in DIMENSIONS:
        limit = getattr(state.limits, field)
        if limit is None:
            continue
        if limit == 0:
            reasons.append(f"{word} limit is 0: GPU use is blocked in namespace {state.namespace}")
            continue
        used = (getattr(used_now, field) or 0) - (getattr(own, field) if own else 0)
        wanted = getattr(request, field)
        if used + wanted > limit:
            reasons.append(f"{word} {used} used + {wanted} requested > {limit} {unit} limit")
    if not reasons:
        return None
    return f"exceeding resource quota in namespace {state.namespace}: " + "; ".join(reasons)


def charge_of(request: QuotaRequest, at: float) -> QuotaCharge:
    return QuotaCharge(
        pod_uid=request.pod_uid,
        name=request.name,
        memory_mib=request.memory_mib,
        cores=request.cores,
        gpus=request.gpus,
        at=at,
        handed_from=request.handed_from,
    )


def same_amounts(a: QuotaCharge, b: QuotaCharge) -> bool:
    return (a.memory_mib, a.cores, a.gpus) == (b.memory_mib, b.cores, b.gpus)


def reserve(
    state: QuotaState | None, request: QuotaRequest, at: float,
    own_settled: QuotaCharge | None = None,
) -> QuotaState:  # fmt: skip
    """Hold `request` under its pod uid, in the journal. Idempotent: the same charge again is
    NoChange. `own_settled`: the pod's settled charge (its key), if it has one.

    Raises QuotaRefused when it does not fit (nothing is written), NoChange when the pod already
    holds exactly this charge or asks no GPU at all.
    """
    uid = request.pod_uid
    if not uid:
        raise QuotaInputError("a reservation needs pod_uid (use check_only to only ask)")
    current = held_charge(state, uid, own_settled)
    new_charge = charge_of(request, at)
    if current is not None and same_amounts(current, new_charge):
        raise NoChange
    if not asks_gpu(request) and current is None:
        raise NoChange
    # a charge that only shrinks gives back and is never refused (a namespace whose limit was
    # lowered below its use still sees a pod's freed claim leave its charge)
    shrinks = current is not None and all(
        getattr(new_charge, field) <= getattr(current, field) for field, _w, _u in DIMENSIONS)
    reason = None if shrinks else refusal(state, request, own_settled)
    if reason:
        raise QuotaRefused(reason)
    new_state = _copy(state) if state else QuotaState(namespace=request.namespace)
    settled = current is not None and uid not in new_state.charges
    if settled:  # a resize of a folded charge: out of the totals, back into the journal
        assert current is not None
        add_usage(new_state.settled, current, -1)
    if asks_gpu(request):
        new_state.charges[uid] = new_charge
    else:
        new_state.charges.pop(uid, None)
        if settled:
            new_state.releasing[uid] = current  # type: ignore[assignment]
    return new_state


def hand_on(
    state: QuotaState | None, request: QuotaRequest, at: float,
    own_settled: QuotaCharge | None, from_settled: QuotaCharge | None,
) -> QuotaState:  # fmt: skip
    """`request.handed_from`'s charge freed (shrunk to `request.handed_from_keeps` when that pod
    keeps other claims) and `request`'s held, in one state: the fit is judged without the part
    handed on, so a namespace at its limit can hand a slice on (never counted twice, never
    lost). QuotaRefused: nothing written; QuotaInputError: the pod would keep more than it
    holds. A retry finds both done: NoChange."""
    keeps = request.handed_from_keeps
    try:
        if keeps is not None and asks_gpu(keeps):
            freed = shrink(state, request.handed_from, keeps, at, from_settled)
        else:
            freed = release(state, request.handed_from, own_settled=from_settled)
    except NoChange:
        freed = state
    try:
        return reserve(freed, request, at, own_settled)
    except NoChange:
        if freed is state:
            raise
        return freed  # type: ignore[return-value]


def shrink(
    state: QuotaState | None, pod_uid: str, keeps: QuotaShare, at: float,
    own_settled: QuotaCharge | None,
) -> QuotaState:  # fmt: skip
    """`pod_uid`'s charge made `keeps`, with no limit check (it only gives back: a namespace
    over its limit, after the limit was lowered, still lets a pod's charge shrink). A settled
    charge moves back into the journal, as a resize does in `reserve`. NoChange when the pod
    holds nothing or exactly `keeps`; QuotaInputError when `keeps` is more than it holds in
    any dimension (a shrink never grows a charge past the limit check)."""
    current = held_charge(state, pod_uid, own_settled)
    if state is None or current is None:
        raise NoChange
    more = [f"{word} {getattr(keeps, field)} > {getattr(current, field)} {unit}"
            for field, word, unit in DIMENSIONS
            if getattr(keeps, field) > getattr(current, field)]  # fmt: skip
    if more:
        raise QuotaInputError(f"handed_from_keeps: pod {pod_uid} would keep more than it holds "
                              f"({'; '.join(more)})")  # fmt: skip
    kept = current.model_copy(update={"memory_mib": keeps.memory_mib, "cores": keeps.cores,
                                      "gpus": keeps.gpus, "at": at})  # fmt: skip
    if same_amounts(current, kept):
        raise NoChange
    new_state = _copy(state)
    if pod_uid not in new_state.charges:  # settled: out of the totals, back into the journal
        add_usage(new_state.settled, current, -1)
    new_state.charges[pod_uid] = kept
    return new_state


def release(
    state: QuotaState | None, pod_uid: str, *, charged_before: float | None = None,
    own_settled: QuotaCharge | None = None,
) -> QuotaState:  # fmt: skip
    """Free what `pod_uid` holds (journal entry or settled key). NoChange when it holds nothing.

    `charged_before`: only free a charge made at or before this time (a release event must not
    free a newer reservation of the same pod). A settled charge leaves the totals at once and
    waits in `releasing` until its key is deleted.
    """
    current = held_charge(state, pod_uid, own_settled)
    if state is None or current is None:
        raise NoChange
    if charged_before is not None and current.at > charged_before:
        raise NoChange
    new_state = _copy(state)
    if pod_uid in new_state.charges:
        del new_state.charges[pod_uid]
        if own_settled is not None:
            new_state.releasing[pod_uid] = own_settled  # a stale key from a resize
    else:
        add_usage(new_state.settled, current, -1)
        new_state.releasing[pod_uid] = current
    return new_state


def restore(state: QuotaState | None, namespace: str, charges: list[QuotaCharge]) -> QuotaState:
    """Give back charges found missing (quota state lost; pods still run): into the journal,
    with no limit check (the pods already hold the GPUs). NoChange when all are held."""
    new_state = _copy(state) if state else QuotaState(namespace=namespace)
    added = False
    for charge in charges:
        if charge.pod_uid not in new_state.charges and asks_gpu(charge):
            new_state.charges[charge.pod_uid] = charge
            new_state.releasing.pop(charge.pod_uid, None)
            added = True
    if not added:
        raise NoChange
    return new_state


def fold(state: QuotaState, folded: set[str], gone: set[str]) -> QuotaState:
    """Journal entries whose keys are written (`folded`) move into the totals; `gone`: released
    keys confirmed deleted. NoChange when neither applies."""
    if not (folded & set(state.charges)) and not (gone & set(state.releasing)):
        raise NoChange
    new_state = _copy(state)
    for uid in folded:
        charge = new_state.charges.pop(uid, None)
        if charge is not None:
            add_usage(new_state.settled, charge, +1)
            new_state.releasing.pop(uid, None)
    for uid in gone:
        if uid not in new_state.charges:
            new_state.releasing.pop(uid, None)
    return new_state


def recompute(state: QuotaState, keys: Mapping[str, QuotaCharge]) -> QuotaState:
    """The settled totals as the keys say (keys of pods in the journal or being released are
    not counted: they are counted there, or no longer). NoChange when they agree."""
    usage = QuotaUsage()
    for uid, charge in keys.items():
        if uid not in state.charges and uid not in state.releasing:
            add_usage(usage, charge, +1)
    if usage == state.settled:
        raise NoChange
    new_state = _copy(state)
    new_state.settled = usage
    return new_state


def full_view(state: QuotaState, keys: Mapping[str, QuotaCharge]) -> QuotaState:
    """Every charge the namespace holds in `charges` (settled keys and journal), no totals."""
    charges = {u: c for u, c in keys.items() if u not in state.releasing}
    charges.update(state.charges)
    return state.model_copy(
        update={"charges": charges, "settled": QuotaUsage(), "releasing": {}}
    )


def set_limits(
    state: QuotaState | None, namespace: str, limits: QuotaAmount, source: str
) -> QuotaState:
    """Replace the limits in one write (no moment without a limit). Charges stay as they are:
    pods already holding quota keep it even when the new limit is below their usage."""
    check_limits(limits)
    if state is not None and state.limits == limits and state.source == source:
        raise NoChange
    new_state = _copy(state) if state else QuotaState(namespace=namespace)
    new_state.limits = limits.model_copy()
    new_state.source = source
    return new_state


def over_limit(state: QuotaState) -> list[str]:
    """Dimensions where usage is above the limit (after a limit was lowered under running pods)."""
    used = state.used()
    out = []
    for field, word, _unit in DIMENSIONS:
        limit = getattr(state.limits, field)
        if limit is not None and getattr(used, field) > limit:
            out.append(word)
    return out


# --- ResourceQuota objects --------------------------------------------------------------------


@dataclass(frozen=True)
class ResourceQuotaKeys:
    """The `spec.hard` keys that carry GPU limits, derived from the configured resource names."""

    memory: tuple[str, ...]
    cores: tuple[str, ...]
    gpus: tuple[str, ...]
    unsupported: tuple[str, ...] = ()

    @classmethod
    def from_resource_names(
        cls, resource_name: str, resource_mem: str, resource_cores: str,
        resource_mem_percentage: str = "nvidia.com/gpumem-percentage",
    ) -> ResourceQuotaKeys:
        """Both the `limits.` and the `requests.` forms users write (they mean the same here)."""
        return cls(
            memory=(f"limits.{resource_mem}", f"requests.{resource_mem}"),
            cores=(f"limits.{resource_cores}", f"requests.{resource_cores}"),
            gpus=(f"limits.{resource_name}", f"requests.{resource_name}"),
            unsupported=(f"limits.{resource_mem_percentage}",
                         f"requests.{resource_mem_percentage}"),
        )


def quantity_value(value: object) -> int:
    """A Kubernetes quantity as a whole number, rounded up as Kubernetes' Value() does."""
    parsed = parse_quantity(value, "quota")
    return int(parsed.to_integral_value(rounding=ROUND_CEILING))


def limits_from_hard(
    hard: Mapping[str, object], keys: ResourceQuotaKeys
) -> tuple[QuotaAmount, list[str]]:
    """GPU limits from a ResourceQuota's `spec.hard`, plus a message per value it could not use.

    gpumem is in MiB as HAMi reads it (the quantity's plain value). When several keys give the
    same limit (limits.nvidia.com/gpu and requests.nvidia.com/gpu), the smallest wins.
    """
    values: dict[str, int | None] = {}
    problems: list[str] = [
        f"{name}: a percentage of each card is not a namespace total Tessera can enforce; the "
        f"namespace's GPU memory stays as the other keys set it (use {keys.memory[0]} in MiB, "
        "or bytes with a unit such as 160Gi)"
        for name in keys.unsupported if name in hard
    ]
    for field, names in (("memory_mib", keys.memory), ("cores", keys.cores), ("gpus", keys.gpus)):
        found: list[int] = []
        for name in names:
            if name not in hard:
                continue
            try:
                if field == "memory_mib":
                    value = quota_units.memory_mib(name, hard[name])
                else:
                    what = "percent of one GPU" if field == "cores" else "a number of GPUs"
                    value = quota_units.plain_count(name, hard[name], what)
            except ValueError as exc:
                problems.append(f"{exc}; not applied")
                continue
            if value > _MAXIMA[field]:
                problems.append(f"{name}: {hard[name]!r} is more than any cluster has (at most "
                                f"{_MAXIMA[field]}); not applied")
                continue
            if value < 0:
                problems.append(f"{name}: {hard[name]!r} is negative")
                continue
            found.append(value)
        values[field] = min(found) if found else None
    return QuotaAmount(**values), problems


def tightest(amounts: Iterable[QuotaAmount]) -> QuotaAmount:
    """Several ResourceQuota objects in one namespace all apply: the smallest limit wins."""
    merged: dict[str, int | None] = {"memory_mib": None, "cores": None, "gpus": None}
    for amount in amounts:
        for field in merged:
            value = getattr(amount, field)
            if value is not None:
                current = merged[field]
                merged[field] = value if current is None else min(current, value)
    return QuotaAmount(**merged)


def has_any_limit(amount: QuotaAmount) -> bool:
    return any(getattr(amount, f) is not None for f, _w, _u in DIMENSIONS)


# --- reconciliation against the ledger --------------------------------------------------------


def charge_from_allocation(alloc: Allocation) -> QuotaCharge:
    """What an allocation's grants add up to, counted as HAMi counts a pod: app containers summed
    over every GPU, init containers by max (they run one after the other, before the app). Only
    the grants of device families that count in the namespace quota (hami.quota_grants), as
    the scheduler charges them: an Ascend, MLU or DCU pod's devices are Kubernetes'
    ResourceQuota's to count, never NVIDIA memory and cores here."""
    counted = quota_grants(alloc.containers)
    if counted is not alloc.containers:
        alloc = alloc.model_copy(update={"containers": counted})

    def totals(containers: list[list[DeviceGrant]]) -> tuple[int, int, int]:
        return (
            sum(g.memory_mib for c in containers for g in c),
            sum(g.cores for c in containers for g in c),
            sum(len(c) for c in containers),
        )

    init = alloc.init_grants()
    app = totals(alloc.app_grants())
    peaks = [totals([c]) for c in init]
    memory, cores, gpus = (max([app[i], *(p[i] for p in peaks)]) for i in range(3))
    return QuotaCharge(
        pod_uid=alloc.pod_uid, name=alloc.name, memory_mib=memory, cores=cores, gpus=gpus,
        at=alloc.created_at,
    )


def reconcile(
    state: QuotaState | None,
    namespace: str,
    backed: Mapping[str, Allocation],
    now: float,
    grace_s: float,
) -> QuotaState:
    """Make the charges agree with the ledger.

    `backed`: this namespace's active allocations that hold quota (quota_held), by pod uid.
    - a charge without a backing allocation is dropped once it is older than `grace_s` (the
      scheduler reserves quota before it writes the ledger; a reservation never followed by an
      allocation, or whose allocation ended without a release reaching us, must not leak); a
      charge handed on (`handed_from`) is backed by the allocation it came from too;
    - a backed allocation without a charge gets one back (quota state lost or wiped), dated
      like the allocation so that it goes again at the next pass if the allocation ends.
    NoChange when nothing differs.
    """
    new_state = _copy(state) if state else QuotaState(namespace=namespace)
    changed = False
    for uid, charge in list(new_state.charges.items()):
        # a charge handed on from a DRA booking is backed by it until the node's driver moves
        # the booking in the ledger (a driver stopped between its two writes: at its start)
        handed = charge.handed_from and charge.handed_from in backed
        if uid not in backed and not handed and now - charge.at > grace_s:
            del new_state.charges[uid]
            changed = True
    for uid, alloc in backed.items():
        if uid not in new_state.charges:
            charge = charge_from_allocation(alloc)
            if asks_gpu(charge):
                new_state.charges[uid] = charge
                changed = True
    if not changed:
        raise NoChange
    return new_state


def limits_from_quotas(
    state: QuotaState | None, namespace: str, quotas: Mapping[str, QuotaAmount]
) -> QuotaState:
    """The namespace's limits after its ResourceQuota objects changed (`quotas`: the GPU limits
    of each object, by name). With none left, limits that came from ResourceQuotas become
    unlimited; limits set by hand (the CLI) are left alone."""
    if quotas:
        source = RESOURCE_QUOTA_SOURCE + ",".join(sorted(quotas))
        return set_limits(state, namespace, tightest(quotas.values()), source)
    if state is None or not state.source.startswith(RESOURCE_QUOTA_SOURCE):
        raise NoChange
    return set_limits(state, namespace, QuotaAmount(), "")
