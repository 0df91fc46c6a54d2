"""HAMi's per-GPU fit checks, one small pure function each, in HAMi's order (hami-compat.md).

A check answers "may this container's request go on this card?" with None (yes) or HAMi's reason
name. Adding a check is adding a function and a line in FIT_CHECKS. NUMA binding (check 4) and
"too few cards" depend on the set of cards picked, so they live in placement.py; cores above
100 (check 8) are clamped when the request is parsed (tessera.hami).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tessera import elastic, hami
from tessera.device_kinds import Selection, registry
from tessera.device_kinds.base import NO_SELECTION
from tessera.hami import ContainerRequest, RequestError
from tessera.settings import TesseraSettings

from .cards import Card

# HAMi's reason names.
CARD_NOT_HEALTH = "CardNotHealth"
CARD_CORDONED = "CardCordoned"
CARD_TYPE_MISMATCH = "CardTypeMismatch"
NUMA_NOT_FIT = "NumaNotFit"
CARD_UUID_MISMATCH = "CardUuidMismatch"
CARD_TIME_SLICING_EXHAUSTED = "CardTimeSlicingExhausted"
EXCLUSIVE_CONFLICT = "ExclusiveDeviceAllocateConflict"
RESOURCE_QUOTA_NOT_FIT = "ResourceQuotaNotFit"
CARD_INSUFFICIENT_MEMORY = "CardInsufficientMemory"
CARD_INSUFFICIENT_CORE = "CardInsufficientCore"
CARD_COMPUTE_UNITS_EXHAUSTED = "CardComputeUnitsExhausted"
CARD_MIG_INFEASIBLE = "CardMigTopologyInfeasible"  # NVIDIA's MIG kind's
CARDS_INSUFFICIENT = "AllocatedCardsInsufficientRequest"
# Node-level reasons of our own (HAMi has no registration outside node annotations).
NODE_UNREGISTERED = "NodeUnregistered"
# The pod's nodeSelector / required affinity / taints exclude the node (filter holds nothing).
NODE_CONSTRAINT = "NodeConstraintMismatch"
REQUEST_INVALID = "RequestInvalid"

# The family whose selection annotations are hami.ANN_USE_GPUTYPE & co (PodOptions' fields).
DEFAULT_FAMILY = ContainerRequest.__dataclass_fields__["family"].default
GPU_POLICIES = hami.GPU_SCHEDULER_POLICIES
NODE_POLICIES = hami.NODE_SCHEDULER_POLICIES


@dataclass(frozen=True)
class PodOptions:
    """The pod's placement knobs: annotations over cluster defaults."""

    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: frozenset[str] = frozenset()
    nouse_uuids: frozenset[str] = frozenset()
    numa_bind: bool = False
    vgpu_mode: str | None = None
    gpu_policies: tuple[str, ...] = ("spread",)
    node_policy: str = "binpack"
    weights: tuple[int, int, int] = (1, 1, 1)
    scrub_on_free: bool = False  # sealed into the containers' limits by the node agent
    # elastic memory (tessera/elastic.py): handed to the node agent's lease service
    memory_reclaim: str = "fail"
    memory_wait_s: float = 0.0
    # Per init container: restartPolicy Always (a sidecar keeps its devices; kubelet does not
    # hand them on to later containers).
    sidecar_init: tuple[bool, ...] = ()
    # family -> the pod's device selection for it (tessera.device_kinds); the fields above are
    # the default family's (NVIDIA's annotations) and are folded in here.
    selections: tuple[tuple[str, Selection], ...] = ()

    def __post_init__(self) -> None:
        if self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids or (
            self.vgpu_mode is not None
        ):
            own = Selection(self.use_types, self.nouse_types, self.use_uuids, self.nouse_uuids,
                            self.vgpu_mode or "")  # fmt: skip
            others = tuple(pair for pair in self.selections if pair[0] != DEFAULT_FAMILY)
            object.__setattr__(self, "selections", ((DEFAULT_FAMILY, own), *others))

    @property
    def mutex(self) -> bool:
        return "mutex" in self.gpu_policies

    def selection_for(self, family: str) -> Selection:
        """The pod's selection of devices of `family` (NO_SELECTION: any device)."""
        for name, selection in self.selections:
            if name == family:
                return selection
        return NO_SELECTION


@dataclass
class QuotaBudget:
    """What the namespace may still take (None = unlimited); decremented as cards are picked."""

    memory_mib: int | None = None
    cores: int | None = None


