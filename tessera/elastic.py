"""Elastic sharing, the user API (issue 33; docs/elastic.md): a guaranteed amount and a burst
limit per GPU.

The guarantee is HAMi's own request (`nvidia.com/gpumem`, `nvidia.com/gpumem-percentage`,
`nvidia.com/gpucores`): the scheduler packs by it, exactly as before. The burst limit is an
annotation, because kube-apiserver requires `requests == limits` for extended resources (a
`requests` below `limits` for `nvidia.com/gpumem` is refused by the API server before any
webhook sees the pod), so the Kubernetes way of writing "request < limit" is not available:

    tessera.io/gpumem-limit: "12288"            MiB per GPU, or "75%" of each card
    tessera.io/gpucores-limit: "80"             % of each card's compute
    tessera.io/gpumem-reclaim: "evict"          fail (default) | evict
    tessera.io/gpumem-wait-seconds: "30"        an allocation that does not fit waits (0-300 s)
    tessera.io/gpumem-spill: "16384"            MiB of host memory the container may take for
                                                allocations the GPU cannot hold (managed memory
                                                preferring the CPU; off by default)

A limit applies to every GPU container of the pod, or per container: "train=12288,side=4096"
(containers not named keep hard slices). Scheduler-owned: the limits granted, recorded on the
bound pod in `tessera.io/vgpu-burst-allocated` (HAMi's container/device layout, `UUID,MEM,CORES`
per device) — users cannot set it (admission denies it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tessera.quantity import is_plain_digits

if TYPE_CHECKING:  # the CLI reads annotations without loading pydantic
    from tessera.models import DeviceGrant

ANN_GPUMEM_LIMIT = "tessera.io/gpumem-limit"
ANN_GPUCORES_LIMIT = "tessera.io/gpucores-limit"
ANN_GPUMEM_RECLAIM = "tessera.io/gpumem-reclaim"
ANN_GPUMEM_WAIT = "tessera.io/gpumem-wait-seconds"
ANN_GPUMEM_SPILL = "tessera.io/gpumem-spill"
ANN_BURST_ALLOCATED = "tessera.io/vgpu-burst-allocated"  # scheduler-owned
USER_ANNOTATIONS = (ANN_GPUMEM_LIMIT, ANN_GPUCORES_LIMIT, ANN_GPUMEM_RECLAIM, ANN_GPUMEM_WAIT,
                    ANN_GPUMEM_SPILL)
SCHEDULER_ANNOTATIONS = (ANN_BURST_ALLOCATED,)

RECLAIM_POLICIES = ("fail", "evict")
MAX_WAIT_S = 300.0
MAX_MEMORY_MIB = 1 << 30  # 1 PiB in MiB: anything above is a typo, not a card
_SECONDS = re.compile(r"[0-9]{1,6}(?:\.[0-9]{1,9})?")
MAX_SPILL_MIB = 16 << 20  # 16 TiB of host memory in MiB: above it is a typo, not a node
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a container name (DNS label)


class ElasticError(ValueError):
    """An elastic annotation a person must fix; the message says how."""


@dataclass(frozen=True)
class BurstLimit:
    """One container's burst limit per GPU (0 / None: none for that resource)."""

    memory_mib: int = 0
    memory_percentage: int | None = None
    cores: int = 0

    def memory_on(self, card_memory_mib: int) -> int:
        """The burst limit in MiB on a card of that size (0: none), never above the card."""
        if self.memory_percentage is not None:
            return card_memory_mib * self.memory_percentage // 100
        return min(self.memory_mib, card_memory_mib) if card_memory_mib else self.memory_mib


@dataclass(frozen=True)
class ElasticOptions:
    """A pod's elastic knobs: burst limits by container name, reclaim policy, wait bound."""

    limits: Mapping[str, BurstLimit] = field(default_factory=dict)
    reclaim: str = "fail"
    wait_s: float = 0.0
    named: frozenset[str] = frozenset()  # containers named explicitly ("name=value")
    spill_mib: Mapping[str, int] = field(default_factory=dict)  # container -> host MiB
    spill_named: frozenset[str] = frozenset()  # containers the spill annotation names

    @property
    def any(self) -> bool:
        return (bool(self.limits) or self.reclaim != "fail" or self.wait_s > 0
                or bool(self.spill_mib))  # fmt: skip


def _memory(text: str, where: str) -> tuple[int, int | None]:
    t = text.strip()
    if t.endswith("%"):
        pct = t[:-1].strip()
        if not is_plain_digits(pct) or not 1 <= int(pct) <= 100:
            raise ElasticError(f"{where}: a percentage of the card is 1%..100%, not {text!r}")
        return 0, int(pct)
    if not is_plain_digits(t) or not 1 <= int(t) <= MAX_MEMORY_MIB:
        raise ElasticError(f"{where}: MiB per GPU as a positive integer (or N%), not {text!r}")
    return int(t), None


