"""HAMi encodings, in one place: resource requests, pod and node annotations.

Facts from specs/hami-compat.md; the code is ours. Parsing is pure and raises RequestError with
a sentence a person can act on; nothing here does I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal, localcontext
from typing import TYPE_CHECKING, Any

from tessera import elastic, quantity

if TYPE_CHECKING:  # imported where used: the CLI reads annotations without loading pydantic
    from collections.abc import Callable

    from tessera.models import DeviceGrant, DeviceInfo
    from tessera.settings import TesseraSettings

# --- annotation and label keys ----------------------------------------------------------------
ANN_DEVICES_TO_ALLOCATE = "hami.io/vgpu-devices-to-allocate"
ANN_DEVICES_ALLOCATED = "hami.io/vgpu-devices-allocated"
ANN_VGPU_NODE = "hami.io/vgpu-node"
ANN_VGPU_TIME = "hami.io/vgpu-time"
ANN_BIND_TIME = "hami.io/bind-time"
ANN_BIND_PHASE = "hami.io/bind-phase"
LABEL_VGPU_NODE = ANN_VGPU_NODE
ANN_NODE_REGISTER = "hami.io/node-nvidia-register"
ANN_DEVICE_CORDON = "hami.io/device-cordon"
ANN_USE_GPUTYPE = "nvidia.com/use-gputype"
ANN_NOUSE_GPUTYPE = "nvidia.com/nouse-gputype"
ANN_USE_GPUUUID = "nvidia.com/use-gpuuuid"
ANN_NOUSE_GPUUUID = "nvidia.com/nouse-gpuuuid"
ANN_NUMA_BIND = "nvidia.com/numa-bind"
ANN_VGPU_MODE = "nvidia.com/vgpu-mode"
ANN_GPU_POLICY = "hami.io/gpu-scheduler-policy"
ANN_NODE_POLICY = "hami.io/node-scheduler-policy"
ANN_SCORING_WEIGHTS = "hami.io/device-scoring-weights"
# Tessera's own pod annotation (not HAMi's): zero device memory before it is freed.
ANN_SCRUB_ON_FREE = "tessera.io/scrub-on-free"
# Forms HAMi's guides print, honoured as aliases of the canonical annotation keys (admission
# copies them to the canonical key and warns). `hami.io/task-priority` is mapped, not copied:
# see task_priority_to_priority.
ANN_ALIAS_GPU_TYPE = "hami.io/gpu-type"
ANN_ALIAS_GPU_UUID = "hami.io/gpu-uuid-white-list"
ANN_ALIAS_TASK_PRIORITY = "hami.io/task-priority"
ANNOTATION_ALIASES = {
    ANN_ALIAS_GPU_TYPE: ANN_USE_GPUTYPE,
    ANN_ALIAS_GPU_UUID: ANN_USE_GPUUUID,
}
# The resource alias (`nvidia.com/cores` = the cores resource, default nvidia.com/gpucores).
RESOURCE_ALIAS_CORES = "nvidia.com/cores"
GPU_SCHEDULER_POLICIES = ("binpack", "spread", "mutex", "numa", "topology-aware")
NODE_SCHEDULER_POLICIES = ("binpack", "spread")
# Every hami.io/ and nvidia.com/ annotation Tessera reads (others draw an admission warning).
KNOWN_ANNOTATIONS = frozenset({
    ANN_USE_GPUTYPE, ANN_NOUSE_GPUTYPE, ANN_USE_GPUUUID, ANN_NOUSE_GPUUUID, ANN_NUMA_BIND,
    ANN_VGPU_MODE, ANN_GPU_POLICY, ANN_NODE_POLICY, ANN_SCORING_WEIGHTS,
    ANN_ALIAS_GPU_TYPE, ANN_ALIAS_GPU_UUID, ANN_ALIAS_TASK_PRIORITY,
    ANN_DEVICES_TO_ALLOCATE, ANN_DEVICES_ALLOCATED, ANN_VGPU_NODE, ANN_VGPU_TIME, ANN_BIND_TIME,
    ANN_BIND_PHASE,
})


def task_priority_to_priority(value: str) -> int:
    """`hami.io/task-priority` (higher number = more important) → `nvidia.com/priority`
    (0 = high, 1 = low): a number above 0 is high (0), 0 or below is low (1)."""
    try:
        number = int(value.strip())
    except ValueError as exc:
        raise RequestError(
            f"annotation {ANN_ALIAS_TASK_PRIORITY}: {value!r} is not an integer (a higher number "
            "is a higher priority; above 0 maps to nvidia.com/priority 0 = high)"
        ) from exc
    return 0 if number > 0 else 1


# Prefixes a user may never set: only the scheduler writes them.
# tessera.io/grants-signature: the node agent's signature of -allocated (tessera.signing).
SCHEDULER_OWNED_PREFIXES = ("hami.io/vgpu-", "hami.io/bind-", "tessera.io/mig-instances",
                            "tessera.io/grants-signature", "tessera.io/vgpu-burst-allocated")

BIND_PHASE_ALLOCATING = "allocating"
BIND_PHASE_SUCCESS = "success"
BIND_PHASE_FAILED = "failed"

# Absurd values are refused rather than silently wrapped (16 TiB per GPU, 1024 GPUs).
MAX_MEMORY_MIB = 16 * 1024 * 1024
MAX_GPU_COUNT = 1024


class RequestError(ValueError):
    """A GPU request that cannot be honoured as written."""


# --- quantities ---------------------------------------------------------------------------------
# The grammar and the canonical form are `tessera.quantity`'s (kube-apiserver's rules); this
# module reads GPU requests from whatever form the API server writes (`3000` comes back `3k`).


def parse_quantity(value: object, resource: str = "quantity") -> Decimal:
    """A Kubernetes quantity ("3000", "3k", "1.5", "2Gi", "500m", "1e3", 7) as an exact Decimal."""
    if isinstance(value, bool) or value is None:
        raise RequestError(f"{resource}: {value!r} is not a quantity")
    if type(value) is int:
        return Decimal(value)
    try:
        amount = quantity.parse(value).value
    except quantity.QuantityError:
        raise RequestError(f"{resource}: {value!r} is not a quantity") from None
    with localcontext() as exact:
        exact.prec = 80  # a quantity has at most ~30 digits: the division is exact
        return Decimal(amount.numerator) / Decimal(amount.denominator)


def memory_mib(value: object, resource: str, where: str = "") -> int:
    """A device-memory request as the whole number of MiB the user meant (`3000`, `3k`, `1e3`);
    a binary suffix or a fraction is refused saying what to write instead."""
    if type(value) is int:
        return value
    try:
        return quantity.whole_mib(value, resource, where)
    except quantity.QuantityError as exc:
        raise RequestError(str(exc)) from None


def _as_int(value: object, resource: str, *, low: int, high: int) -> int:
    parsed = parse_quantity(value, resource)
    if parsed != parsed.to_integral_value():
        raise RequestError(f"{resource}: {value!r} must be a whole number")
    if parsed < low:
        raise RequestError(f"{resource}: {value!r} must be at least {low}")
    if parsed > high:
        raise RequestError(f"{resource}: {value!r} is absurdly large (at most {high})")
    return int(parsed)


# --- container requests -----------------------------------------------------------------------


@dataclass(frozen=True, init=False)
class ContainerRequest:
    """What one container asks of each of its GPUs, after HAMi's defaults.

    `memory_mib` is 0 when the request is a percentage (`memory_percentage` then applies per card).
    """

    count: int
    memory_mib: int
    memory_percentage: int | None
    cores: int
    priority: int | None = None
    # elastic sharing (tessera/elastic.py): the burst limit beyond this guarantee, or None
    burst: elastic.BurstLimit | None = None
    # The device family whose resources the container names (tessera.device_kinds): a request
    # only goes on devices of a kind of this family.
    family: str = "nvidia"

    def __init__(
        self, count: int, memory_mib: int, memory_percentage: int | None, cores: int,
        priority: int | None = None, burst: elastic.BurstLimit | None = None,
        family: str = "nvidia",
    ) -> None:  # fmt: skip
        # (the generated one of a frozen dataclass sets each field through object.__setattr__:
        # 3-4x the cost of one update of the instance's dict, on every pod a decision reads)
        self.__dict__.update(count=count, memory_mib=memory_mib,
                             memory_percentage=memory_percentage, cores=cores, priority=priority,
                             burst=burst, family=family)  # fmt: skip

    @property
    def exclusive(self) -> bool:
        return self.cores >= 100

    def memory_on(self, card_memory_mib: int) -> int:
        """The MiB this request takes on a card of that size."""
        if self.memory_percentage is not None:
            return card_memory_mib * self.memory_percentage // 100
        return self.memory_mib


def _resources(container: dict[str, Any], key: str) -> object | None:
    resources = container.get("resources") or {}
    if not isinstance(resources, dict):
        raise RequestError(f"container {container.get('name', '?')}: resources must be an object")
    for section in ("limits", "requests"):
        values = resources.get(section) or {}
        if not isinstance(values, dict):
            raise RequestError(f"container {container.get('name', '?')}: {section} must be a map")
        if key in values:
            if values[key] is None:
                raise RequestError(
                    f"container {container.get('name', '?')}: {key}: null is not a quantity"
                )
            return values[key]
    return None


def raw_percentage(container: dict[str, Any], settings: TesseraSettings) -> Decimal | None:
    """The percentage exactly as written (admission refuses values outside [0, 100])."""
    value = _resources(container, settings.resource_mem_percentage)
    return None if value is None else parse_quantity(value, settings.resource_mem_percentage)


def _whole(value: object, resource: Callable[[], str], *, low: int, high: int,
           read: Callable[[object, str], int] | None = None) -> int:
    """`_as_int` (the same value, the same refusal), without a Decimal for the usual values: an
    int, or a string of ASCII digits (a plain quantity). `read` reads the other forms (memory:
    `memory_mib`, which names what to write instead of a unit that means bytes)."""
    kind = type(value)
    if kind is int:
        number = value
    elif kind is str and value.isdigit() and value.isascii() and len(value) <= 64:  # type: ignore[union-attr]
        number = int(value)  # type: ignore[arg-type]
    elif read is not None:
        number = read(value, resource())
    else:
        return _as_int(value, resource(), low=low, high=high)
    if low <= number <= high:  # type: ignore[operator]
        return number  # type: ignore[return-value]
    return _as_int(value, resource(), low=low, high=high)  # (refuses it)


_MAX_CORES = 10**9  # (read, then clamped to 100)
_MAX_PLAIN = 10**64  # (above any plain string `_plain_whole` reads: at most 64 digits)


def _plain_whole(value: object, high: int) -> int:
    """What `_whole(value, ..., low=0, high=high)` gives when the value is plainly a whole number
    in [0, high] (an int, or a string of at most 64 ASCII digits); -1 for any other value
    (`_whole` then reads or refuses it)."""
    kind = type(value)
    if kind is int:
        number: int = value  # type: ignore[assignment]
    elif kind is str and value.isdigit() and value.isascii() and len(value) <= 64:  # type: ignore[union-attr]
        number = int(value)  # type: ignore[call-overload]
    else:
        return -1
    return number if 0 <= number <= high else -1


def _resources_of(container: dict[str, Any], keys: tuple[str, ...]) -> list[object | None]:
    """`_resources(container, key)` for each key, in order (the same values, the same refusal):
    the container's limits and requests read once when both are maps."""
    resources = container.get("resources") or {}
    if type(resources) is dict:
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        if type(limits) is dict and type(requests) is dict:
            values: list[object | None] = []
            for key in keys:
                if key in limits:
                    value = limits[key]
                elif key in requests:
                    value = requests[key]
                else:
                    values.append(None)
                    continue
                if value is None:
                    return [_resources(container, key) for key in keys]  # (refuses it)
                values.append(value)
            return values
    return [_resources(container, key) for key in keys]


