"""HAMi's webhook rules as pure functions: a pod and the settings in, a patch or a denial out.

The order is the one of specs/hami-compat.md ("Webhook rules, in order"). Nothing here does I/O:
the quota verdict is asked for by the caller and folded in with `apply_quota_verdict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jsonpatch

from tessera.device_kinds import AdmissionNotes, registry
from tessera.hami import (
    ContainerRequest,
    PodRequest,
    RequestError,
    quota_charge,
    scheduler_owned,
    sidecar_indices,
)
from tessera.settings import TesseraSettings

from . import dra_claims
from .compat import apply_compat
from .dra_claims import DraPlan
from .elastic import ELASTIC_INVALID, elastic_problem

DEFAULT_SCHEDULER = "default-scheduler"
CONTAINER_SECTIONS = ("initContainers", "containers")
_MISSING = object()

# Machine-readable denial reasons (metric labels, event reasons); the message says the rest.
NO_CONTAINERS = "NoContainers"
INVALID_POD = "InvalidPod"
INVALID_REQUEST = "InvalidRequest"
SCHEDULER_OWNED_ANNOTATION = "SchedulerOwnedAnnotation"
PRIVILEGED_CONTAINER = "PrivilegedContainer"
NODE_NAME_PRESET = "NodeNamePreset"
QUOTA_EXCEEDED = "QuotaExceeded"
QUOTA_UNAVAILABLE = "QuotaUnavailable"


@dataclass(frozen=True)
class Denial:
    """The pod is refused; `message` is what the person who created it reads."""

    reason: str
    message: str
    code: int = 403


@dataclass(frozen=True)
class QuotaAsk:
    """What the namespace would be charged (hami.quota_charge of the normalised pod)."""

    namespace: str
    name: str
    memory_mib: int
    cores: int
    gpus: int


@dataclass(frozen=True)
class Admitted:
    """The pod is allowed, with `patch` (RFC 6902 operations; empty = unchanged)."""

    patch: list[dict[str, Any]] = field(default_factory=list)
    changes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    quota: QuotaAsk | None = None
    note: str = ""
    # why the pod as written can never be placed (a misspelt GPU resource): counted pending
    unplaceable: str = ""
    # DRA mode: the claims conversion still to do (dra_claims.py; the app creates templates)
    dra: DraPlan | None = None

    @property
    def summary(self) -> str:
        """One sentence for events and logs."""
        return "; ".join(self.changes) if self.changes else self.note


Decision = Admitted | Denial


@dataclass(frozen=True)
class QuotaVerdict:
    """The quota service's answer: fits True/False, or None when it did not answer."""

    fits: bool | None
    reason: str = ""


# --- the rules --------------------------------------------------------------------------------


def decide_update(old: Any, new: Any, username: str, settings: TesseraSettings) -> Decision:
    """A pod update may not add, change or remove scheduler-owned annotations, unless it comes
    from a trusted identity (the scheduler's and node agent's service accounts)."""
    prefixes = [p.strip() for p in settings.admission_trusted_user_prefixes.split(",") if p.strip()]
    if username and any(username.startswith(p) for p in prefixes):
        return Admitted(note="update by a trusted Tessera component")
    # Rule 2 as on creation: a pod routed to another scheduler (HAMi's, while a cluster
    # migrates) is that scheduler's to annotate. The stored pod's name is judged: a pod's
    # schedulerName cannot change once it exists, so none of ours becomes another's.
    spec = old.get("spec") if isinstance(old, dict) else None
    scheduler = spec.get("schedulerName") if isinstance(spec, dict) else None
    if scheduler not in (None, "", DEFAULT_SCHEDULER, settings.scheduler_name):
        return Admitted(note=f"routed to scheduler {scheduler!r}; left unchanged")
    before, after = _owned_annotations(old), _owned_annotations(new)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        return Denial(
            SCHEDULER_OWNED_ANNOTATION,
            f"annotation(s) {', '.join(changed)} are written only by {settings.scheduler_name}; "
            f"{username or 'this user'} may not change them",
        )
    return Admitted(note="update leaves scheduler-owned annotations alone")


def _owned_annotations(pod: Any) -> dict[str, Any]:
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if not isinstance(annotations, dict):
        return {}
    return {k: v for k, v in annotations.items() if isinstance(k, str) and scheduler_owned(k)}