def _cores(text: str, where: str) -> int:
    t = text.strip()
    if not is_plain_digits(t) or not 1 <= int(t) <= 100:
        raise ElasticError(f"{where}: % of each GPU's compute, 1..100, not {text!r}")
    return int(t)


def _per_container(value: Any, key: str, names: Sequence[str]) -> tuple[dict[str, str], bool]:
    """"V" (every container) or "name=V,name=V": (container name -> text, named)."""
    if not isinstance(value, str) or not value.strip():
        raise ElasticError(f"{key}: a value, or name=value pairs separated by commas")
    if "=" not in value:
        return {n: value for n in names}, False
    out: dict[str, str] = {}
    for part in value.split(","):
        name, sep, v = part.partition("=")
        name = name.strip()
        if not sep or not name or not v.strip():
            raise ElasticError(f"{key}: {part.strip()!r} is not name=value")
        if not _NAME.match(name) or name not in names:
            raise ElasticError(f"{key}: the pod has no container {name!r}")
        if name in out:
            raise ElasticError(f"{key}: container {name!r} named twice")
        out[name] = v
    return out, True


def parse_elastic(annotations: Mapping[str, Any], names: Sequence[str]) -> ElasticOptions:
    """The pod's elastic annotations (`names`: its containers, init containers first);
    ElasticError with a sentence when one is malformed."""
    mem = annotations.get(ANN_GPUMEM_LIMIT)
    cores = annotations.get(ANN_GPUCORES_LIMIT)
    limits: dict[str, BurstLimit] = {}
    mem_of, mem_named = _per_container(mem, ANN_GPUMEM_LIMIT, names) if mem is not None else (
        {}, False)
    cores_of, cores_named = (_per_container(cores, ANN_GPUCORES_LIMIT, names)
                             if cores is not None else ({}, False))  # fmt: skip
    named = frozenset((mem_of if mem_named else {}).keys()) | frozenset(
        (cores_of if cores_named else {}).keys())
    for name in names:
        m = mem_of.get(name)
        c = cores_of.get(name)
        if m is None and c is None:
            continue
        mib, pct = _memory(m, f"{ANN_GPUMEM_LIMIT} ({name})") if m is not None else (0, None)
        limits[name] = BurstLimit(mib, pct, _cores(c, f"{ANN_GPUCORES_LIMIT} ({name})")
                                  if c is not None else 0)  # fmt: skip
    reclaim = annotations.get(ANN_GPUMEM_RECLAIM, "fail")
    if not isinstance(reclaim, str) or reclaim.strip().lower() not in RECLAIM_POLICIES:
        raise ElasticError(f"{ANN_GPUMEM_RECLAIM}: one of {', '.join(RECLAIM_POLICIES)}, "
                           f"not {reclaim!r}")  # fmt: skip
    wait = annotations.get(ANN_GPUMEM_WAIT, "0")
    # ASCII decimals only: float() also reads other scripts' digits, "1_0" and "1e2"
    wait_s = (float(wait) if isinstance(wait, str) and _SECONDS.fullmatch(wait.strip())
              else math.nan)  # fmt: skip
    if not 0 <= wait_s <= MAX_WAIT_S:  # NaN fails too
        raise ElasticError(f"{ANN_GPUMEM_WAIT}: seconds, 0..{MAX_WAIT_S:g}, not {wait!r}")
    spill_mib, spill_named = parse_spill(annotations, names)
    return ElasticOptions(limits, reclaim.strip().lower(), wait_s, named, spill_mib, spill_named)


def parse_spill(annotations: Mapping[str, Any], names: Sequence[str]
                ) -> tuple[dict[str, int], frozenset[str]]:  # fmt: skip
    """`tessera.io/gpumem-spill`: container name -> MiB of host memory it may spill to (all its
    GPUs together), and the names it lists explicitly; ElasticError when malformed."""
    value = annotations.get(ANN_GPUMEM_SPILL)
    if value is None:
        return {}, frozenset()
    texts, named = _per_container(value, ANN_GPUMEM_SPILL, names)
    out: dict[str, int] = {}
    for name, text in texts.items():
        t = text.strip()
        if not is_plain_digits(t) or not 1 <= int(t) <= MAX_SPILL_MIB:
            raise ElasticError(f"{ANN_GPUMEM_SPILL} ({name}): MiB of host memory as a positive "
                               f"integer up to {MAX_SPILL_MIB}, not {text!r}")  # fmt: skip
        out[name] = int(t)
    return out, frozenset(out) if named else frozenset()


def spill_bytes_of(annotations: Mapping[str, Any], names: Sequence[str], container: str) -> int:
    """The host memory (bytes) container `container` of a pod may spill to; 0 when it may not
    or the annotation is unreadable (a pod whose annotation changed after admission spills
    nothing rather than something nobody validated)."""
    try:
        spill, _ = parse_spill(annotations, names)
    except ElasticError:
        return 0
    return spill.get(container, 0) << 20