def parse_container_request(
    container: dict[str, Any], settings: TesseraSettings
) -> ContainerRequest | None:
    """HAMi's reading of a container's GPU resources; None when it asks for no GPU."""
    name = container.get("name", "?")
    raw_count, raw_mem, raw_pct, raw_cores, raw_priority = _resources_of(container, (
        settings.resource_name, settings.resource_mem, settings.resource_mem_percentage,
        settings.resource_cores, settings.resource_priority,
    ))  # fmt: skip
    where = f"container {name}: "
    # (each value read by `_plain_whole` when it is plainly one in range, as most are; any other
    # through `_whole`, which reads or refuses it as before)
    count = 0
    if raw_count is not None:
        count = _plain_whole(raw_count, MAX_GPU_COUNT)
        if count < 0:
            count = _whole(raw_count, lambda: where + settings.resource_name, low=0,
                           high=MAX_GPU_COUNT)  # fmt: skip
    memory = 0
    if raw_mem is not None:
        memory = _plain_whole(raw_mem, MAX_MEMORY_MIB)
        if memory < 0:
            memory = _whole(raw_mem, lambda: where + settings.resource_mem, low=0,
                            high=MAX_MEMORY_MIB,
                            read=lambda value, _: memory_mib(value, settings.resource_mem, where))
        memory *= settings.memory_factor
        if memory > MAX_MEMORY_MIB:
            raise RequestError(f"{where}{settings.resource_mem} overflows after memory factor")
    percentage: int | None = None
    if raw_pct is not None:
        # (a whole number as `_plain_whole` reads it is the one parse_quantity reads exactly,
        # without its Fractions and Decimal context: ~12 µs; an int's Decimal is exact too)
        pct: Decimal | int = _plain_whole(raw_pct, _MAX_PLAIN)
        if pct < 0:
            pct = (raw_pct if type(raw_pct) is int
                   else parse_quantity(raw_pct, where + settings.resource_mem_percentage))
        # HAMi: > 100 clamps to 100, <= 0 is ignored (unset is not the same as 0).
        if pct > 0:
            percentage = int(min(pct, 100))
    cores = settings.default_cores
    if raw_cores is not None:
        cores = _plain_whole(raw_cores, _MAX_CORES)
        if cores < 0:
            cores = _whole(raw_cores, lambda: where + settings.resource_cores, low=0,
                           high=_MAX_CORES)  # fmt: skip
        cores = min(100, cores)
    priority: int | None = None
    if raw_priority is not None:
        priority = _whole(raw_priority, lambda: where + settings.resource_priority, low=0,
                          high=1)  # fmt: skip
    asked = raw_mem is not None or raw_pct is not None or raw_cores is not None
    return _with_defaults(count, memory, percentage, cores, priority, asked, settings)