@dataclass
class FitContext:
    options: PodOptions
    quota: QuotaBudget = field(default_factory=QuotaBudget)
    # reason name -> the last sentence saying why (dynamic MIG refusals), shown after the
    # counts; shared by the copies fit_pod makes of the context
    details: dict[str, str] = field(default_factory=dict)


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_policy_chain(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    chain = tuple(p.lower() for p in _split(text))
    if not chain:
        raise RequestError(f"{what}: empty policy")
    for policy in chain:
        if policy not in allowed:
            raise RequestError(f"{what}: unknown policy {policy!r} (one of {', '.join(allowed)})")
    return chain


def _sidecars(pod: dict[str, Any]) -> tuple[bool, ...]:
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    inits = spec.get("initContainers") or []
    return tuple(
        isinstance(c, dict) and c.get("restartPolicy") == "Always"
        for c in (inits if isinstance(inits, list) else [])
    )


# Every annotation `parse_pod_options` reads, in the order it reads them.
_OPTION_ANNOTATIONS = (
    hami.ANN_GPU_POLICY, hami.ANN_NODE_POLICY, hami.ANN_SCORING_WEIGHTS, hami.ANN_VGPU_MODE,
    hami.ANN_USE_GPUTYPE, hami.ANN_NOUSE_GPUTYPE, hami.ANN_USE_GPUUUID, hami.ANN_NOUSE_GPUUUID,
    hami.ANN_NUMA_BIND, hami.ANN_SCRUB_ON_FREE, elastic.ANN_GPUMEM_RECLAIM, elastic.ANN_GPUMEM_WAIT,
)  # fmt: skip
# The other families' selection annotations (tessera.device_kinds), read after those.
_FAMILY_ANNOTATIONS = tuple(
    (family, family.selection_annotations())
    for family in registry.families() if family.name != DEFAULT_FAMILY
)
_OPTION_ANNOTATIONS = (*_OPTION_ANNOTATIONS,
                       *(key for _, keys in _FAMILY_ANNOTATIONS for key in keys))
_OPTION_KEYS = frozenset(_OPTION_ANNOTATIONS)
_TEXT_OR_NONE = frozenset({str, type(None)})


def parse_pod_options(pod: dict[str, Any], settings: TesseraSettings) -> PodOptions:
    """Read the user knobs; an invalid one is a RequestError with a sentence.

    The options are a function of those annotations' values, the defaults and the sidecar
    flags only; pods of one workload carry the same ones, so the result (immutable) is kept per
    distinct set of string values (`_remembered_options`) and each filter call reads ten keys."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {} if isinstance(meta, dict) else {}
    if not isinstance(annotations, dict):
        raise RequestError("metadata.annotations must be a map")
    if type(annotations) is dict:
        # (the few annotations a pod carries looked at, not every key it might carry: 41)
        given = tuple([(key, annotations[key]) for key in annotations if key in _OPTION_KEYS])
        if _TEXT_OR_NONE.issuperset([type(value) for _, value in given]):
            return _remembered_options(given, settings.gpu_scheduler_policy,
                                       settings.node_scheduler_policy, _sidecars(pod))  # fmt: skip
    values = tuple(map(annotations.get, _OPTION_ANNOTATIONS))
    args = (values, settings.gpu_scheduler_policy, settings.node_scheduler_policy, _sidecars(pod))
    if _TEXT_OR_NONE.issuperset(map(type, values)):  # (each value a str or None, exactly)
        return _remembered_options(tuple(zip(_OPTION_ANNOTATIONS, values, strict=True)),
                                   *args[1:])  # fmt: skip
    return _options(*args)  # a value of another type: refused as before, never remembered


def _options(
    values: tuple[Any, ...], gpu_default: str, node_default: str, sidecars: tuple[bool, ...]
) -> PodOptions:
    given = dict(zip(_OPTION_ANNOTATIONS, values, strict=True))

    def text(key: str) -> str | None:
        value = given[key]
        if value is None:
            return None
        if not isinstance(value, str):
            raise RequestError(f"annotation {key} must be a string")
        return value

    gpu_policy = text(hami.ANN_GPU_POLICY) or gpu_default
    node_policy = text(hami.ANN_NODE_POLICY) or node_default
    node_chain = parse_policy_chain(node_policy, NODE_POLICIES, hami.ANN_NODE_POLICY)
    if len(node_chain) != 1:
        raise RequestError(f"{hami.ANN_NODE_POLICY}: one of binpack, spread")
    weights_text = text(hami.ANN_SCORING_WEIGHTS)
    mode = text(hami.ANN_VGPU_MODE)
    reclaim, wait = text(elastic.ANN_GPUMEM_RECLAIM), text(elastic.ANN_GPUMEM_WAIT)
    if reclaim is not None or wait is not None:
        try:
            el = elastic.parse_elastic({k: v for k, v in ((elastic.ANN_GPUMEM_RECLAIM, reclaim),
                                       (elastic.ANN_GPUMEM_WAIT, wait)) if v is not None}, ())
        except elastic.ElasticError as exc:
            raise RequestError(str(exc)) from exc
    else:
        el = elastic.ElasticOptions()
    return PodOptions(
        use_types=tuple(t.lower() for t in _split(text(hami.ANN_USE_GPUTYPE) or "")),
        nouse_types=tuple(t.lower() for t in _split(text(hami.ANN_NOUSE_GPUTYPE) or "")),
        use_uuids=frozenset(_split(text(hami.ANN_USE_GPUUUID) or "")),
        nouse_uuids=frozenset(_split(text(hami.ANN_NOUSE_GPUUUID) or "")),
        numa_bind=(text(hami.ANN_NUMA_BIND) or "").strip().lower() == "true",
        vgpu_mode=mode.strip().lower() if mode and mode.strip() else None,
        gpu_policies=parse_policy_chain(gpu_policy, GPU_POLICIES, hami.ANN_GPU_POLICY),
        node_policy=node_chain[0],
        weights=hami.parse_scoring_weights(weights_text) if weights_text else (1, 1, 1),
        scrub_on_free=hami.parse_scrub_on_free(text(hami.ANN_SCRUB_ON_FREE)),
        memory_reclaim=el.reclaim,
        memory_wait_s=el.wait_s,
        sidecar_init=sidecars,
        selections=tuple(
            (family.name, family.selection({k: given[k] for k in keys}))
            for family, keys in _FAMILY_ANNOTATIONS if any(given[k] is not None for k in keys)
        ),
    )


def _options_given(
    given: tuple[tuple[str, Any], ...], gpu_default: str, node_default: str,
    sidecars: tuple[bool, ...],
) -> PodOptions:
    """`_options` of the option annotations given as (key, value) pairs (the others None)."""
    named = dict(given)
    return _options(tuple(map(named.get, _OPTION_ANNOTATIONS)), gpu_default, node_default,
                    sidecars)  # fmt: skip


# Kept per distinct set of (key, value) pairs given; a refusal (RequestError) is not
# remembered: lru_cache keeps results only.
_remembered_options = functools.lru_cache(maxsize=512)(_options_given)


# --- the checks, in HAMi's order ----------------------------------------------------------------

FitCheck = Callable[[Card, ContainerRequest, FitContext], "str | None"]
Applies = Callable[[ContainerRequest, FitContext], bool]
# check -> when it can refuse a card at all (for the request and options, whatever the card);
# a check without an entry may refuse any request. Set beside each check by `only_when`.
_ONLY_WHEN: dict[Callable[..., str | None], Applies] = {}


def only_when(applies: Applies) -> Callable[[FitCheck], FitCheck]:
    """The check never refuses a card unless `applies(request, ctx)`: `relevant_checks` leaves it
    out of a request it cannot refuse (the first failing check, so the reason, is the same)."""

    def register(check: FitCheck) -> FitCheck:
        _ONLY_WHEN[check] = applies
        return check

    return register


def check_health(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    """A card of the request's family (tessera.device_kinds; ours, before HAMi's check 1: any
    other is CardTypeMismatch), and healthy."""
    if card.family != request.family:
        return CARD_TYPE_MISMATCH
    return None if card.healthy else CARD_NOT_HEALTH


def check_cordon(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    return CARD_CORDONED if card.cordoned else None


@only_when(lambda request, ctx: request.count > 1 or bool(ctx.options.selections))
def check_type_and_mode(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    """The card's type and mode against the pod's selection, the kind's limit on cards per
    container (MPS: one). Without any selection only the limit is left (inlined)."""
    options = ctx.options
    if options.selections:
        return card.kind.selection_refusal(card, request, options.selection_for(request.family))
    limit = card.kind.max_devices_per_container
    return CARD_TYPE_MISMATCH if limit and request.count > limit else None


def _selects_uuids(request: ContainerRequest, ctx: FitContext) -> bool:
    if not ctx.options.selections:
        return False
    selection = ctx.options.selection_for(request.family)
    return bool(selection.use_uuids or selection.nouse_uuids)


@only_when(_selects_uuids)
def check_uuid_lists(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    return ctx.options.selection_for(request.family).uuid_refusal(card)


def check_slots(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    return CARD_TIME_SLICING_EXHAUSTED if card.used_slots >= card.split_count else None


@only_when(lambda request, ctx: ctx.options.mutex)
def check_mutex(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    return EXCLUSIVE_CONFLICT if ctx.options.mutex and not card.idle else None


@only_when(lambda request, ctx: (
    ctx.quota.memory_mib is not None or ctx.quota.cores is not None
) and registry.counts_in_quota(request.family))  # (other families: Kubernetes' ResourceQuota)
def check_quota(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    quota = ctx.quota
    if quota.memory_mib is not None and request.memory_on(card.memory_mib) > quota.memory_mib:
        return RESOURCE_QUOTA_NOT_FIT
    if quota.cores is not None and request.cores > quota.cores:
        return RESOURCE_QUOTA_NOT_FIT
    return None


def check_capacity(card: Card, request: ContainerRequest, ctx: FitContext) -> str | None:
    """HAMi's checks 11-15, the card's kind's: memory, cores, exclusive use, compute left, and
    what the kind adds (MIG: the instance, with a sentence saying why it does not fit). A kind
    whose fit is the generic one (`Card.plain`) is answered here inlined (the same checks as
    `DeviceKind.capacity_refusal`)."""
    if card.plain:
        if request.memory_on(card.memory_mib) > card.memory_mib - card.used_mem:
            return CARD_INSUFFICIENT_MEMORY
        cores = request.cores
        if cores > card.cores - card.used_cores:
            return CARD_INSUFFICIENT_CORE
        if cores >= 100 and card.used_slots:
            return EXCLUSIVE_CONFLICT
        if cores == 0 and card.cores > 0 and card.used_cores >= card.cores:
            return CARD_COMPUTE_UNITS_EXHAUSTED
        return None
    kind = card.kind
    options = ctx.options
    selection = options.selection_for(request.family) if options.selections else NO_SELECTION
    reason = kind.capacity_refusal(card, request, selection)
    if reason is not None and kind.explains:
        detail = kind.explain(card, request, selection)
        if detail:
            ctx.details[reason] = detail
    return reason


FIT_CHECKS: list[FitCheck] = [
    check_health,  # (the family, ours, then) 1
    check_cordon,  # 2
    check_type_and_mode,  # 3 (4, NUMA, is in placement.py)
    check_uuid_lists,  # 5
    check_slots,  # 6
    check_mutex,  # 7 (8, clamping cores, and 9, memory from %, are in the request)
    check_quota,  # 10
    check_capacity,  # 11-15: memory, cores, exclusive, compute units, MIG (the kind's)
]


# The checks `plain_card` answers for at once (check_type_and_mode only for a pod that selects
# no device type nor mode: `plain_applies`).
PLAIN_CHECKS = frozenset({
    check_health, check_cordon, check_type_and_mode, check_slots, check_capacity,
})  # fmt: skip


def plain_applies(checks: list[FitCheck], options: PodOptions) -> bool:
    """Whether `plain_card` may clear cards for these checks (`relevant_checks`)."""
    return PLAIN_CHECKS.issuperset(checks) and not (
        check_type_and_mode in checks and options.selections
    )


def plain_card(card: Card, request: ContainerRequest) -> bool:
    """True only when every check of PLAIN_CHECKS passes the card, for a pod that selects no
    device type nor mode (one call instead of six: most cards of a fit pass them all); False:
    ask the checks themselves (the reason). Cleared: a card of the request's family whose kind's
    fit is HAMi's generic one (`DeviceKind.plain`; `Card.plain` cards per container at most),
    healthy, uncordoned, with a slot, the memory and cores, idle if the request takes the whole
    card, still computing if it asks no cores. (`tests/scheduler/test_plain_card.py` compares it
    with the checks.)"""
    cores = request.cores
    used_cores = card.used_cores
    return (
        request.count <= card.plain and card.family == request.family
        and card.healthy and not card.cordoned and card.used_slots < card.split_count
        and request.memory_on(card.memory_mib) <= card.memory_mib - card.used_mem
        and cores <= card.cores - used_cores
        and (cores < 100 or card.used_slots == 0)
        and (cores > 0 or not (card.cores > 0 and used_cores >= card.cores))
    )  # fmt: skip


def relevant_checks(request: ContainerRequest, ctx: FitContext) -> list[FitCheck]:
    """FIT_CHECKS, in order, less those that cannot refuse this request (`only_when`)."""
    return [c for c in FIT_CHECKS if (a := _ONLY_WHEN.get(c)) is None or a(request, ctx)]


def card_refusal(
    card: Card, request: ContainerRequest, ctx: FitContext,
    checks: list[FitCheck] | None = None,
) -> str | None:
    """The first failing check's reason, or None when the card can take the request. `checks`:
    `relevant_checks(request, ctx)`, when the caller checks many cards."""
    for check in FIT_CHECKS if checks is None else checks:
        reason = check(card, request, ctx)
        if reason is not None:
            return reason
    return None
