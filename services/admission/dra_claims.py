"""A HAMi pod as DRA claims: the webhook's conversion in DRA mode (pure).

In DRA mode (`TESSERA_ALLOCATION_MODE=dra`, or a pod annotated `tessera.io/allocation-mode:
dra`; `extender` on a pod keeps it in extender mode), every container that asks for GPUs with
HAMi's resources (`nvidia.com/gpu`, `gpumem`, `gpumem-percentage`, `gpucores`, after HAMi's
normalisation) gets instead a claim made from a ResourceClaimTemplate, and kube-scheduler's
structured allocator places the pod. The template says, per container:

- one request `gpu` of Tessera's DeviceClass, `count` = the GPU count, with
  `capacity.requests {memory: <MiB>Mi, cores: <percent>}` (consumable capacity, KEP-5075);
  a memory percentage becomes a `firstAvailable` list with one sub-request per card size the
  cluster publishes (that size's selector, that share of it): the allocator tries them in order;
  100 % (or no memory at all) asks no memory and takes the request policy's default, the card;
- CEL selectors for HAMi's annotations: `nvidia.com/use-gputype` / `nouse-gputype` (a
  case-insensitive substring of the device type), `use-gpuuuid` / `nouse-gpuuuid` (exact UUIDs);
- `nvidia.com/vgpu-mode` picks the DeviceClass: `hami-core` (or none) Tessera's slices,
  `mps` the MPS cards' class (`mps.gpu.tessera.io`, whose configuration selects MPS sharing),
  `mig` the MIG partitions' class (`mig.gpu.tessera.io`): HAMi's MIG mode gives a container the
  smallest instance profile covering its memory and compute, so the request is a
  `firstAvailable` list of the covering profiles the cluster publishes, smallest first, each
  selecting that profile (the allocator takes the first that fits anywhere);
- a container asking NVIDIA's MIG resources (`nvidia.com/mig-<profile>: N`, the device plugin's
  mixed strategy, which HAMi serves too) gets a claim with one request per profile: N devices of
  `mig.gpu.tessera.io` selecting that profile (the dynamic-MIG partitions);
- constraints: several GPUs are distinct cards (`distinctAttribute` uuid), and
  `nvidia.com/numa-bind: "true"` keeps them on one NUMA node (`matchAttribute` numa).

Why the webhook and not only `DeviceClass.spec.extendedResourceName` (KEP-5004): the mapping
gives a pod asking `nvidia.com/gpu: N` a claim for N whole devices of the class, with each
capacity's default: it cannot carry `gpumem`/`gpucores` (other extended resources, not device
counts) nor HAMi's annotations. So the DeviceClass maps `nvidia.com/gpu` for pods the webhook
never sees (whole cards, the request policy's defaults), and the webhook converts everything
that carries a slice. Templates are named by a hash of their spec, so identical asks share one
template per namespace and creating one is idempotent.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from tessera import hami
from tessera import mig as mig_tables
from tessera.hami import ContainerRequest, PodRequest
from tessera.quantity import is_plain_digits
from tessera.settings import TesseraSettings

DRIVER = "gpu.tessera.io"
DEVICE_CLASS = "gpu.tessera.io"
MIG_DEVICE_CLASS = "mig.gpu.tessera.io"
MPS_DEVICE_CLASS = "mps.gpu.tessera.io"
ANN_ALLOCATION_MODE = "tessera.io/allocation-mode"
CLAIM_PREFIX = "tessera-gpu"
REQUEST = "gpu"
_ATTR = f'device.attributes["{DRIVER}"]'
_CAP = f'device.capacity["{DRIVER}"]'
SECTIONS = ("initContainers", "containers")
# resource.k8s.io/v1's limits on a claim spec (kube-apiserver refuses a template beyond them)
MAX_ALTERNATIVES = 8  # firstAvailable sub-requests of one request
MAX_CEL_BYTES = 10 * 1024  # one selector's CEL expression
FULL_CARD_CORES = 100  # a MIG profile holding every compute slice of its card (7g)


class ConversionError(ValueError):
    """The pod cannot be converted; the message says what to change."""


@dataclass(frozen=True)
class MigProfileOffer:
    """A MIG profile some DRA node publishes partitions of (its memory and compute share)."""

    name: str
    memory_mib: int
    cores: int


@dataclass(frozen=True)
class Published:
    """What Tessera's driver publishes, as the conversion needs it: card sizes (MiB) per mode
    (`hami-core`, `mps`) and the MIG profiles offered."""

    card_memories: dict[str, list[int]] = field(default_factory=dict)
    mig_profiles: tuple[MigProfileOffer, ...] = ()


def class_for(annotations: dict[str, Any]) -> str:
    """The DeviceClass HAMi's `nvidia.com/vgpu-mode` asks (HAMi's own mode first)."""
    value = annotations.get(hami.ANN_VGPU_MODE)
    modes = set(_strings(value.lower())) if isinstance(value, str) else set()
    if not modes or "hami-core" in modes:
        return DEVICE_CLASS
    if "mps" in modes:
        return MPS_DEVICE_CLASS
    if "mig" in modes:
        return MIG_DEVICE_CLASS
    raise ConversionError(f"{hami.ANN_VGPU_MODE}: {value!r} names no mode DRA mode serves "
                          "(hami-core, mps, mig)")  # fmt: skip


@dataclass(frozen=True)
class DraPlan:
    """What `decide` hands the I/O layer: the pod as HAMi's rules left it, and its requests."""

    mutated: dict[str, Any]
    request: PodRequest
    namespace: str