def _with_defaults(count: int, memory: int, percentage: int | None, cores: int,
                   priority: int | None, asked: bool, settings: TesseraSettings
                   ) -> ContainerRequest | None:  # fmt: skip
    """HAMi's defaults for the values read (memory after its factor, cores clamped): no count
    and nothing `asked` (memory, percentage or cores) is no GPU; no count otherwise is
    `defaultGPUNum`; neither memory nor a percentage is `defaultMem`, else the whole card;
    an explicit MiB request wins over a percentage."""
    if count == 0:
        if not asked:
            return None
        count = settings.default_gpu_num
    if memory == 0 and percentage is None:
        if settings.default_mem:
            memory = settings.default_mem
        else:
            percentage = 100
    if memory and percentage is not None:
        percentage = None
    return ContainerRequest(count, memory, percentage, cores, priority)


@dataclass(frozen=True, init=False)
class PodRequest:
    """Every container's request, positionally: init containers first (None = no GPU)."""

    init: list[ContainerRequest | None] = field(default_factory=list)
    containers: list[ContainerRequest | None] = field(default_factory=list)
    # Indices (into `init`) of native sidecars: init containers with restartPolicy: Always keep
    # running beside the app containers, so they are summed with them, never maxed.
    sidecars: frozenset[int] = frozenset()

    def __init__(
        self, init: list[ContainerRequest | None] | None = None,
        containers: list[ContainerRequest | None] | None = None,
        sidecars: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        # (as ContainerRequest's: one update of the dict, not a frozen setattr per field)
        self.__dict__.update(init=[] if init is None else init,
                             containers=[] if containers is None else containers,
                             sidecars=sidecars)  # fmt: skip

    @property
    def all(self) -> list[ContainerRequest | None]:
        return [*self.init, *self.containers]

    @property
    def wants_gpu(self) -> bool:
        return any(r is not None for r in self.all)


_kinds_registry: Any = None


def _request_reader(
    settings: TesseraSettings,
) -> Callable[[dict[str, Any], TesseraSettings], ContainerRequest | None]:
    """tessera.device_kinds.registry.request_reader (imported once: this runs per pod)."""
    global _kinds_registry
    if _kinds_registry is None:
        from tessera.device_kinds import registry

        _kinds_registry = registry
    return _kinds_registry.request_reader(settings)


def parse_pod_request(pod: dict[str, Any], settings: TesseraSettings) -> PodRequest:
    spec = pod.get("spec") or {}
    if not isinstance(spec, dict):
        raise RequestError("pod spec must be an object")
    init = spec.get("initContainers") or []
    app = spec.get("containers") or []
    if not isinstance(init, list) or not isinstance(app, list):
        raise RequestError("containers must be lists")
    for c in [*init, *app]:
        if not isinstance(c, dict):
            raise RequestError("every container must be an object")
    read = _request_reader(settings)  # whichever device family a container names
    shape = _request_shape(init, app, settings)
    remembered = _remembered_requests
    mapping = _kinds_registry.resource_map(settings)  # (which family each resource names)
    if remembered[0] is not mapping:
        remembered[:] = [mapping, {}, _FamilyNames(mapping)]
    request = None if shape is None else remembered[1].get(shape)
    if request is None:
        if shape is not None and read is _kinds_registry.read_request:
            read = remembered[2].read  # (its sections maps, its keys strings)
        request = PodRequest(
            init=[read(c, settings) for c in init] if init else [],
            containers=[read(c, settings) for c in app],
            sidecars=sidecar_indices(init) if init else _NO_SIDECARS,
        )
        if shape is not None and all(
            r is None or r.family == _DEFAULT_FAMILY for r in (*request.init, *request.containers)
        ):  # (another family's reader may read more than the shape: its chip; not remembered)
            if len(remembered[1]) >= _REMEMBERED_REQUESTS:
                remembered[1].clear()
            remembered[1][shape] = request
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if isinstance(annotations, dict) and (
        elastic.ANN_GPUMEM_LIMIT in annotations or elastic.ANN_GPUCORES_LIMIT in annotations
    ):
        request = with_burst_limits(request, annotations, [*init, *app])
    return request


_NO_SIDECARS: frozenset[int] = frozenset()


class _FamilyNames:
    """Which resource names (of a `registry.resource_map`) are the default family's (NVIDIA's)
    and which another family's, for `read`."""

    def __init__(self, mapping: dict[str, Any]) -> None:
        self.own = frozenset(k for k, fam in mapping.items() if fam.name == _DEFAULT_FAMILY)
        self.other = frozenset(k for k, fam in mapping.items() if fam.name != _DEFAULT_FAMILY)

    def read(self, container: dict[str, Any], settings: TesseraSettings) -> ContainerRequest | None:
        """`registry.read_request(container, settings)` (the families the container names,
        then that family's reader) for a container of a pod with a shape (`_request_shape`:
        its limits and requests None or maps), without the registry when they name no other
        family's resource: None when they name none of NVIDIA's either, else what NVIDIA's
        reader, `parse_container_request`, reads (`_plain_request` first)."""
        resources = container.get("resources")
        if resources is None:
            return None  # (read_request names no family in it: None)
        if type(resources) is dict:
            limits = resources.get("limits") or _EMPTY
            requests = resources.get("requests") or _EMPTY
            other = self.other
            if other.isdisjoint(limits) and other.isdisjoint(requests):
                own = self.own
                if own.isdisjoint(limits) and own.isdisjoint(requests):
                    return None
                if type(limits) is dict and type(requests) is dict:
                    request = _plain_request(limits, requests, settings)
                    if request is not _NOT_PLAIN:
                        return request  # type: ignore[return-value]
                return parse_container_request(container, settings)
        return _kinds_registry.read_request(container, settings)  # type: ignore[no-any-return]


_NOT_PLAIN = object()


def _plain_request(
    limits: dict[str, Any], requests: dict[str, Any], settings: TesseraSettings
) -> ContainerRequest | object | None:
    """What `parse_container_request` reads from a container with these limits and requests
    (maps) when each of its five values is plainly a whole number in range (an int, a string
    of at most 64 ASCII digits as `_plain_whole` reads it, or such digits and `k`) and the
    memory within the limit after
    the memory factor; `_NOT_PLAIN` for any other (parse_container_request then reads or
    refuses it). One loop, no call per value: this runs for every pod shape not seen before."""
    numbers: list[int | None] = []
    for key in (settings.resource_name, settings.resource_mem, settings.resource_mem_percentage,
                settings.resource_cores, settings.resource_priority):  # fmt: skip
        if key in limits:
            value = limits[key]
        elif key in requests:
            value = requests[key]
        else:
            numbers.append(None)
            continue
        kind = type(value)
        if kind is int:
            if value < 0:
                return _NOT_PLAIN
            numbers.append(value)
        elif kind is str and len(value) <= 64 and value.isascii():
            if value.isdigit():
                numbers.append(int(value))
            elif value[-1:] == "k" and value[:-1].isdigit():
                # (thousands as kube-apiserver writes them: 8000 comes back `8k`; a quantity's
                # value, read exactly as parse_quantity and memory_mib read it)
                numbers.append(int(value[:-1]) * 1000)
            else:
                return _NOT_PLAIN
        else:
            return _NOT_PLAIN
    count, memory, pct, cores, priority = numbers
    if (
        (count is not None and count > MAX_GPU_COUNT)
        or (memory is not None and (memory > MAX_MEMORY_MIB
                                    or memory * settings.memory_factor > MAX_MEMORY_MIB))
        or (pct is not None and pct > _MAX_PLAIN)
        or (cores is not None and cores > _MAX_CORES)
        or (priority is not None and priority > 1)
    ):  # fmt: skip
        return _NOT_PLAIN
    asked = memory is not None or pct is not None or cores is not None
    return _with_defaults(
        count or 0, memory * settings.memory_factor if memory is not None else 0,
        min(pct, 100) if pct else None,  # (HAMi: above 100 is 100, 0 is unset)
        settings.default_cores if cores is None else min(100, cores), priority, asked, settings,
    )  # fmt: skip


_EMPTY: dict[str, Any] = {}


# Pods' requests read before, by their shape (`_request_shape`): pods of one workload ask the
# same. A PodRequest is never changed once read (a burst limit makes a new one), so one object
# serves them all. Kept for one resource map (`registry.resource_map`: which family each
# resource name belongs to, per settings object and device kinds' version; held here, so never
# mistaken for another); refusals are never remembered; the memory starts over when full.
_remembered_requests: list[Any] = [None, {}]
_REMEMBERED_REQUESTS = 4096
_DEFAULT_FAMILY = "nvidia"  # (ContainerRequest.family's default: NVIDIA's reader)


def _request_shape(
    init: list[dict[str, Any]], app: list[dict[str, Any]], settings: TesseraSettings
) -> tuple[Any, ...] | None:
    """Everything `PodRequest` is read from, as a key: the settings it reads, the device kinds'
    version, and per container its limits and requests (in order) and, for an init container,
    whether it is a native sidecar; None when a value is not plainly a string or an int (a
    bool or a float equals an int as a key but is read differently: such a pod is read afresh,
    as are malformed ones, which are refused with the container's name)."""
    parts: list[Any] = [
        settings.resource_name, settings.resource_mem, settings.resource_mem_percentage,
        settings.resource_cores, settings.resource_priority, settings.memory_factor,
        settings.default_cores, settings.default_mem, settings.default_gpu_num,
        _kinds_registry.version, len(init),
    ]  # fmt: skip
    for at, c in enumerate((*init, *app)):
        resources = c.get("resources")
        if resources is None:
            limits = requests = None
        elif type(resources) is dict:
            limits, requests = resources.get("limits"), resources.get("requests")
        else:
            return None
        for section in (limits, requests):
            if section is None:
                parts.append(None)
                continue
            if type(section) is not dict:
                return None
            for key, value in section.items():
                kind = type(value)
                if (kind is not str and kind is not int) or type(key) is not str:
                    return None
            parts.append(tuple(section.items()))
        if at < len(init):
            parts.append(c.get("restartPolicy") == "Always")
    return tuple(parts)


def with_burst_limits(
    request: PodRequest, annotations: dict[str, Any], containers: list[dict[str, Any]]
) -> PodRequest:
    """The request with each container's burst limit (tessera.io/gpumem-limit,
    tessera.io/gpucores-limit) beside its guarantee; RequestError when one is malformed, below
    its guarantee, or set on a container that asks for no GPU."""
    names = [str(c.get("name", "")) for c in containers]
    try:
        options = elastic.parse_elastic(annotations, names)
        out: list[ContainerRequest | None] = []
        for name, r in zip(names, request.all, strict=True):
            burst = options.limits.get(name)
            if burst is not None and r is None and name in options.named:
                raise elastic.ElasticError(f"container {name}: a burst limit, but it asks for no "
                                           "GPU")  # fmt: skip
            if burst is None or r is None:
                out.append(r)
                continue
            elastic.check_against_request(name, burst, r.memory_mib, r.memory_percentage,
                                          r.cores)  # fmt: skip
            out.append(ContainerRequest(r.count, r.memory_mib, r.memory_percentage, r.cores,
                                        r.priority, burst))  # fmt: skip
    except elastic.ElasticError as exc:
        raise RequestError(str(exc)) from exc
    n = len(request.init)
    return PodRequest(init=out[:n], containers=out[n:], sidecars=request.sidecars)


def asks_gpu(containers: list[Any], settings: TesseraSettings) -> bool:
    """Whether any of these containers (as read off a pod, any shape) names one of the device
    resources in its limits or requests, of any device family (NVIDIA's GPU, memory and cores;
    an Ascend, Cambricon or Hygon pod's own; a priority alone holds nothing): how a HAMi-placed
    pod is told to hold device room."""
    from tessera.device_kinds import registry

    keys = registry.device_resources(settings)
    for container in containers:
        resources = container.get("resources") if isinstance(container, dict) else None
        for section in ("limits", "requests"):
            values = resources.get(section) if isinstance(resources, dict) else None
            if isinstance(values, dict) and keys & values.keys():
                return True
    return False


def sidecar_indices(init_containers: list[Any]) -> frozenset[int]:
    """Init containers with `restartPolicy: Always` (Kubernetes' native sidecars)."""
    return frozenset(
        i for i, c in enumerate(init_containers)
        if isinstance(c, dict) and c.get("restartPolicy") == "Always"
    )


def quota_charge(request: PodRequest, card_memory_mib: int | None = None) -> tuple[int, int, int]:
    """(memory MiB, cores, GPUs) charged to the namespace: app containers and native sidecars
    summed over every GPU, other init containers by max. Percentage requests count only when the
    card size is known."""

    from tessera.device_kinds import registry

    def charge(r: ContainerRequest | None) -> tuple[int, int, int]:
        if r is None or not registry.counts_in_quota(r.family):
            return 0, 0, 0  # (another family's devices: Kubernetes' ResourceQuota counts them)
        mem = (
            r.memory_mib
            if r.memory_percentage is None
            else (card_memory_mib * r.memory_percentage // 100 if card_memory_mib else 0)
        )
        return mem * r.count, r.cores * r.count, r.count

    sidecars = [r for i, r in enumerate(request.init) if i in request.sidecars]
    app = [charge(r) for r in [*sidecars, *request.containers]]
    init = [charge(r) for i, r in enumerate(request.init) if i not in request.sidecars]
    totals = tuple(sum(v[i] for v in app) for i in range(3))
    peaks = tuple(max((v[i] for v in init), default=0) for i in range(3))
    return tuple(max(t, p) for t, p in zip(totals, peaks, strict=True))  # type: ignore[return-value]


def quota_grants(containers: list[list[DeviceGrant]]) -> list[list[DeviceGrant]]:
    """`containers` with only the grants whose device family counts in the namespace quota
    (tessera.device_kinds: by the grant's type); the same list when every grant does."""
    from tessera.device_kinds import registry

    if all(registry.family_of_type(g.type).counts_in_quota for c in containers for g in c):
        return containers
    return [[g for g in c if registry.family_of_type(g.type).counts_in_quota] for c in containers]


def grants_quota_charge(
    containers: list[list[DeviceGrant]], init_count: int
) -> tuple[int, int, int]:
    """(memory MiB, cores, GPUs) that granted containers hold against the namespace quota,
    counted as `quota_charge` counts a request: app containers summed, init containers by max
    (only grants of families that count in the quota: `quota_grants`)."""
    containers = quota_grants(containers)

    def total(grants: list[list[DeviceGrant]]) -> tuple[int, int, int]:
        return (
            sum(g.memory_mib for c in grants for g in c),
            sum(g.cores for c in grants for g in c),
            sum(len(c) for c in grants),
        )

    app = total(containers[init_count:])
    peaks = [total([c]) for c in containers[:init_count]]
    return tuple(max([app[i], *(p[i] for p in peaks)]) for i in range(3))  # type: ignore[return-value]


# --- hami.io/vgpu-devices-to-allocate ----------------------------------------------------------

_FORBIDDEN_IN_FIELDS = set(",:;")


def encode_pod_devices(containers: list[list[DeviceGrant]]) -> str:
    """Containers in order (init first), each ended by ';', devices `UUID,TYPE,MEM,CORES:`."""
    out: list[str] = []
    for devices in containers:
        for d in devices:
            if _FORBIDDEN_IN_FIELDS & set(d.uuid + d.type):
                raise ValueError(f"device {d.uuid!r}/{d.type!r} contains a separator")
            out.append(f"{d.uuid},{d.type},{d.memory_mib},{d.cores}:")
        out.append(";")
    return "".join(out)


def parse_pod_devices(text: str) -> list[list[tuple[str, str, int, int]]]:
    """The annotation as (uuid, type, MiB, cores) per device, per container; ValueError on a
    malformed annotation. No models: cheap for a reader such as `tessera get pods`."""
    if text == "":
        return []
    if not text.endswith(";"):
        raise ValueError(f"{ANN_DEVICES_TO_ALLOCATE}: must end with ';': {text[:80]!r}")
    containers: list[list[tuple[str, str, int, int]]] = []
    for part in text.split(";")[:-1]:
        devices: list[tuple[str, str, int, int]] = []
        if part:
            if not part.endswith(":"):
                raise ValueError(f"device list must end with ':': {part[:80]!r}")
            for item in part.split(":")[:-1]:
                fields = item.split(",")
                if len(fields) != 4:
                    raise ValueError(f"device must be UUID,TYPE,MEM,CORES: {item[:80]!r}")
                uuid, dtype, mem, cores = fields
                try:
                    devices.append((uuid, dtype, int(mem), int(cores)))
                except ValueError as exc:
                    raise ValueError(f"bad memory/cores in {item[:80]!r}") from exc
        containers.append(devices)
    return containers


def decode_pod_devices(text: str) -> list[list[DeviceGrant]]:
    """Inverse of encode_pod_devices; ValueError on a malformed annotation."""
    from tessera.models import DeviceGrant

    containers: list[list[DeviceGrant]] = []
    for devices in parse_pod_devices(text):
        grants = []
        for uuid, dtype, mem, cores in devices:
            try:
                grants.append(DeviceGrant(uuid=uuid, type=dtype, memory_mib=mem, cores=cores))
            except ValueError as exc:
                raise ValueError(f"bad memory/cores in {uuid},{dtype},{mem},{cores}") from exc
        containers.append(grants)
    return containers


# --- tessera.io/mig-instances (Tessera's own, scheduler-owned) -------------------------------

# Each grant's dynamic MIG placement, beside hami.io/vgpu-devices-to-allocate (same positions):
# containers ended by ';', each grant `<profile>@<start>/<size>[=<MIG uuid>]:` or `:` for a
# libvgpu slice. Written at bind (placements) and by the node agent once the instances exist
# (with their UUIDs), only for pods holding an instance; read when the ledger is rebuilt.
ANN_MIG_INSTANCES = "tessera.io/mig-instances"


def encode_mig_instances(containers: list[list[DeviceGrant]]) -> str:
    """'' when no grant holds a MIG instance."""
    if not any(g.mig is not None for grants in containers for g in grants):
        return ""
    return "".join(
        "".join(f"{g.mig.profile}@{g.mig.start}/{g.mig.size}"
                + (f"={g.mig.mig_uuid}" if g.mig.mig_uuid else "") + ":"
                if g.mig else ":" for g in grants)
        + ";"
        for grants in containers
    )


def apply_mig_instances(
    containers: list[list[DeviceGrant]], text: str
) -> list[list[DeviceGrant]]:
    """`containers` with the placements of `text` (with a MIG UUID: created, the node agent
    adopts that instance; without: planned); ValueError when `text` is malformed or does not
    match their shape."""
    from tessera.models import MigInstanceGrant, MigState

    parts = text.split(";")
    if not text.endswith(";") or len(parts) - 1 != len(containers):
        raise ValueError(f"{ANN_MIG_INSTANCES}: not one entry per container: {text[:80]!r}")
    out = []
    for grants, part in zip(containers, parts[:-1], strict=True):
        items = part.split(":")[:-1] if part else []
        if len(items) != len(grants) or (part and not part.endswith(":")):
            raise ValueError(f"{ANN_MIG_INSTANCES}: not one entry per GPU: {part[:80]!r}")
        row = []
        for grant, item in zip(grants, items, strict=True):
            if not item:
                row.append(grant)
                continue
            item, _, made = item.partition("=")
            profile, _, rest = item.partition("@")
            start, _, size = rest.partition("/")
            try:
                if made and (not made.startswith("MIG-") or _FORBIDDEN_IN_FIELDS & set(made)):
                    raise ValueError(made)
                placed = MigInstanceGrant(profile=profile, start=int(start), size=int(size),
                                          mig_uuid=made,
                                          state=MigState.CREATED if made else MigState.PLANNED)
            except ValueError as exc:
                raise ValueError(f"{ANN_MIG_INSTANCES}: bad entry {item[:80]!r}") from exc
            row.append(grant.model_copy(update={"mig": placed}))
        out.append(row)
    return out


# --- hami.io/node-nvidia-register --------------------------------------------------------------


def encode_node_register(devices: list[DeviceInfo]) -> str:
    """The JSON form HAMi tooling reads."""
    return json.dumps(
        [
            {
                "id": d.uuid,
                "index": d.index,
                "count": d.split_count,
                "devmem": d.memory_mib,
                "devcore": d.cores,
                "type": d.type,
                "numa": d.numa,
                "mode": d.mode,
                "health": d.healthy,
            }
            for d in devices
        ],
        separators=(",", ":"),
    )


def decode_node_register(text: str, key: str = ANN_NODE_REGISTER) -> list[DeviceInfo]:
    """Either form: the JSON array, or the legacy `UUID,count,devmem,devcore,type,numa,health
    [,index,mode]` items joined by ':' (`key`: the annotation it came from, for the errors)."""
    from tessera.models import DeviceInfo

    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{key}: invalid JSON: {exc}") from exc
        devices = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"{key}: item {i} is not an object")
            if not isinstance(item.get("id"), str):
                raise ValueError(f"{key}: item {i} has no string \"id\"")
            devices.append(
                DeviceInfo(
                    uuid=item["id"],
                    index=item.get("index", i),
                    split_count=item.get("count", 10),
                    memory_mib=item.get("devmem", 0),
                    cores=item.get("devcore", 100),
                    type=item.get("type", ""),
                    numa=item.get("numa", 0),
                    mode=item.get("mode") or "hami-core",
                    healthy=bool(item.get("health", True)),
                )
            )
        return devices
    devices = []
    for i, item in enumerate(p for p in text.split(":") if p):
        fields = item.split(",")
        if len(fields) < 7:
            raise ValueError(f"{key}: legacy item needs 7 fields: {item[:80]!r}")
        try:
            devices.append(
                DeviceInfo(
                    uuid=fields[0],
                    split_count=int(fields[1]),
                    memory_mib=int(fields[2]),
                    cores=int(fields[3]),
                    type=fields[4],
                    numa=int(fields[5]),
                    healthy=fields[6].strip().lower() == "true",
                    index=int(fields[7]) if len(fields) > 7 and fields[7] else i,
                    mode=fields[8] if len(fields) > 8 and fields[8] else "hami-core",
                )
            )
        except ValueError as exc:
            raise ValueError(f"{key}: bad number in {item[:80]!r}") from exc
    return devices


def parse_scoring_weights(text: str) -> tuple[int, int, int]:
    """`slot=1,core=1,memory=3` → (slot, core, memory); all three keys, ints ≥ 0, one > 0."""
    weights: dict[str, int] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("slot", "core", "memory") or key in weights:
            raise RequestError(f"{ANN_SCORING_WEIGHTS}: expected slot=N,core=N,memory=N: {text!r}")
        if not quantity.is_plain_digits(value.strip()):
            raise RequestError(f"{ANN_SCORING_WEIGHTS}: {key} must be an integer >= 0")
        weights[key] = int(value)
    if len(weights) != 3 or not any(weights.values()):
        raise RequestError(f"{ANN_SCORING_WEIGHTS}: give slot, core and memory, one above 0")
    return weights["slot"], weights["core"], weights["memory"]


def parse_scrub_on_free(value: str | None) -> bool:
    """`tessera.io/scrub-on-free`: "true" or "false" (case-insensitive); absent = False."""
    if value is None:
        return False
    text = value.strip().lower()
    if text not in ("true", "false"):
        raise RequestError(f'{ANN_SCRUB_ON_FREE}: "true" or "false", not {value!r}')
    return text == "true"


def scheduler_owned(annotation: str) -> bool:
    """Written only by the scheduler and node agents: NVIDIA's and Tessera's keys above, and
    every device family's HAMi grant record (`hami.io/<vendor>-devices-…`, read back as NVIDIA's
    is: tessera.device_kinds.pod_grants)."""
    if annotation.startswith(SCHEDULER_OWNED_PREFIXES):
        return True
    from tessera.device_kinds.pod_grants import is_grant_key

    return is_grant_key(annotation)


# --- HAMi's own records, read (never written) while a cluster migrates from HAMi ----------------
# A cluster moving from HAMi runs both for a while: nodes registered by HAMi's device plugin and
# pods placed by HAMi's scheduler are read as capacity Tessera must not hand out again. Anything
# in them may be wrong or hostile, so these readers check what they decode and raise ValueError
# with a sentence; the caller quarantines (services/scheduler/foreign.py).

MAX_REGISTER_CHARS = 256 * 1024
MAX_NODE_GPUS = 128
MAX_SPLIT_COUNT = 1024
MAX_CARD_CORES = 100 * 100  # 100 × deviceCoreScaling, generously
MAX_GRANTS_CHARS = 64 * 1024


def read_node_register(text: object, key: str = ANN_NODE_REGISTER) -> list[DeviceInfo]:
    """`hami.io/node-nvidia-register` (or the family's `key`: HAMi's Ascend and DCU plugins
    write the same form) as HAMi's device plugin writes it (either form), checked:
    string ids without separators and unique, 0 < memory ≤ 16 TiB, 1 ≤ count ≤ 1024,
    0 ≤ cores ≤ 10000, at most 128 GPUs. ValueError says what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"{key}: not a string")
    if len(text) > MAX_REGISTER_CHARS:
        raise ValueError(f"{key}: {len(text)} characters (at most "
                         f"{MAX_REGISTER_CHARS})")  # fmt: skip
    try:
        devices = decode_node_register(text, key)
    except ValueError as exc:  # pydantic's ValidationError is one too
        if str(exc).startswith(key):
            raise
        raise ValueError(f"{key}: {' '.join(str(exc).split())[:300]}") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{key}: malformed item ({type(exc).__name__}: {exc})"
                         ) from exc  # fmt: skip
    if len(devices) > MAX_NODE_GPUS:
        raise ValueError(f"{key}: {len(devices)} GPUs (at most {MAX_NODE_GPUS})")
    seen: set[str] = set()
    for d in devices:
        where = f"{key}: GPU {d.uuid[:80]!r}"
        if not d.uuid or _FORBIDDEN_IN_FIELDS & set(d.uuid) or d.uuid in seen:
            raise ValueError(f"{where}: empty, duplicated or containing ',', ':' or ';'")
        seen.add(d.uuid)
        if not 0 < d.memory_mib <= MAX_MEMORY_MIB:
            raise ValueError(f"{where}: devmem {d.memory_mib} MiB is not in 1..{MAX_MEMORY_MIB}")
        if not 1 <= d.split_count <= MAX_SPLIT_COUNT:
            raise ValueError(f"{where}: count {d.split_count} is not in 1..{MAX_SPLIT_COUNT}")
        if not 0 <= d.cores <= MAX_CARD_CORES:
            raise ValueError(f"{where}: devcore {d.cores} is not in 0..{MAX_CARD_CORES}")
    return devices


def read_pod_grants(
    annotations: dict[str, Any], containers: int,
    keys: tuple[str, str] = (ANN_DEVICES_ALLOCATED, ANN_DEVICES_TO_ALLOCATE),
) -> list[list[DeviceGrant]]:
    """The grants a pod placed by HAMi's scheduler holds: `hami.io/vgpu-devices-allocated`, or
    `-to-allocate` while that one lists no device (HAMi's device plugin empties `-to-allocate`
    as it serves the containers; `-allocated` keeps the whole record). `keys`: another device
    family's (allocated, to-allocate) pair (tessera.device_kinds.pod_grants.placed_grants reads
    every family's). Checked: at most one list per container, every device with a UUID,
    memory ≤ 16 TiB, cores ≤ 10000. ValueError says what is wrong; a pod annotated with neither
    key holds nothing ([])."""
    chosen: list[list[DeviceGrant]] = []
    for key in keys:
        text = annotations.get(key)
        if text is None:
            continue
        if not isinstance(text, str) or len(text) > MAX_GRANTS_CHARS:
            raise ValueError(f"{key}: not a string of at most {MAX_GRANTS_CHARS} characters")
        try:
            grants = decode_pod_devices(text)
        except ValueError as exc:
            why = str(exc).removeprefix(f"{ANN_DEVICES_TO_ALLOCATE}: ")
            raise ValueError(f"{key}: {why}") from exc
        if len(grants) > containers:
            raise ValueError(f"{key}: {len(grants)} device lists for {containers} containers")
        for devices in grants:
            for g in devices:
                if not g.uuid or g.memory_mib > MAX_MEMORY_MIB or g.cores > MAX_CARD_CORES:
                    raise ValueError(f"{key}: device {g.uuid[:80]!r} has no UUID or absurd "
                                     f"amounts ({g.memory_mib} MiB, {g.cores} cores)")  # fmt: skip
        if any(grants):
            return grants
        chosen = chosen or grants
    return chosen