def check_against_request(name: str, burst: BurstLimit, memory_mib: int,
                          memory_percentage: int | None, cores: int,
                          card_memory_mib: int | None = None) -> None:  # fmt: skip
    """A burst limit must not be below its guarantee (HAMi's request) and needs one to burst
    from. `card_memory_mib` (when known) judges a MiB guarantee against a percentage limit."""
    if burst.memory_mib or burst.memory_percentage is not None:
        if not memory_mib and memory_percentage is None:
            raise ElasticError(
                f"container {name}: {ANN_GPUMEM_LIMIT} needs a memory guarantee "
                "(nvidia.com/gpumem or gpumem-percentage) to burst from")
        if burst.memory_percentage is not None and memory_percentage is not None:
            low = burst.memory_percentage < memory_percentage
        elif burst.memory_percentage is None and memory_percentage is None:
            low = burst.memory_mib < memory_mib
        elif card_memory_mib:
            low = burst.memory_on(card_memory_mib) < (
                memory_mib if memory_percentage is None
                else card_memory_mib * memory_percentage // 100)
        else:
            low = False  # MiB against % of a card not known yet: judged at placement
        if low:
            raise ElasticError(f"container {name}: {ANN_GPUMEM_LIMIT} is below its guaranteed "
                               "memory: the limit must be at least the guarantee")  # fmt: skip
    if burst.cores:
        if not 0 < cores < 100:
            raise ElasticError(
                f"container {name}: {ANN_GPUCORES_LIMIT} needs a compute guarantee of 1..99 % "
                "(nvidia.com/gpucores) to burst from")
        if burst.cores < cores:
            raise ElasticError(f"container {name}: {ANN_GPUCORES_LIMIT} ({burst.cores}) is below "
                               f"its guaranteed compute ({cores})")  # fmt: skip


def burst_of_grant(burst: BurstLimit | None, grant: DeviceGrant, card_memory_mib: int
                   ) -> tuple[int, int]:  # fmt: skip
    """(memory_limit_mib, cores_limit) to record on a grant: clamped to the card, 0 where the
    limit is no more than the guarantee (a hard slice) or the grant is a MIG instance."""
    if burst is None or grant.mig is not None:
        return 0, 0
    mem = burst.memory_on(card_memory_mib) if grant.memory_mib else 0
    cores = min(burst.cores, 100) if 0 < grant.cores < 100 else 0
    return (mem if mem > grant.memory_mib else 0), (cores if cores > grant.cores else 0)


# --- the scheduler-owned record on the bound pod ------------------------------------------------


def encode_burst(containers: Sequence[Sequence[DeviceGrant]]) -> str | None:
    """`tessera.io/vgpu-burst-allocated`: HAMi's layout (containers `;`, devices `:`), each
    device `UUID,MEMLIMIT,CORESLIMIT`; None when no grant bursts."""
    if not any(g.memory_limit_mib or g.cores_limit for c in containers for g in c):
        return None
    return "".join(
        "".join(f"{g.uuid},{g.memory_limit_mib},{g.cores_limit}:" for g in c) + ";"
        for c in containers
    )


def decode_burst(text: str) -> list[list[tuple[str, int, int]]]:
    """The inverse of encode_burst; ValueError when malformed."""
    out: list[list[tuple[str, int, int]]] = []
    if len(text) > 65536 or not text.endswith(";"):
        raise ValueError(f"{ANN_BURST_ALLOCATED}: malformed")
    for container in text[:-1].split(";"):
        devices: list[tuple[str, int, int]] = []
        for dev in filter(None, container.split(":")):
            parts = dev.split(",")
            if len(parts) != 3 or not is_plain_digits(parts[1]) or not is_plain_digits(parts[2]):
                raise ValueError(f"{ANN_BURST_ALLOCATED}: malformed device {dev[:80]!r}")
            if int(parts[1]) > MAX_MEMORY_MIB or int(parts[2]) > 100:
                raise ValueError(f"{ANN_BURST_ALLOCATED}: value out of range")
            devices.append((parts[0], int(parts[1]), int(parts[2])))
        out.append(devices)
    return out


def with_burst(containers: list[list[DeviceGrant]], text: str | None) -> list[list[DeviceGrant]]:
    """Grants read back from HAMi's annotation, with the burst limits of the record added (a
    lost ledger rebuilt from pods keeps them). A record that does not match the grants
    (another count, another card) is ignored: hard slices."""
    if not text:
        return containers
    try:
        burst = decode_burst(text)
    except ValueError:
        return containers
    if len(burst) != len(containers):
        return containers
    out = []
    for grants, limits in zip(containers, burst, strict=True):
        if len(grants) != len(limits) or any(g.uuid != u for g, (u, _, _) in
                                             zip(grants, limits, strict=True)):  # fmt: skip
            return containers
        out.append([g.model_copy(update={"memory_limit_mib": m if m > g.memory_mib else 0,
                                         "cores_limit": c if c > g.cores else 0})
                    for g, (_, m, c) in zip(grants, limits, strict=True)])  # fmt: skip
    return out
