"""What users copy from HAMi's guides, and what can never fit: pure, run before HAMi's rules.

- Aliases (the forms HAMi's guides and books print) are rewritten to the canonical keys, each
  with an AdmissionReview warning naming the canonical key: the `nvidia.com/cores` resource,
  the `hami.io/gpu-type`, `hami.io/gpu-uuid-white-list` and `hami.io/task-priority` annotations.
- Any other `hami.io/*` or `nvidia.com/*` annotation or resource Tessera does not read gets a
  warning, never a silent ignore.
- A request no card or node can ever satisfy is a RequestError naming the field and the unit:
  cores above 100 per card, more GPUs than `TESSERA_MAX_GPUS_PER_NODE`, a binary unit or a
  fraction on the MiB memory resource (`gpumem: 4Gi`, `1.5`), an unknown scheduler policy or
  malformed scoring weights. Every decimal form the API server writes (`3000` arrives as `3k`,
  `1e3` stays `1e3`) is the number of MiB it says.
- A memory request below `IMPLAUSIBLE_MIB` (`gpumem: 4`, someone meaning 4 GB) is admitted
  with a warning naming the value and the MiB to write; a resource under a GPU vendor's domain
  close to a known name of any device family (`nvidia.com/gpumen`) gets "did you mean
  nvidia.com/gpumem".
"""

from __future__ import annotations

import difflib
from decimal import Decimal
from typing import Any

from tessera import hami
from tessera.device_kinds import registry
from tessera.device_kinds.annotation_keys import family_annotation_keys
from tessera.hami import RequestError, parse_quantity
from tessera.quantity import IMPLAUSIBLE_MIB, implausibly_small
from tessera.settings import TesseraSettings

_PREFIXES = ("hami.io/", "nvidia.com/")
_SECTIONS = ("initContainers", "containers")


def apply_compat(pod: dict[str, Any], settings: TesseraSettings, changes: list[str],
                 warnings: list[str]) -> list[str]:
    """Rewrite aliases in `pod` (a writable copy: its containers' resources maps are copies;
    the annotations map is copied here before any change) and refuse what can never fit.
    Returns why the pod, admitted as written, can never be placed (a misspelt GPU resource no
    node offers): it pends, and is counted pending with that reason."""
    _annotations(pod, settings, changes, warnings)
    spec = pod["spec"]
    unplaceable: list[str] = []
    for section in _SECTIONS:
        for index, container in enumerate(spec.get(section) or []):
            name = container.get("name")
            label = name if isinstance(name, str) and name else f"{section}[{index}]"
            _container(container, label, settings, changes, warnings, unplaceable)
    return unplaceable


# --- annotations --------------------------------------------------------------------------------


def _annotations(pod: dict[str, Any], settings: TesseraSettings, changes: list[str],
                 warnings: list[str]) -> None:
    metadata = pod.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("annotations"), dict):
        return
    annotations = dict(metadata["annotations"])
    for alias, canonical in hami.ANNOTATION_ALIASES.items():
        if alias not in annotations:
            continue
        value = annotations[alias]
        if canonical in annotations and annotations[canonical] != value:
            warnings.append(f"annotation {alias} is an alias of {canonical}; both are set, "
                            f"{canonical}={annotations[canonical]!r} is used")
            continue
        annotations[canonical] = value
        changes.append(f"annotation {canonical} copied from its alias {alias}")
        warnings.append(f"annotation {alias} is read as {canonical} (the canonical key); "
                        f"write {canonical} instead")
    priority = annotations.get(hami.ANN_ALIAS_TASK_PRIORITY)
    if priority is not None:
        _task_priority(pod, str(priority), settings, changes, warnings)
    _check_policies(annotations)
    for key in sorted(annotations):
        if (isinstance(key, str) and key.startswith(_PREFIXES)
                and key not in hami.KNOWN_ANNOTATIONS and not hami.scheduler_owned(key)
                and key not in family_annotation_keys()):
            warnings.append(f"annotation {key} is not a key Tessera (or HAMi) reads; it is "
                            "ignored — check its spelling")
    metadata = pod["metadata"] = dict(metadata)
    metadata["annotations"] = annotations


def _task_priority(pod: dict[str, Any], value: str, settings: TesseraSettings,
                   changes: list[str], warnings: list[str]) -> None:
    priority = hami.task_priority_to_priority(value)
    key = settings.resource_priority
    for section in _SECTIONS:
        for container in pod["spec"].get(section) or []:
            limits = _limits(container)
            asks_gpu = any(r in limits or r in _requests(container) for r in (
                settings.resource_name, settings.resource_mem, settings.resource_mem_percentage,
                settings.resource_cores, hami.RESOURCE_ALIAS_CORES))
            if not asks_gpu or key in limits or key in _requests(container):
                continue
            limits[key] = str(priority)
            changes.append(f"{container.get('name', '?')}: {key}={priority} from "
                           f"{hami.ANN_ALIAS_TASK_PRIORITY}={value}")
    level = "high" if priority == 0 else "low"
    warnings.append(f"annotation {hami.ANN_ALIAS_TASK_PRIORITY}={value} is read as {key}: "
                    f"{priority} ({level}; above 0 = high) — write {key} in the container's "
                    "limits instead")