def decide(pod: Any, namespace: str, settings: TesseraSettings) -> Decision:
    """Every rule but the quota check, in HAMi's order."""
    if not isinstance(pod, dict):
        return Denial(INVALID_POD, "the request carries no pod object", 400)
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return Denial(INVALID_POD, "pod has no spec", 400)
    # Rule 1: no containers.
    containers = spec.get("containers")
    if not containers:
        return Denial(NO_CONTAINERS, "pod has no containers", 400)
    init = spec.get("initContainers") or []
    if not isinstance(containers, list) or not isinstance(init, list):
        return Denial(INVALID_POD, "spec.containers and spec.initContainers must be lists", 400)
    if not all(isinstance(c, dict) for c in [*init, *containers]):
        return Denial(INVALID_POD, "every container must be an object", 400)

    # Rule 2: pods routed to another scheduler are none of our business.
    scheduler = spec.get("schedulerName")
    if scheduler not in (None, "", DEFAULT_SCHEDULER, settings.scheduler_name):
        return Admitted(note=f"routed to scheduler {scheduler!r}; left unchanged")

    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") if isinstance(metadata, dict) else None
    if isinstance(annotations, dict):
        owned = sorted(key for key in annotations if isinstance(key, str) and scheduler_owned(key))
        if owned:
            return Denial(
                SCHEDULER_OWNED_ANNOTATION,
                f"annotation(s) {', '.join(owned)} are written only by {settings.scheduler_name}; "
                "remove them from the pod (or its template) and create it again",
            )

    # Rule 3: each init container, then each container, on a copy we are free to change.
    mutated = _writable_copy(pod)
    changes: list[str] = []
    warnings: list[str] = []
    requests: dict[str, list[ContainerRequest | None]] = {}
    try:
        # aliases, what can never fit, what no node offers (a misspelt GPU resource)
        unplaceable = "; ".join(apply_compat(mutated, settings, changes, warnings))
        for section in CONTAINER_SECTIONS:
            requests[section] = [
                _normalise_container(
                    container, _container_label(container, section, index), settings, changes,
                    warnings,
                )
                for index, container in enumerate(mutated["spec"].get(section) or [])
            ]
        _check_selections(mutated, requests)
    except RequestError as exc:
        return Denial(INVALID_REQUEST, str(exc), 400)
    normalised = PodRequest(init=requests["initContainers"], containers=requests["containers"],
                            sidecars=sidecar_indices(init))
    gpu_pod = normalised.wants_gpu
    if (problem := elastic_problem(mutated, normalised)) is not None:  # docs/elastic.md
        return Denial(ELASTIC_INVALID, problem)

    if gpu_pod:
        # Rule 4: a privileged container sees every GPU of the node, whatever it asked for.
        for section in CONTAINER_SECTIONS:
            for index, container in enumerate(spec.get(section) or []):
                if _privileged(container):
                    label = _container_label(container, section, index)
                    return Denial(
                        PRIVILEGED_CONTAINER,
                        f"container {label} is privileged; a privileged container sees every GPU "
                        "on the node, so a pod asking for GPU slices may not run one. Remove "
                        "securityContext.privileged or move that container to another pod",
                    )
        # Rule 5: our scheduler places GPU pods; a preset node would bypass it.
        node_name = spec.get("nodeName")
        if node_name:
            return Denial(
                NODE_NAME_PRESET,
                f"spec.nodeName is preset to {node_name!r}; GPU pods are placed by "
                f"{settings.scheduler_name}. Remove spec.nodeName and use a nodeSelector or node "
                "affinity to choose nodes",
            )
    mig_resources = dra_claims.wanted(pod, settings) and dra_claims.asks_mig_resources(mutated)
    if (gpu_pod or mig_resources) and dra_claims.wanted(pod, settings):  # DRA: claims
        return Admitted([], tuple(changes), tuple(warnings), _quota_ask(pod, normalised, namespace),
                        "GPU request converted to ResourceClaims", unplaceable,
                        dra=dra_claims.DraPlan(mutated, normalised, namespace))
    if not gpu_pod and dra_claims.wanted(pod, settings):
        dra_claims.strip_stray_resources(mutated, settings, changes)
    if (gpu_pod or unplaceable) and scheduler != settings.scheduler_name:
        # (a pod whose GPU resource is misspelt is ours too: our scheduler reports it pending)
        mutated["spec"]["schedulerName"] = settings.scheduler_name
        changes.append(f"schedulerName set to {settings.scheduler_name}")

    patch = json_patch(pod, mutated) if changes else []
    quota = _quota_ask(pod, normalised, namespace) if gpu_pod else None
    note = "GPU request accepted as written" if gpu_pod else "no GPU requested"
    return Admitted(patch, tuple(changes), tuple(warnings), quota, note, unplaceable)


def apply_quota_verdict(
    decision: Admitted, verdict: QuotaVerdict, settings: TesseraSettings
) -> Decision:
    """Rule 6: refuse what the namespace quota cannot fit; the failure policy when unanswered."""
    ask = decision.quota
    where = f"namespace {ask.namespace}" if ask else "the namespace"
    if verdict.fits is True:
        return decision
    if verdict.fits is False:
        if verdict.reason.startswith("exceeding resource quota"):  # tessera-quota's own words
            return Denial(QUOTA_EXCEEDED, verdict.reason)
        detail = f": {verdict.reason}" if verdict.reason else ""
        return Denial(QUOTA_EXCEEDED, f"exceeding resource quota of {where}{detail}")
    if settings.quota_failure_policy == "allow":
        warning = (
            f"GPU quota of {where} was not checked ({verdict.reason}); admitted because "
            "TESSERA_QUOTA_FAILURE_POLICY=allow"
        )
        return replace(decision, warnings=(*decision.warnings, warning))
    return Denial(
        QUOTA_UNAVAILABLE,
        f"the GPU quota of {where} could not be checked ({verdict.reason}), so the pod was not "
        "admitted (TESSERA_QUOTA_FAILURE_POLICY=deny). Retry in a moment; if it persists, ask an "
        "administrator to check the tessera-quota service",
        503,
    )