@dataclass
class Conversion:
    pod: dict[str, Any]
    templates: list[dict[str, Any]] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def wanted(pod: dict[str, Any], settings: TesseraSettings) -> bool:
    """Whether this pod is converted to claims (the setting, or the pod's annotation)."""
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    asked = annotations.get(ANN_ALLOCATION_MODE) if isinstance(annotations, dict) else None
    if asked in ("dra", "extender"):
        return asked == "dra"
    return getattr(settings, "allocation_mode", "extender") == "dra"


def _strings(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _type_has(part: str) -> str:
    """HAMi's type match, a case-insensitive substring, as a CEL regular expression (RE2)."""
    return f"{_ATTR}.type.matches({json.dumps('(?i)' + re.escape(part))})"


def _cel_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def selectors(annotations: dict[str, Any]) -> list[str]:
    """CEL expressions for HAMi's selection annotations."""

    def text(key: str) -> str:
        value = annotations.get(key)
        return value if isinstance(value, str) else ""

    def add(key: str, expression: str) -> None:
        size = len(expression.encode())
        if size > MAX_CEL_BYTES:
            raise ConversionError(
                f"{key} lists too much for a DRA device selector: its CEL expression would be "
                f"{size} bytes, and Kubernetes takes at most {MAX_CEL_BYTES}: list fewer")
        out.append(expression)

    out: list[str] = []
    use_types = _strings(text(hami.ANN_USE_GPUTYPE))
    if use_types:
        add(hami.ANN_USE_GPUTYPE, " || ".join(_type_has(t) for t in use_types))
    nouse_types = _strings(text(hami.ANN_NOUSE_GPUTYPE))
    if nouse_types:  # one selector, however many types (a request takes at most 32)
        add(hami.ANN_NOUSE_GPUTYPE, f"!({' || '.join(_type_has(t) for t in nouse_types)})")
    use_uuids = _strings(text(hami.ANN_USE_GPUUUID))
    if use_uuids:
        add(hami.ANN_USE_GPUUUID, f"{_ATTR}.uuid in {_cel_list(use_uuids)}")
    nouse = _strings(text(hami.ANN_NOUSE_GPUUUID))
    if nouse:
        add(hami.ANN_NOUSE_GPUUUID, f"!({_ATTR}.uuid in {_cel_list(nouse)})")
    return out


def _exact(count: int, cel: list[str], memory_mib: int | None, cores: int | None,
           device_class: str = DEVICE_CLASS) -> dict[str, Any]:  # fmt: skip
    exact: dict[str, Any] = {
        "deviceClassName": device_class, "allocationMode": "ExactCount", "count": count,
    }  # fmt: skip
    if cores is not None:  # a MIG partition is not shared: no capacity requests
        requests: dict[str, str] = {"cores": str(cores)}
        if memory_mib is not None:
            requests["memory"] = f"{memory_mib}Mi"
        exact["capacity"] = {"requests": requests}
    if cel:
        exact["selectors"] = [{"cel": {"expression": e}} for e in cel]
    return exact


def _mig_request(ask: ContainerRequest, cel: list[str], profiles: tuple[MigProfileOffer, ...],
                 warnings: list[str]) -> dict[str, Any]:  # fmt: skip
    """HAMi's MIG mode: the smallest published profile covering the ask, tried in order (the
    smallest 8: a request lists at most 8 alternatives)."""
    whole_card = ask.memory_percentage is not None  # 100 %: only a full-card profile covers it
    covering = sorted(
        {p for p in profiles
         if (p.cores >= FULL_CARD_CORES if whole_card else p.memory_mib >= ask.memory_mib)
         and p.cores >= ask.cores},
        key=lambda p: (p.memory_mib, p.cores, p.name),
    )  # fmt: skip
    if ask.memory_percentage is not None and ask.memory_percentage < 100:
        raise ConversionError(
            "a MIG instance is asked by size: nvidia.com/gpumem (MiB) and gpucores, not a "
            "memory percentage (vgpu-mode mig)")  # fmt: skip
    if not covering:
        offered = ", ".join(sorted({p.name for p in profiles})) or "none"
        raise ConversionError(
            f"no MIG profile published in DRA mode covers {ask.memory_mib} MiB and {ask.cores} "
            f"% of compute (profiles offered: {offered}): ask less, or run the pod in extender "
            "mode")  # fmt: skip
    names = list(dict.fromkeys(p.name for p in covering))
    if len(names) > MAX_ALTERNATIVES:
        warnings.append(
            f"MIG profiles {', '.join(names[MAX_ALTERNATIVES:])} left out: a DRA request lists "
            f"at most {MAX_ALTERNATIVES} alternatives, so the {MAX_ALTERNATIVES} smallest that "
            "cover the ask are tried")  # fmt: skip
        names = names[:MAX_ALTERNATIVES]
    return {"name": REQUEST, "firstAvailable": [
        {"name": "mig-" + name.replace(".", "-"),
         **_exact(ask.count, [*cel, f"{_ATTR}.profile == {json.dumps(name)}"], None, None,
                  MIG_DEVICE_CLASS)}
        for name in names
    ]}  # fmt: skip


def claim_spec(ask: ContainerRequest, annotations: dict[str, Any],
               card_memories: list[int] | Published,
               warnings: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The ResourceClaim spec one container's HAMi request becomes (`warnings`: what the user
    should know about it, e.g. card sizes left out)."""
    warnings = [] if warnings is None else warnings
    published = (card_memories if isinstance(card_memories, Published) else
                 Published({"hami-core": list(card_memories), "mps": list(card_memories)}))
    device_class = class_for(annotations)
    if device_class == MPS_DEVICE_CLASS and ask.count > 1:
        raise ConversionError(
            f"nvidia.com/gpu: {ask.count} in MPS mode: an MPS client reaches one card's daemon, "
            "so an MPS container holds one GPU (as in extender mode)")  # fmt: skip
    cel = selectors(annotations)
    pct = ask.memory_percentage
    request: dict[str, Any] = {"name": REQUEST}
    sizes = published.card_memories.get("mps" if device_class == MPS_DEVICE_CLASS
                                         else "hami-core", [])  # fmt: skip
    if device_class == MIG_DEVICE_CLASS:
        request = _mig_request(ask, cel, published.mig_profiles, warnings)
    elif pct is not None and pct < 100:
        if not sizes:
            raise ConversionError(
                f"a GPU memory percentage needs the card sizes, and no {DRIVER} ResourceSlice "
                "is published yet: ask nvidia.com/gpumem (MiB) instead, or retry once a DRA "
                "node is up")  # fmt: skip
        tried = sorted(set(sizes), reverse=True)  # the largest card first
        if len(tried) > MAX_ALTERNATIVES:
            left = ", ".join(f"{m} MiB" for m in tried[MAX_ALTERNATIVES:])
            warnings.append(
                f"{pct} % of a card: cards of {left} left out (a DRA request lists at most "
                f"{MAX_ALTERNATIVES} alternatives; the {MAX_ALTERNATIVES} largest card sizes are "
                "tried): ask nvidia.com/gpumem (MiB) to fit any card")  # fmt: skip
            tried = tried[:MAX_ALTERNATIVES]
        request["firstAvailable"] = [
            {"name": f"mem{size}", **_exact(
                ask.count, [*cel, f'{_CAP}.memory.compareTo(quantity("{size}Mi")) == 0'],
                size * pct // 100, ask.cores, device_class)}
            for size in tried
        ]  # fmt: skip
    else:
        memory = ask.memory_mib if (pct is None and ask.memory_mib > 0) else None
        request["exactly"] = _exact(ask.count, cel, memory, ask.cores, device_class)
    constraints: list[dict[str, Any]] = []
    if ask.count > 1:
        constraints.append({"requests": [REQUEST], "distinctAttribute": f"{DRIVER}/uuid"})
        if str(annotations.get(hami.ANN_NUMA_BIND, "")).lower() == "true":
            constraints.append({"requests": [REQUEST], "matchAttribute": f"{DRIVER}/numa"})
    spec: dict[str, Any] = {"devices": {"requests": [request]}}
    if constraints:
        spec["devices"]["constraints"] = constraints
    return spec


def mig_asks(container: Any) -> dict[str, int]:
    """`nvidia.com/mig-<profile>: N` of a container (limits, else requests): profile → N;
    ConversionError for a malformed profile or count."""
    if not isinstance(container, dict) or not isinstance(container.get("resources"), dict):
        return {}
    out: dict[str, int] = {}
    for part in ("requests", "limits"):  # limits win, as kubelet takes them for extended ones
        values = container["resources"].get(part)
        if not isinstance(values, dict):
            continue
        for key, value in values.items():
            if not isinstance(key, str) or not key.startswith(mig_tables.MIG_RESOURCE_PREFIX):
                continue
            profile = key[len(mig_tables.MIG_RESOURCE_PREFIX):]
            try:
                mig_tables.parse_profile_name(profile)
            except mig_tables.MigError as exc:
                raise ConversionError(f"{key}: {exc}") from None
            count = value if isinstance(value, int) else (
                int(value) if isinstance(value, str) and is_plain_digits(value) else -1)
            if isinstance(value, bool) or count < 1:
                raise ConversionError(f"{key}: {value!r} is not a whole number of instances ≥ 1")
            out[profile] = count
    return out


def asks_mig_resources(pod: dict[str, Any]) -> bool:
    """Whether a container asks `nvidia.com/mig-*` (a malformed ask too: the conversion denies
    it with the reason)."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    try:
        return any(mig_asks(c) for section in SECTIONS for c in spec.get(section) or [])
    except ConversionError:
        return True


def mig_claim_spec(asks: dict[str, int], annotations: dict[str, Any]) -> dict[str, Any]:
    """One request per MIG profile a container asks (NVIDIA's `nvidia.com/mig-<profile>`)."""
    cel = selectors(annotations)
    return {"devices": {"requests": [
        {"name": "mig-" + profile.replace(".", "-"), "exactly": _exact(
            count, [*cel, f"{_ATTR}.profile == {json.dumps(profile)}"], None, None,
            MIG_DEVICE_CLASS)}
        for profile, count in sorted(asks.items())
    ]}}  # fmt: skip


def _strip_mig_resources(container: dict[str, Any]) -> None:
    resources = container.get("resources") or {}
    for part in ("limits", "requests"):
        values = resources.get(part)
        if isinstance(values, dict):
            for key in [k for k in values if isinstance(k, str)
                        and k.startswith(mig_tables.MIG_RESOURCE_PREFIX)]:  # fmt: skip
                del values[key]
            if not values:
                del resources[part]


def template_for(spec: dict[str, Any]) -> dict[str, Any]:
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": f"{CLAIM_PREFIX}-{digest}",
                     "labels": {"app.kubernetes.io/managed-by": "tessera-admission"}},
        "spec": {"spec": spec},
    }  # fmt: skip