def _check_policies(annotations: dict[str, Any]) -> None:
    for key, allowed, chain in (
        (hami.ANN_GPU_POLICY, hami.GPU_SCHEDULER_POLICIES, True),
        (hami.ANN_NODE_POLICY, hami.NODE_SCHEDULER_POLICIES, False),
    ):
        value = annotations.get(key)
        if value is None:
            continue
        parts = [p.strip().lower() for p in str(value).split(",") if p.strip()]
        unknown = [p for p in parts if p not in allowed]
        if not parts or unknown or (not chain and len(parts) != 1):
            raise RequestError(
                f"annotation {key}: {value!r} is not a scheduler policy; use "
                f"{'one or a comma chain' if chain else 'one'} of {', '.join(allowed)}"
            )
    weights = annotations.get(hami.ANN_SCORING_WEIGHTS)
    if weights is not None:
        hami.parse_scoring_weights(str(weights))


# --- one container ------------------------------------------------------------------------------


def _limits(container: dict[str, Any]) -> dict[str, Any]:
    resources = container.get("resources")
    if not isinstance(resources, dict):
        resources = container["resources"] = {}
    if not isinstance(resources.get("limits"), dict):
        resources["limits"] = {}
    return resources["limits"]


def _requests(container: dict[str, Any]) -> dict[str, Any]:
    resources = container.get("resources")
    requests = resources.get("requests") if isinstance(resources, dict) else None
    return requests if isinstance(requests, dict) else {}


def _container(container: dict[str, Any], label: str, settings: TesseraSettings,
               changes: list[str], warnings: list[str], unplaceable: list[str]) -> None:
    resources = container.get("resources")
    if not isinstance(resources, dict):
        return
    known = set(registry.resource_map(settings))  # every family's names
    for section in ("limits", "requests"):
        values = resources.get(section)
        if not isinstance(values, dict):
            continue
        alias, canonical = hami.RESOURCE_ALIAS_CORES, settings.resource_cores
        if alias in values and alias != canonical:
            if canonical in values and values[canonical] != values[alias]:
                raise RequestError(
                    f"container {label}: {section} sets both {alias} ({values[alias]!r}) and "
                    f"{canonical} ({values[canonical]!r}); {alias} is an alias of {canonical}, "
                    "keep one"
                )
            values[canonical] = values.pop(alias)
            changes.append(f"{label}: {section} {alias} renamed {canonical}")
            warnings.append(f"container {label}: {alias} is read as {canonical} (the canonical "
                            f"resource); write {canonical} instead")
        for key in sorted(k for k in values if isinstance(k, str)):
            if key not in known and key != alias and (
                    key.startswith(_PREFIXES) or misspelt_resource(key, settings)):
                guess = misspelt_resource(key, settings)
                hint = f"did you mean {guess}? " if guess else ""
                if guess:
                    unplaceable.append(f"container {label}: resource {key} (did you mean "
                                       f"{guess}?) is offered by no node")
                warnings.append(f"container {label}: resource {key} is not one Tessera (or "
                                f"HAMi) manages; {hint}it is ignored by the GPU scheduler — "
                                "check its spelling")
        _never_fits(values, label, section, settings)
        _implausible_memory(values, label, section, settings, warnings)


def _quantity(value: object) -> Decimal:
    """The value, or 0 when it is no quantity at all (the request parser denies those, naming
    the container)."""
    try:
        return parse_quantity(value) if value is not None else Decimal(0)
    except RequestError:
        return Decimal(0)


def misspelt_resource(key: str, settings: TesseraSettings) -> str | None:
    """The known GPU resource `key` is most likely a typo of (same vendor domain, close
    spelling: `nvidia.com/gpumen` → `nvidia.com/gpumem`), else None."""
    domain, slash, name = key.partition("/")
    if not slash:
        return None
    known = [*registry.resource_map(settings), hami.RESOURCE_ALIAS_CORES]
    same_domain = {k.partition("/")[2]: k for k in known if k.partition("/")[0] == domain}
    close = difflib.get_close_matches(name, list(same_domain), n=1, cutoff=0.75)
    return same_domain[close[0]] if close and same_domain[close[0]] != key else None


def _implausible_memory(values: dict[str, Any], label: str, section: str,
                        settings: TesseraSettings, warnings: list[str]) -> None:
    memory = values.get(settings.resource_mem)
    try:
        mib = hami.memory_mib(memory, settings.resource_mem) if memory is not None else 0
    except RequestError:
        return  # the request parser refuses it, naming the container
    if implausibly_small(mib):
        warnings.append(
            f"container {label}: {section} {settings.resource_mem}: {memory!r} is {mib} MiB of "
            f"device memory, implausibly small (below {IMPLAUSIBLE_MIB} MiB; a CUDA context "
            f"alone takes more); the value is MiB: for {mib} GB write {settings.resource_mem}: "
            f"{mib * 1000}, for {mib} GiB {mib * 1024}"
        )


def _never_fits(values: dict[str, Any], label: str, section: str,
                settings: TesseraSettings) -> None:
    where = f"container {label}: {section}"
    memory = values.get(settings.resource_mem)
    if memory is not None:  # a binary unit (bytes) or a fraction: say what to write instead
        hami.memory_mib(memory, settings.resource_mem, f"{where} ")
    # Absurd values (1e400) are left to the request parser, which calls them that.
    cores = values.get(settings.resource_cores)
    if 100 < _quantity(cores) <= 10**9:
        raise RequestError(
            f"{where} {settings.resource_cores}: {cores!r} is more than a card has; it is a "
            "percentage of one GPU's compute per GPU, 0 to 100 (100 = a whole card; ask more "
            f"GPUs with {settings.resource_name} for more)"
        )
    count = values.get(settings.resource_name)
    if settings.max_gpus_per_node < _quantity(count) <= hami.MAX_GPU_COUNT:
        raise RequestError(
            f"{where} {settings.resource_name}: {count!r} GPUs is more than any node has (at "
            f"most {settings.max_gpus_per_node}, TESSERA_MAX_GPUS_PER_NODE); all GPUs of a "
            "container come from one node"
        )