def json_patch(original: dict[str, Any], mutated: dict[str, Any]) -> list[dict[str, Any]]:
    """RFC 6902 operations from `original` to `mutated`, made by jsonpatch.make_patch.

    make_patch walks (and copies) everything it is given, so it gets both pods pruned to the
    branches that differ. Lists of equal length (the container lists) are pruned as maps keyed
    by index, which gives the very same JSON pointers; lists that changed length (env) are left
    whole for the library's list diff.
    """
    old, new = _prune(original, mutated)
    # No `move` operations: the rules never move anything, and looking for them is costly.
    return jsonpatch.JsonPatch.from_diff(old, new, optimization=False).patch


def _prune(old: Any, new: Any) -> tuple[Any, Any]:
    if isinstance(old, list) and isinstance(new, list):
        if len(old) == len(new):
            old = {str(i): value for i, value in enumerate(old)}
            new = {str(i): value for i, value in enumerate(new)}
        elif len(old) < len(new) and new[: len(old)] == old:
            # Appended entries (env): "add /env/<len>" in order, as pointers into a list do.
            return {}, {str(i): new[i] for i in range(len(old), len(new))}
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return old, new
    pruned_old: dict[str, Any] = {}
    pruned_new: dict[str, Any] = {}
    for key in [*old, *(k for k in new if k not in old)]:
        before, after = old.get(key, _MISSING), new.get(key, _MISSING)
        if before == after:
            continue
        if before is not _MISSING and after is not _MISSING:
            before, after = _prune(before, after)
        if before is not _MISSING:
            pruned_old[key] = before
        if after is not _MISSING:
            pruned_new[key] = after
    return pruned_old, pruned_new


# --- one container ------------------------------------------------------------------------------


def _normalise_container(
    container: dict[str, Any],
    label: str,
    settings: TesseraSettings,
    changes: list[str],
    warnings: list[str],
) -> ContainerRequest | None:
    """The per-container rules of the family whose resources the container names (the default
    family's, NVIDIA's, for a container naming none: it hides its GPUs from it), applied in
    place; the request as normalised (None = asks no device). A container names one family."""
    named = registry.families_named(container, settings)
    if len(named) > 1:
        raise RequestError(
            f"container {label}: asks devices of {' and '.join(f.name for f in named)}; a "
            "container takes devices of one family (put each family's in its own container)")
    family = named[0] if named else registry.family(registry.DEFAULT_FAMILY)
    return family.admit_container(container, label, settings, AdmissionNotes(changes, warnings))


def _check_selections(
    pod: dict[str, Any], requests: dict[str, list[ContainerRequest | None]]
) -> None:
    """The pod's selection annotations of every other family it asks devices of (an Ascend
    pod's sharing mode...): RequestError with the family's sentence when one cannot be served."""
    named = {r.family for section in requests.values() for r in section if r is not None}
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    for name in sorted(named - {registry.DEFAULT_FAMILY}):
        registry.family(name).selection(annotations)


def _container_label(container: dict[str, Any], section: str, index: int) -> str:
    name = container.get("name")
    return name if isinstance(name, str) and name else f"{section}[{index}]"


def _privileged(container: Any) -> bool:
    context = container.get("securityContext") if isinstance(container, dict) else None
    return isinstance(context, dict) and context.get("privileged") is True


def _quota_ask(pod: dict[str, Any], request: PodRequest, namespace: str) -> QuotaAsk:
    memory, cores, gpus = quota_charge(request)
    metadata = pod.get("metadata")
    name = (metadata.get("name") or metadata.get("generateName") or "") if isinstance(
        metadata, dict) else ""
    return QuotaAsk(namespace, str(name), memory, cores, gpus)


def _writable_copy(pod: dict[str, Any]) -> dict[str, Any]:
    """A copy of the pod in which the rules may change the spec, the containers, their
    resources maps and env lists; everything else is shared with the original, which is
    therefore never modified (env entries are replaced, never edited)."""
    spec = dict(pod["spec"])
    for section in CONTAINER_SECTIONS:
        if isinstance(spec.get(section), list):
            spec[section] = [_writable_container(c) for c in spec[section]]
    return {**pod, "spec": spec}


def _writable_container(container: dict[str, Any]) -> dict[str, Any]:
    copy = dict(container)
    resources = copy.get("resources")
    if isinstance(resources, dict):
        resources = copy["resources"] = dict(resources)
        for section in ("limits", "requests"):
            if isinstance(resources.get(section), dict):
                resources[section] = dict(resources[section])
    if isinstance(copy.get("env"), list):
        copy["env"] = list(copy["env"])
    return copy