def _strip_gpu_resources(container: dict[str, Any], settings: TesseraSettings) -> None:
    names = {
        settings.resource_name,
        settings.resource_mem,
        settings.resource_mem_percentage,
        settings.resource_cores,
        settings.resource_priority,
        "nvidia.com/cores",
    }
    resources = container.get("resources") or {}
    for part in ("limits", "requests"):
        values = resources.get(part)
        if isinstance(values, dict):
            for name in names & set(values):
                del values[name]
            if not values:
                del resources[part]


def strip_stray_resources(pod: dict[str, Any], settings: TesseraSettings,
                          changes: list[str]) -> None:
    """A container that asks no GPU but carries one of HAMi's resources (`nvidia.com/priority`
    alone): in DRA mode no device plugin serves that name, so kubelet would never admit the pod.
    The env HAMi's rules derived from it stays; the resource goes."""
    names = set(settings.resource_names())
    for section in SECTIONS:
        for index, container in enumerate(pod["spec"].get(section) or []):
            if not isinstance(container, dict):
                continue
            resources = container.get("resources")
            if not isinstance(resources, dict):
                continue
            held = [n for part in ("limits", "requests")
                    if isinstance(values := resources.get(part), dict)
                    for n in values if n in names]  # fmt: skip
            if held:
                _strip_gpu_resources(container, settings)
                label = container.get("name") or f"{section}[{index}]"
                changes.append(f"{label}: {', '.join(sorted(set(held)))} removed (asks no GPU; "
                               "nothing serves it in DRA mode)")  # fmt: skip


