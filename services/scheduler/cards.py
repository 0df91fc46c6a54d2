"""What the placement code sees of a node: its GPUs with their current usage. Pure, no I/O.

A node's usage is rebuilt from that node's own ledger entry only (O(allocations on the node)),
never from the cluster's pods. A pod's usage on a GPU is the larger of its init containers' peak
and its app containers' sum (they never run at the same time); once the init containers have
succeeded only the app containers count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tessera import mig
from tessera.device_kinds import DeviceKind, registry
from tessera.device_kinds.nvidia import SLICES
from tessera.models import (
    Allocation,
    AllocationState,
    DeviceGrant,
    DeviceInfo,
    NodeLedger,
    NodeRegistration,
)

_KIND_FIELDS: dict[str, tuple[DeviceKind, str, int]] = {}
registry.on_change(_KIND_FIELDS.clear)


def _kind_fields(mode: str) -> tuple[DeviceKind, str, int]:
    """(kind, family, plain) of a card in `mode` (kept per mode: the registry never changes
    the kind serving a mode once registered)."""
    fields = _KIND_FIELDS.get(mode)
    if fields is None:
        kind = registry.kind_for_mode(mode) or SLICES
        plain = (kind.max_devices_per_container or 1 << 30) if kind.plain else 0
        fields = (kind, kind.family.name, plain)
        if registry.kind_for_mode(mode) is not None:
            _KIND_FIELDS[mode] = fields
    return fields


class _HeldPartitions:
    """A card's `partitions`: what its grants hold, for kinds whose fit needs it
    (`DeviceKind.holds_partitions`: an Ascend chip's vNPU templates, for its AI CPUs). Set by
    `Card.hold` on those cards only and unset on every other (read it with
    `getattr(card, "partitions", ())`): building and copying NVIDIA's cards do nothing more."""

    __slots__ = ("partitions",)
    partitions: tuple[str, ...]


@dataclass(slots=True, init=False)
class Card(_HeldPartitions):
    """One GPU: static facts from the node agent plus what is in use (memory MiB, cores, slots)."""

    uuid: str
    index: int
    type: str
    mode: str
    numa: int
    healthy: bool
    cordoned: bool
    memory_mib: int
    cores: int
    split_count: int
    links: dict[str, int]
    used_mem: int
    used_cores: int
    used_slots: int
    # Dynamic MIG (DeviceInfo.mig): the card's model ("" = not a dynamic-MIG card), its allowed
    # geometries, the instances its allocations hold and how many libvgpu slices it holds (a
    # card never mixes the two: the MIG kind's fit).
    mig_model: str
    mig_geometries: tuple[dict[str, int], ...]
    mig_instances: list[mig.Instance]
    libvgpu_slices: int
    # The device kind serving the card (tessera.device_kinds, by its mode; a dynamic MIG card
    # is MIG's whatever its mode says; a mode no kind serves is read as libvgpu slices, as
    # registrations written before modes existed are), its family, and how many of its cards a
    # container may take for `rules.plain_card` to clear one (0: its kind's fit is not the
    # generic one: ask the kind).
    kind: DeviceKind
    family: str
    plain: int

    def __init__(
        self, uuid: str, index: int, type: str, mode: str, numa: int, healthy: bool,
        cordoned: bool, memory_mib: int, cores: int, split_count: int,
        links: dict[str, int] | None = None, used_mem: int = 0, used_cores: int = 0,
        used_slots: int = 0, mig_model: str = "", mig_geometries: tuple[dict[str, int], ...] = (),
        mig_instances: list[mig.Instance] | None = None, libvgpu_slices: int = 0,
        kind: DeviceKind | None = None, family: str = "", plain: int = 0,
    ) -> None:  # (written out: the generated one would call a __post_init__ on every copy)
        self.uuid = uuid
        self.index = index
        self.type = type
        self.mode = mode
        self.numa = numa
        self.healthy = healthy
        self.cordoned = cordoned
        self.memory_mib = memory_mib
        self.cores = cores
        self.split_count = split_count
        self.links = {} if links is None else links
        self.used_mem = used_mem
        self.used_cores = used_cores
        self.used_slots = used_slots
        self.mig_model = mig_model
        self.mig_geometries = mig_geometries
        self.mig_instances = [] if mig_instances is None else mig_instances
        self.libvgpu_slices = libvgpu_slices
        if kind is None:
            fields = _KIND_FIELDS.get("mig" if mig_model else mode)
            kind, family, plain = fields or _kind_fields("mig" if mig_model else mode)
        self.kind = kind
        self.family = family
        self.plain = plain

    @classmethod
    def from_device(cls, device: DeviceInfo, cordoned: bool = False) -> Card:
        # (positional: a node's cards are built on its first fit, eight keyword calls cost
        # twice as much)
        mig = device.mig
        return cls(device.uuid, device.index, device.type, device.mode, device.numa,
                   device.healthy, cordoned, device.memory_mib, device.cores, device.split_count,
                   device.links, 0, 0, 0, mig.model if mig else "",
                   tuple(mig.geometries) if mig else ())  # fmt: skip

    def clone(self) -> Card:
        copy = Card(
            self.uuid, self.index, self.type, self.mode, self.numa, self.healthy, self.cordoned,
            self.memory_mib, self.cores, self.split_count, self.links,
            self.used_mem, self.used_cores, self.used_slots,
            self.mig_model, self.mig_geometries, list(self.mig_instances), self.libvgpu_slices,
            self.kind, self.family, self.plain,
        )  # fmt: skip
        if not self.plain:
            copy.partitions = getattr(self, "partitions", ())
        return copy

    def hold(self, grant: DeviceGrant) -> None:
        """Count what `grant` occupies besides memory/cores/slots: its MIG instance, or one
        libvgpu slice. Only a dynamic MIG card keeps count: nothing else reads it, and the index
        (which keeps usage incrementally) then need not walk the allocations of other nodes."""
        if not self.mig_model:
            if not self.plain and self.kind.holds_partitions:
                self.partitions = (*getattr(self, "partitions", ()),
                                   self.kind.partition_of(self, grant))
            return
        if grant.mig is not None:
            self.mig_instances.append(mig.Instance(grant.mig.profile, grant.mig.start))
        else:
            self.libvgpu_slices += 1

    @property
    def free_mem(self) -> int:
        return self.memory_mib - self.used_mem

    @property
    def free_cores(self) -> int:
        return self.cores - self.used_cores

    @property
    def idle(self) -> bool:
        return self.used_slots == 0


@dataclass(frozen=True, slots=True)
class Usage:
    """What a pod holds on one GPU."""

    memory_mib: int = 0
    cores: int = 0
    slots: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.memory_mib + other.memory_mib, self.cores + other.cores, self.slots + other.slots
        )

    def peak(self, other: Usage) -> Usage:
        return Usage(
            max(self.memory_mib, other.memory_mib),
            max(self.cores, other.cores),
            max(self.slots, other.slots),
        )


