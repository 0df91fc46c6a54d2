"""Fit a whole pod on one node: pick cards per container by policy, count refusal reasons. Pure.

Init containers are fitted each on its own against the node as it is; app containers together,
each seeing the cards the previous ones took; every container first gets the cards kubelet will
hand it from the pod's init containers (kubelet's device reuse). GPU policies order or select the
cards that pass every check; a comma chain applies its policies in order (the first ordering policy
is the main sort key, later ones break ties; `numa` and `topology-aware` then select among the
ordered cards).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tessera import elastic
from tessera.device_kinds import registry
from tessera.device_kinds.base import NO_SELECTION, Selection
from tessera.device_kinds.nvidia import SLICES
from tessera.hami import ContainerRequest, PodRequest
from tessera.models import DeviceGrant

from .cards import Card
from .rules import (
    CARDS_INSUFFICIENT,
    NUMA_NOT_FIT,
    FitContext,
    PodOptions,
    card_refusal,
    plain_applies,
    plain_card,
    relevant_checks,
)

# Exhaustive search of the best-linked card set is bounded; beyond it a greedy pick is used.
TOPOLOGY_EXHAUSTIVE_LIMIT = 5000


@dataclass
class PodFit:
    """The outcome on one node: grants per container (init first) or the refusal reasons."""

    ok: bool
    containers: list[list[DeviceGrant]] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    total_cards: int = 0
    details: dict[str, str] = field(default_factory=dict)  # reason -> a sentence (MIG)

    def reason_text(self) -> str:
        return format_reasons(self.reasons, self.total_cards, self.details)


def format_reasons(
    reasons: Counter[str], total_cards: int, details: dict[str, str] | None = None
) -> str:
    """HAMi's `N/M Reason, ...`, most frequent first; a reason with a sentence (dynamic MIG's)
    is followed by it in parentheses."""
    ordered = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    details = details or {}
    return ", ".join(
        f"{n}/{total_cards} {reason}" + (f" ({details[reason]})" if reason in details else "")
        for reason, n in ordered
    )


def device_score(card: Card, request: ContainerRequest, weights: tuple[int, int, int]) -> float:
    """HAMi: 10 × (wSlot·(1+used)/count + wCore·(req+used)/total + wMem·(req+used)/total)."""
    w_slot, w_core, w_mem = weights
    score = 0.0
    if card.split_count:
        score += w_slot * (1 + card.used_slots) / card.split_count
    if card.cores:
        score += w_core * (request.cores + card.used_cores) / card.cores
    if card.memory_mib:
        score += w_mem * (request.memory_on(card.memory_mib) + card.used_mem) / card.memory_mib
    return 10.0 * score


def _sort_key(
    request: ContainerRequest, options: PodOptions
) -> Callable[[Card], tuple[float, ...]]:
    """The ordering policies of the chain as one sort key (ties go by card index)."""
    signs = [
        -1.0 if policy == "binpack" else 1.0
        for policy in options.gpu_policies
        if policy in ("binpack", "spread")
    ]
    if len(signs) == 1:
        return _one_policy_key(request, options.weights, signs[0])

    def key(card: Card) -> tuple[float, ...]:
        score = device_score(card, request, options.weights) if signs else 0.0
        return (*(sign * score for sign in signs), card.index)

    return key


def _one_policy_key(
    request: ContainerRequest, weights: tuple[int, int, int], sign: float
) -> Callable[[Card], tuple[float, ...]]:
    """`_sort_key` of a chain with one ordering policy: `device_score` inlined, the same
    operations in the same order (so the same floats), read once per request, not per card."""
    w_slot, w_core, w_mem = weights
    cores, memory, percentage = request.cores, request.memory_mib, request.memory_percentage

    def key(card: Card) -> tuple[float, ...]:
        score = 0.0
        if card.split_count:
            score += w_slot * (1 + card.used_slots) / card.split_count
        if card.cores:
            score += w_core * (cores + card.used_cores) / card.cores
        total = card.memory_mib
        if total:
            asked = memory if percentage is None else total * percentage // 100
            score += w_mem * (asked + card.used_mem) / total
        return (sign * (10.0 * score), card.index)

    return key


def _best_group(
    groups: list[list[Card]], count: int, key: Callable[[Card], tuple[float, ...]]
) -> list[Card]:
    """The NUMA group whose best `count` cards rank best together under the policy key."""

    def group_key(group: list[Card]) -> tuple[float, ...]:
        keys = [key(c) for c in group[:count]]
        return tuple(sum(k[i] for k in keys) for i in range(len(keys[0])))

    return min(groups, key=group_key)


def _numa_groups(cards: list[Card]) -> list[list[Card]]:
    groups: dict[int, list[Card]] = {}
    for c in cards:
        groups.setdefault(c.numa, []).append(c)
    return list(groups.values())  # in order of each group's best card


def _link_sum(cards: tuple[Card, ...]) -> int:
    return sum(a.links.get(b.uuid, 0) for a, b in itertools.combinations(cards, 2))


def _topology_pick(cards: list[Card], count: int) -> list[Card]:
    if count == 1:
        # Take the card whose links matter least, keeping well-linked sets for bigger pods.
        return [min(cards, key=lambda c: sum(c.links.get(o.uuid, 0) for o in cards if o is not c))]
    combos = 1
    for i in range(count):
        combos = combos * (len(cards) - i) // (i + 1)
    if combos <= TOPOLOGY_EXHAUSTIVE_LIMIT:
        best = max(itertools.combinations(cards, count), key=_link_sum)
        return list(best)
    picked = [cards[0]]
    while len(picked) < count:
        rest = [c for c in cards if c not in picked]
        picked.append(max(rest, key=lambda c: sum(c.links.get(p.uuid, 0) for p in picked)))
    return picked


class _Plan:
    """What `pick_cards` works out from the request and the options alone (and whether the
    budget limits memory, cores): the same for every node a decision fits the pod on."""

    __slots__ = ("checks", "key", "min_only", "one_pass", "options", "plain", "quota_kinds",
                 "request", "sorted_pass")

    def __init__(self, request: ContainerRequest, ctx: FitContext, quota_kinds: int) -> None:
        options = ctx.options
        self.request, self.options, self.quota_kinds = request, options, quota_kinds
        self.checks = relevant_checks(request, ctx)
        self.plain = plain_applies(self.checks, options)  # `plain_card` clears a card for all
        self.key = _sort_key(request, options)
        policies = options.gpu_policies
        self.min_only = request.count == 1 and not options.numa_bind and (
            "numa" not in policies and "topology-aware" not in policies
        )
        ordering = [p for p in policies if p in ("binpack", "spread")]
        # (`_pick_in_one_pass`: the sign of the one ordering policy; None: not that case)
        self.one_pass = (-1.0 if ordering[0] == "binpack" else 1.0) if (
            self.min_only and self.plain and len(ordering) == 1
        ) else None  # fmt: skip
        # (the same for a container of several cards that only orders them:
        # no NUMA nor topology selection after the sort)
        self.sorted_pass = (-1.0 if ordering[0] == "binpack" else 1.0) if (
            request.count > 1 and self.plain and len(ordering) == 1 and not options.numa_bind
            and "numa" not in policies and "topology-aware" not in policies
        ) else None  # fmt: skip


# Plans of the requests fitted lately, by the identity of the request and options objects (held
# by the plan, so never mistaken for others): a decision asks for one request's on node after
# node, and pods of one workload share their request and options objects (`hami`'s remembered
# requests, `rules`' remembered options). Forgotten when full and when the device kinds change
# (`relevant_checks` reads which families count in the quota).
_plans: dict[tuple[int, int, int], _Plan] = {}
_PLANS = 1024
registry.on_change(_plans.clear)


def _plan(request: ContainerRequest, ctx: FitContext) -> _Plan:
    quota = ctx.quota
    options = ctx.options
    key = (id(request), id(options),
           (quota.memory_mib is None) + 2 * (quota.cores is None))  # fmt: skip
    plan = _plans.get(key)
    if plan is None or plan.request is not request or plan.options is not options:
        if len(_plans) >= _PLANS:
            _plans.clear()
        plan = _plans[key] = _Plan(request, ctx, key[2])
    return plan


def pick_cards(
    cards: list[Card], request: ContainerRequest, ctx: FitContext, reasons: Counter[str]
) -> list[Card] | None:
    """The cards for one container, or None with the reasons counted."""
    plan = _plan(request, ctx)
    if plan.one_pass is not None:
        return _pick_in_one_pass(cards, request, ctx, reasons, plan, plan.one_pass)
    if plan.sorted_pass is not None:
        return _pick_in_one_pass(cards, request, ctx, reasons, plan, plan.sorted_pass)
    passing: list[Card] = []
    local: dict[str, int] = {}
    checks = plan.checks
    plain = plan.plain
    for card in cards:
        if plain and plain_card(card, request):
            passing.append(card)
            continue
        reason = card_refusal(card, request, ctx, checks)
        if reason is None:
            passing.append(card)
        else:
            local[reason] = local.get(reason, 0) + 1
    count = request.count
    if len(passing) < count:
        reasons.update(local)
        if passing:
            reasons[CARDS_INSUFFICIENT] += len(passing)
        return None
    key = plan.key
    if plan.min_only:
        return [min(passing, key=key)]  # (sorted's first: the keys end with the card index)
    options = ctx.options
    ordered = sorted(passing, key=key)
    if options.numa_bind or "numa" in options.gpu_policies:
        groups = [g for g in _numa_groups(ordered) if len(g) >= count]
        if groups:
            ordered = _best_group(groups, count, key)
        elif options.numa_bind:
            reasons.update(local)
            reasons[NUMA_NOT_FIT] += len(passing)
            return None
    if "topology-aware" in options.gpu_policies:
        return _topology_pick(ordered, count)
    return ordered[:count]


def _pick_in_one_pass(
    cards: list[Card], request: ContainerRequest, ctx: FitContext, reasons: Counter[str],
    plan: _Plan, sign: float,
) -> list[Card] | None:
    """`pick_cards` of a container under one ordering policy (binpack or spread: `sign`) whose
    checks `plain_card` answers, with no NUMA nor topology selection (the common pod, one card
    or several): `plain_card` and the sort key (`_one_policy_key`) inlined in one pass over the
    cards, the passing ones ordered by (key, card index, position) (the order `sorted` gives
    them by `_one_policy_key`: it is stable, so equal keys stay in card order; one card: the
    first with the least key, as `min`), the refused counted as `pick_cards` counts them (in
    card order, then the passing ones as CardInsufficient when too few pass)."""
    count, family, cores = request.count, request.family, request.cores
    memory, percentage = request.memory_mib, request.memory_percentage
    w_slot, w_core, w_mem = plan.options.weights
    checks = plan.checks
    keyed: list[tuple[float, int, int, Card]] = []
    local: dict[str, int] | None = None
    for position, card in enumerate(cards):
        total = card.memory_mib
        asked = memory if percentage is None else total * percentage // 100
        used_slots, split = card.used_slots, card.split_count
        card_cores, used_cores = card.cores, card.used_cores
        if not (
            count <= card.plain and card.family == family and card.healthy
            and not card.cordoned and used_slots < split and asked <= total - card.used_mem
            and cores <= card_cores - used_cores and (cores < 100 or used_slots == 0)
            and (cores > 0 or not (card_cores > 0 and used_cores >= card_cores))
        ):  # (`plain_card`, inlined; when it does not clear the card, the checks decide)
            reason = card_refusal(card, request, ctx, checks)
            if reason is not None:
                if local is None:
                    local = {}
                local[reason] = local.get(reason, 0) + 1
                continue
        score = 0.0  # (`device_score`, as `_one_policy_key` computes it)
        if split:
            score += w_slot * (1 + used_slots) / split
        if card_cores:
            score += w_core * (cores + used_cores) / card_cores
        if total:
            score += w_mem * (asked + card.used_mem) / total
        keyed.append((sign * (10.0 * score), card.index, position, card))  # type: ignore[operator]
    if len(keyed) < count:
        if local:
            reasons.update(local)
        if keyed:
            reasons[CARDS_INSUFFICIENT] += len(keyed)
        return None
    if count == 1:
        return [min(keyed)[3]]  # (never compares two cards: the positions differ)
    keyed.sort()
    return [k[3] for k in keyed[:count]]


# A grant of the kind whose grant is the request's own amounts on the card (`_SLICE_GRANT`:
# NVIDIA's libvgpu slices, the card most pods take) is built here without pydantic's
# validation (`_amounts_grant`): the answer's grants are built on every placed call, and
# validating them cost more than the rest of the fit of a one-card pod. The values are the
# card's (a registration validated when it was read off the bus) and the request's (read and
# checked by `hami`); a value that is not a plain str or a non-negative int is built
# validated, as before (refused the same way).
_SLICE_GRANT = type(SLICES).grant
_new_object = object.__new__
_set_slot = object.__setattr__
# DeviceGrant's fields in their order, each at its default (the four set below are replaced).
# Any field added to the model without a plain default, or a validator that changes a value,
# must end the shortcut: checked at import (`_grant_template`) and by
# tests/scheduler/test_grant_trusted.py (equal models, identical wire bytes).
_AMOUNTS = ("uuid", "type", "memory_mib", "cores")


def _grant_template() -> dict[str, object] | None:
    """DeviceGrant's fields in order, the four amounts as None and the others at their
    (immutable) defaults; None when the model is not one this shortcut can build exactly."""
    template: dict[str, object] = {}
    for name, info in DeviceGrant.model_fields.items():
        if name in _AMOUNTS:
            # (checked below: a str, or an int of at least 0, and nothing more)
            plain = str if name in ("uuid", "type") else int
            if info.annotation is not plain or not all(
                plain is int and type(m).__name__ == "Ge" and getattr(m, "ge", None) == 0
                for m in info.metadata
            ):  # fmt: skip
                return None
            template[name] = None
        elif info.default_factory is not None or info.is_required() or (
            type(info.default) not in (type(None), bool, int, float, str)
        ):  # fmt: skip
            return None  # (not a plain, immutable default: build it validated)
        else:
            template[name] = info.default
    decorators = DeviceGrant.__pydantic_decorators__
    if not set(_AMOUNTS) <= set(template) or (
        DeviceGrant.model_config.get("extra") == "allow" or decorators.field_validators
        or decorators.model_validators or DeviceGrant.__pydantic_post_init__ is not None
        or DeviceGrant.__private_attributes__
    ):  # fmt: skip
        return None
    return template


_GRANT_TEMPLATE = _grant_template()


def _amounts_grant(card: Card, request: ContainerRequest) -> DeviceGrant:
    """`NvidiaSlices.grant` (the request's own memory and cores on the card), the model built
    from the trusted values without validation where they are plainly valid."""
    percentage = request.memory_percentage
    memory = request.memory_mib if percentage is None else card.memory_mib * percentage // 100
    cores, uuid, type_ = request.cores, card.uuid, card.type
    template = _GRANT_TEMPLATE
    if (
        template is None or type(memory) is not int or type(cores) is not int or memory < 0
        or cores < 0 or type(uuid) is not str or type(type_) is not str
    ):  # fmt: skip
        return DeviceGrant(uuid=uuid, type=type_, memory_mib=memory, cores=cores)
    values = template.copy()  # (the model's field order: its dump's order)
    values["uuid"] = uuid
    values["type"] = type_
    values["memory_mib"] = memory
    values["cores"] = cores
    grant = _new_object(DeviceGrant)
    _set_slot(grant, "__dict__", values)
    _set_slot(grant, "__pydantic_fields_set__", {"uuid", "type", "memory_mib", "cores"})
    _set_slot(grant, "__pydantic_extra__", None)
    _set_slot(grant, "__pydantic_private__", None)
    return grant


def _kind_grant(card: Card, request: ContainerRequest, selection: Selection) -> DeviceGrant:
    """The card's kind's grant for the request (`DeviceKind.grant`)."""
    kind = card.kind
    if type(kind).grant is _SLICE_GRANT:
        return _amounts_grant(card, request)
    return kind.grant(card, request, selection)


def _grant(card: Card, request: ContainerRequest, ctx: FitContext) -> DeviceGrant:
    """The card's kind's grant for the request, on the card as it is (read, not charged)."""
    options = ctx.options
    selection = options.selection_for(request.family) if options.selections else NO_SELECTION
    grant = _kind_grant(card, request, selection)
    if request.burst is not None:  # elastic: packed by the guarantee, the limit rides along
        mem_limit, cores_limit = elastic.burst_of_grant(request.burst, grant, card.memory_mib)
        grant = grant.model_copy(update={"memory_limit_mib": mem_limit,
                                         "cores_limit": cores_limit})  # fmt: skip
    return grant


def _take(card: Card, request: ContainerRequest, ctx: FitContext) -> DeviceGrant:
    """The card's kind's grant (the charge is the kind's: a MIG instance charges its
    profile's), charged on the card and the quota budget."""
    options = ctx.options
    selection = options.selection_for(request.family) if options.selections else NO_SELECTION
    grant = _kind_grant(card, request, selection)
    memory, cores = grant.memory_mib, grant.cores
    card.used_mem += memory
    card.used_cores += cores
    card.used_slots += 1
    if ctx.quota.memory_mib is not None:
        ctx.quota.memory_mib -= memory
    if ctx.quota.cores is not None:
        ctx.quota.cores -= cores
    if request.burst is not None:  # elastic: packed by the guarantee, the limit rides along
        mem_limit, cores_limit = elastic.burst_of_grant(request.burst, grant, card.memory_mib)
        grant = grant.model_copy(update={"memory_limit_mib": mem_limit,
                                         "cores_limit": cores_limit})  # fmt: skip
    card.hold(grant)
    return grant


def _pick_with_reuse(
    cards: list[Card], request: ContainerRequest, ctx: FitContext, reasons: Counter[str],
    pool: list[str],
) -> list[Card] | None:
    """kubelet's device manager gives a container the devices of the pod's finished init
    containers first (`pool`, see the kube-sim README), then new ones chosen through
    GetPreferredAllocation. So: all of the pool when it holds no more than the container asks,
    plus new cards picked by policy; when the pool holds more, kubelet takes any of them, so
    the container must fit every pool card (the agent follows kubelet's pick at Allocate)."""
    if not pool:
        return pick_cards(cards, request, ctx, reasons)
    by_uuid = {c.uuid: c for c in cards}
    reusable = [by_uuid[u] for u in pool if u in by_uuid]
    may_get = reusable if len(reusable) > request.count else reusable[: request.count]
    refused = [r for c in may_get if (r := card_refusal(c, request, ctx)) is not None]
    if refused:
        reasons.update(refused)
        return None
    reused = may_get[: request.count]
    if len(reused) == request.count:
        return reused
    rest = [c for c in cards if c not in reused]
    more = pick_cards(rest, replace(request, count=request.count - len(reused)), ctx, reasons)
    return None if more is None else reused + more


def _own(cards: list[Card], owned: set[int], card: Card) -> Card:
    """`card` as this fit's own copy in `cards` (cloned and put in its place the first time)."""
    if id(card) in owned:
        return card
    for i, c in enumerate(cards):
        if c is card:
            cards[i] = copy = card.clone()
            owned.add(id(copy))
            return copy
    raise AssertionError(f"{card.uuid} is not among the cards being fitted")


def fit_pod(cards: list[Card], request: PodRequest, ctx: FitContext) -> PodFit:
    """Place every container of the pod on this node's cards (the cards are not modified).

    Init containers run one at a time, so each is fitted against the node as it is; app
    containers together. Both follow kubelet's device reuse (`_pick_with_reuse`)."""
    if not request.init:
        return _fit_app(cards, request.containers, ctx)
    fit = PodFit(ok=False, total_cards=len(cards), details=ctx.details)
    grants: list[list[DeviceGrant]] = []
    budget = ctx.quota
    # The app's cards: native sidecars are taken here as they start (in init order), so each
    # later init container fits beside the sidecars already running, and the app containers
    # beside all of them (summed, never maxed). Every container follows kubelet's device reuse
    # (`_pick_with_reuse`): a finished init container's GPUs are handed on; a sidecar keeps its.
    # Copy-on-take: a card is cloned the first time a container takes it (`_own`); the others
    # are read as they are.
    scratch = list(cards)
    owned: set[int] = set()
    app_ctx = FitContext(ctx.options, type(budget)(budget.memory_mib, budget.cores), ctx.details)
    pool: list[str] = []  # GPUs of init containers kubelet hands on, in the order they came
    for index, r in enumerate(request.init):
        if r is None:
            grants.append([])
            continue
        if index in request.sidecars:
            picked = _pick_with_reuse(scratch, r, app_ctx, fit.reasons, pool)
            if picked is None:
                return fit
            grants.append([_take(_own(scratch, owned, c), r, app_ctx) for c in picked])
            taken = {c.uuid for c in picked}
            pool = [u for u in pool if u not in taken]  # a sidecar keeps its devices
            continue
        init_cards, init_owned = list(scratch), set[int]()
        init_ctx = FitContext(ctx.options, type(budget)(app_ctx.quota.memory_mib,
                                                        app_ctx.quota.cores), ctx.details)
        picked = _pick_with_reuse(init_cards, r, init_ctx, fit.reasons, pool)
        if picked is None:
            return fit
        grants.append([_take(_own(init_cards, init_owned, c), r, init_ctx) for c in picked])
        pool += [c.uuid for c in picked if c.uuid not in pool]
    # (the last container that asks for GPUs: nothing is fitted after it, so its cards are
    # read for its grants, not copied and charged: what it takes is never looked at again)
    last = max((i for i, r in enumerate(request.containers) if r is not None), default=-1)
    for i, r in enumerate(request.containers):
        if r is None:
            grants.append([])
            continue
        picked = _pick_with_reuse(scratch, r, app_ctx, fit.reasons, pool)
        if picked is None:
            return fit
        if i == last:
            grants.append([_grant(c, r, app_ctx) for c in picked])
            break
        grants.append([_take(_own(scratch, owned, c), r, app_ctx) for c in picked])
        pool = [u for u in pool if u not in {c.uuid for c in picked}]
    grants += [[] for _ in range(len(request.init) + len(request.containers) - len(grants))]
    fit.ok = True
    fit.containers = grants
    return fit


def _fit_app(
    cards: list[Card], containers: list[ContainerRequest | None], ctx: FitContext
) -> PodFit:
    """`fit_pod` of a pod without init containers (the common pod): no device reuse to follow
    (nothing hands GPUs on), and the cards and the budget are copied only when a container that
    is not the last to ask for GPUs takes some (a one-GPU-container pod's fit copies nothing)."""
    fit = PodFit(ok=False, total_cards=len(cards), details=ctx.details)
    last = len(containers) - 1
    while last >= 0 and containers[last] is None:
        last -= 1
    grants: list[list[DeviceGrant]] = []
    scratch, owned, app_ctx = cards, None, ctx
    for i in range(last + 1):
        r = containers[i]
        if r is None:
            grants.append([])
            continue
        picked = pick_cards(scratch, r, app_ctx, fit.reasons)
        if picked is None:
            return fit
        if i == last:
            grants.append([_grant(c, r, app_ctx) for c in picked])
            break
        if owned is None:  # (the first take: this fit's own cards and budget from here on)
            scratch, owned = list(cards), set()
            budget = ctx.quota
            app_ctx = FitContext(ctx.options, type(budget)(budget.memory_mib, budget.cores),
                                 ctx.details)  # fmt: skip
        grants.append([_take(_own(scratch, owned, c), r, app_ctx) for c in picked])
    grants += [[] for _ in range(len(containers) - len(grants))]
    fit.ok = True
    fit.containers = grants
    return fit