def convert(plan: DraPlan, settings: TesseraSettings,
            card_memories: list[int] | Published) -> Conversion:  # fmt: skip
    """The pod with claims instead of HAMi's resources, and the templates it names."""
    pod = copy.deepcopy(plan.mutated)
    spec = pod["spec"]
    metadata = pod.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict):
        annotations = {}  # (HAMi's rules judged them already; a non-object holds no knob)
    out = Conversion(pod)
    asks = plan.request.all
    claims = [c for c in spec.get("resourceClaims") or [] if isinstance(c, dict)]
    taken = {c.get("name") for c in claims}
    position = 0
    by_name: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        for container in spec.get(section) or []:
            ask = asks[position] if position < len(asks) else None
            position += 1
            migs = mig_asks(container)
            if ask is None and not migs:
                continue
            if ask is not None and migs:
                raise ConversionError(
                    f"container {container.get('name') or position - 1} asks GPU slices and "
                    f"MIG instances ({', '.join(sorted(migs))}): one Tessera claim per "
                    "container in DRA mode; ask one or the other")  # fmt: skip
            notes: list[str] = []
            spec_of = (claim_spec(ask, annotations, card_memories, notes) if ask is not None
                       else mig_claim_spec(migs, annotations))  # fmt: skip
            template = template_for(spec_of)
            _strip_mig_resources(container)
            name = template["metadata"]["name"]
            by_name.setdefault(name, template)
            local = f"{CLAIM_PREFIX}-{position - 1}"
            while local in taken:
                local += "x"
            taken.add(local)
            claims.append({"name": local, "resourceClaimTemplateName": name})
            _strip_gpu_resources(container, settings)
            resources = container.setdefault("resources", {})
            resources.setdefault("claims", []).append({"name": local})
            label = container.get("name") or f"{section}[{position - 1}]"
            out.warnings.extend(f"container {label}: {note}" for note in notes)
            out.changes.append(f"{label}: GPU request converted to claim {local} "
                               f"(ResourceClaimTemplate {name})")  # fmt: skip
    spec["resourceClaims"] = claims
    if spec.get("schedulerName") == settings.scheduler_name:
        # kube-scheduler's DRA allocator places claims; the extender has nothing to decide
        del spec["schedulerName"]
        out.changes.append("schedulerName removed (DRA: kube-scheduler's allocator places it)")
    out.templates = list(by_name.values())
    return out