def allocation_usage(allocation: Allocation) -> dict[str, Usage]:
    """What one pod holds on each GPU (init peak vs app sum, shrunk once init is done)."""
    app: dict[str, Usage] = {}
    for grants in allocation.app_grants():
        for g in grants:
            app[g.uuid] = app.get(g.uuid, Usage()) + Usage(g.memory_mib, g.cores, 1)
    if allocation.init_done or allocation.init_count == 0:
        return app
    usage = dict(app)
    for grants in allocation.init_grants():
        per_init: dict[str, Usage] = {}
        for g in grants:
            per_init[g.uuid] = per_init.get(g.uuid, Usage()) + Usage(g.memory_mib, g.cores, 1)
        for uuid, u in per_init.items():
            usage[uuid] = usage.get(uuid, Usage()).peak(u)
    return usage


def counts_against_capacity(allocation: Allocation, now: float) -> bool:
    """Active allocations hold capacity; a reservation past its expiry no longer does, nor does
    a pod being evicted for a nominated pod until that nomination's deadline (the nominee's
    reservation holds its capacity meanwhile: see preemption_ledger.py)."""
    if not allocation.active:
        return False
    if allocation.preempted_by and allocation.preempted_until is not None and (
        now < allocation.preempted_until
    ):
        return False
    return not (
        allocation.state == AllocationState.RESERVED
        and allocation.expires_at is not None
        and allocation.expires_at <= now
    )


def time_sensitive(allocation: Allocation, now: float) -> bool:
    """Whether what the allocation holds changes, or may have changed, with time alone."""
    return bool(allocation.preempted_by) or (
        allocation.state == AllocationState.RESERVED
        and allocation.expires_at is not None
        and allocation.expires_at <= now
    )


Charge = tuple[str, int, int, int]  # (GPU UUID, memory MiB, cores, slots) one pod holds there


def charges(allocation: Allocation) -> list[Charge]:
    """What one pod holds on each GPU, when it counts at all (`allocation_usage`, flattened;
    a GPU may appear more than once: the amounts add up)."""
    if allocation.init_count == 0 or allocation.init_done:
        # The common case, inlined (this runs on every ledger change of the node).
        app = allocation.containers if allocation.init_count == 0 else allocation.app_grants()
        return [(g.uuid, g.memory_mib, g.cores, 1) for grants in app for g in grants]
    return [(uuid, u.memory_mib, u.cores, u.slots)
            for uuid, u in allocation_usage(allocation).items()]  # fmt: skip


def add_charges(usage: dict[str, list[int]], items: Iterable[Charge], sign: int = 1) -> None:
    """Add (or with sign -1 take back) charges to a GPU UUID -> [memory, cores, slots] map."""
    for uuid, memory, cores, slots in items:
        used = usage.get(uuid)
        if used is None:
            used = usage[uuid] = [0, 0, 0]
        used[0] += sign * memory
        used[1] += sign * cores
        used[2] += sign * slots


def cards_with_usage(
    registration: NodeRegistration,
    usages: Iterable[dict[str, list[int]]],
    cordoned: frozenset[str] = frozenset(),
) -> list[Card]:
    """The node's GPUs charged with the given usage maps (summed).

    A node's cards are built from its devices on its first fit (at 20,000 nodes, on about half
    of the placed calls): a card that is not a dynamic MIG one is made here field by field,
    as `Card.from_device` makes it (`tests/scheduler/test_cards_fresh.py` compares every
    field), without the call of `Card.__init__` with 21 arguments and its defaults' checks:
    ~30 % of the build."""
    cards: list[Card] = []
    append = cards.append
    fields_of = _KIND_FIELDS.get
    new = _new_object
    for d in registration.devices:
        if d.mig is not None:
            append(Card.from_device(d, d.uuid in cordoned))
            continue
        mode = d.mode
        kind, family, plain = fields_of(mode) or _kind_fields(mode)
        card = new(Card)
        card.uuid = uuid = d.uuid
        card.index = d.index
        card.type = d.type
        card.mode = mode
        card.numa = d.numa
        card.healthy = d.healthy
        card.cordoned = uuid in cordoned
        card.memory_mib = d.memory_mib
        card.cores = d.cores
        card.split_count = d.split_count
        links = d.links
        card.links = {} if links is None else links
        card.used_mem = card.used_cores = card.used_slots = 0
        card.mig_model = ""
        card.mig_geometries = ()
        card.mig_instances = []
        card.libvgpu_slices = 0
        card.kind = kind
        card.family = family
        card.plain = plain
        append(card)
    return _charged(cards, usages)


_new_object = object.__new__


def recharged(like: list[Card], usages: Sequence[dict[str, list[int]]]) -> list[Card]:
    """`cards_with_usage` of the registration and cordon `like` was built from (by it or by
    this), without reading the devices again: `like`'s static facts (a fresh card's MIG
    holdings: none) charged with the usage maps. A node's cards are built again after every
    change to its row; reading eight pydantic devices cost 5x copying eight cards. With one
    usage map (a node without HAMi's pods), a card whose usage did not change is `like`'s own:
    a card of the generic kind (`Card.plain`) is never changed once built (fits copy the cards
    they take; only a dynamic MIG or partition card holds anything more), so a write that
    charges one card makes one new card, not eight."""
    if len(usages) == 1:
        usage = usages[0]
        cards = []
        for c in like:
            used = usage.get(c.uuid)
            memory, cores, slots = _NOTHING if used is None else used
            if c.plain and c.used_mem == memory and c.used_cores == cores and (
                c.used_slots == slots
            ):
                cards.append(c)
                continue
            cards.append(Card(c.uuid, c.index, c.type, c.mode, c.numa, c.healthy, c.cordoned,
                              c.memory_mib, c.cores, c.split_count, c.links, memory, cores, slots,
                              c.mig_model, c.mig_geometries, [], 0, c.kind, c.family, c.plain))
        return cards
    return _charged([
        Card(c.uuid, c.index, c.type, c.mode, c.numa, c.healthy, c.cordoned, c.memory_mib,
             c.cores, c.split_count, c.links, 0, 0, 0, c.mig_model, c.mig_geometries, [], 0,
             c.kind, c.family, c.plain)
        for c in like
    ], usages)  # fmt: skip


_NOTHING = (0, 0, 0)


def _charged(cards: list[Card], usages: Iterable[dict[str, list[int]]]) -> list[Card]:
    by_uuid = {c.uuid: c for c in cards}
    for usage in usages:
        for uuid, (memory, cores, slots) in usage.items():
            card = by_uuid.get(uuid)
            if card is not None:  # a GPU gone from the registration: nothing to charge
                card.used_mem += memory
                card.used_cores += cores
                card.used_slots += slots
    return cards


def holds_partitions(mode: str) -> bool:
    """Whether cards in `mode` keep their grants' partitions (the index then counts them as it
    does dynamic MIG cards' instances)."""
    return _kind_fields(mode)[0].holds_partitions


def hold_grants(cards: list[Card], allocations: Iterable[Allocation], now: float) -> None:
    """Count on `cards` what the counting allocations occupy besides memory/cores/slots: MIG
    instances and libvgpu slices, as build_cards does while it charges (the index keeps usage
    incrementally and asks for this only on nodes with dynamic MIG cards)."""
    by_uuid = {c.uuid: c for c in cards}
    for allocation in allocations:
        if not counts_against_capacity(allocation, now):
            continue
        if allocation.init_count == 0 or allocation.init_done:
            app = allocation.containers if allocation.init_count == 0 else allocation.app_grants()
        else:
            app = allocation.containers  # every instance exists until the pod's release
        for grants in app:
            for g in grants:
                card = by_uuid.get(g.uuid)
                if card is not None:
                    card.hold(g)


def build_cards(
    registration: NodeRegistration,
    allocations: Iterable[Allocation],
    now: float,
    cordoned: frozenset[str] = frozenset(),
) -> list[Card]:
    """The node's GPUs with the usage of every allocation that still holds capacity."""
    cards = [Card.from_device(d, d.uuid in cordoned) for d in registration.devices]
    by_uuid = {c.uuid: c for c in cards}
    for allocation in allocations:
        if not counts_against_capacity(allocation, now):
            continue
        if allocation.init_count == 0 or allocation.init_done:
            # The common case, inlined (this loop runs on every ledger change of the node).
            app = allocation.containers if allocation.init_count == 0 else allocation.app_grants()
            for grants in app:
                for g in grants:
                    card = by_uuid.get(g.uuid)
                    if card is not None:
                        card.used_mem += g.memory_mib
                        card.used_cores += g.cores
                        card.used_slots += 1
                        card.hold(g)
            continue
        for uuid, u in allocation_usage(allocation).items():
            card = by_uuid.get(uuid)
            if card is None:
                continue  # the GPU vanished from the registration; nothing to charge
            card.used_mem += u.memory_mib
            card.used_cores += u.cores
            card.used_slots += u.slots
        for grants in allocation.containers:  # every instance exists until the pod's release
            for g in grants:
                card = by_uuid.get(g.uuid)
                if card is not None:
                    card.hold(g)
    return cards


def status_changes_at(allocation: Allocation, now: float) -> float | None:
    """When `counts_against_capacity(allocation, t)` next changes for t >= now (None: never,
    as long as the allocation itself does not change)."""
    if not allocation.active:
        return None
    when = None
    if allocation.preempted_by and allocation.preempted_until is not None and (
        now < allocation.preempted_until
    ):
        when = allocation.preempted_until
    if allocation.state == AllocationState.RESERVED and allocation.expires_at is not None and (
        allocation.expires_at > now
    ):
        when = allocation.expires_at if when is None else min(when, allocation.expires_at)
    return when


def ledger_cards(
    registration: NodeRegistration,
    ledger: NodeLedger | None,
    now: float,
    cordoned: frozenset[str] = frozenset(),
) -> list[Card]:
    return build_cards(registration, ledger.allocations.values() if ledger else (), now, cordoned)


def node_score(cards: list[Card]) -> float:
    """HAMi's node score on the state before the pod: 10 × (slots + cores + memory ratios)."""
    count = sum(c.split_count for c in cards)
    cores = sum(c.cores for c in cards)
    memory = sum(c.memory_mib for c in cards)
    if not cards:
        return 0.0
    score = 0.0
    if count:
        score += sum(c.used_slots for c in cards) / count
    if cores:
        score += sum(c.used_cores for c in cards) / cores
    if memory:
        score += sum(c.used_mem for c in cards) / memory
    return 10.0 * score


def over_capacity(cards: list[Card]) -> list[str]:
    """Descriptions of every GPU granted beyond capacity (the invariant tests check this)."""
    problems = []
    for c in cards:
        if c.used_mem > c.memory_mib:
            problems.append(f"{c.uuid}: memory {c.used_mem}/{c.memory_mib}")
        if c.used_cores > c.cores:
            problems.append(f"{c.uuid}: cores {c.used_cores}/{c.cores}")
        if c.used_slots > c.split_count:
            problems.append(f"{c.uuid}: slots {c.used_slots}/{c.split_count}")
    return problems
