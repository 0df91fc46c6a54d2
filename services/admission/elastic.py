"""Elastic sharing at admission (issue 33; docs/elastic.md): a pod's burst annotations
(`tessera.io/gpumem-limit`, `tessera.io/gpucores-limit`, `tessera.io/gpumem-reclaim`,
`tessera.io/gpumem-wait-seconds`, `tessera.io/gpumem-spill`) are validated against its
guarantees (HAMi's resources, after HAMi's defaults): a limit below its guarantee, a limit
without a guarantee to burst from, a container name the pod does not have or that asks for no
GPU, a malformed value — each a denial with the sentence to act on. The burst limit granted
(`tessera.io/vgpu-burst-allocated`) is the scheduler's: hami.scheduler_owned denies it like the
other scheduler-owned keys. Pure."""

from __future__ import annotations

from typing import Any

from tessera import elastic
from tessera.hami import PodRequest, RequestError, with_burst_limits

ELASTIC_INVALID = "ElasticLimitInvalid"


def _claims(container: Any) -> bool:
    resources = container.get("resources") if isinstance(container, dict) else None
    return isinstance(resources, dict) and bool(resources.get("claims"))


def elastic_problem(pod: dict[str, Any], request: PodRequest) -> str | None:
    """Why the pod's elastic annotations are refused (None: none set, or all valid)."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    if not isinstance(annotations, dict) or not any(k in annotations
                                                    for k in elastic.USER_ANNOTATIONS):  # fmt: skip
        return None
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    names = [str(c.get("name", "")) for c in containers]
    try:
        options = elastic.parse_elastic(annotations, names)
        gpu_names = {n for n, r in zip(names, request.all, strict=False) if r is not None}
        # a container holding a DRA claim may spill too: the driver seals it (docs/dra.md)
        gpu_names |= {n for n, c in zip(names, containers, strict=False) if _claims(c)}
        no_gpu = sorted(options.spill_named - gpu_names)
        if no_gpu:
            return (f"{elastic.ANN_GPUMEM_SPILL}: container {no_gpu[0]} asks for no GPU: only "
                    "a GPU container's device memory can spill (see docs/elastic.md)")
        if options.spill_mib and not gpu_names & set(options.spill_mib):
            return (f"{elastic.ANN_GPUMEM_SPILL} is set but no container asks for a GPU "
                    "(see docs/elastic.md)")
        if options.limits:
            burst = with_burst_limits(request, annotations, containers)
            if not any(r is not None and r.burst is not None for r in burst.all):
                return (f"{elastic.ANN_GPUMEM_LIMIT} / {elastic.ANN_GPUCORES_LIMIT} are set but no "
                        "container asks for a GPU slice to burst from")  # fmt: skip
    except (elastic.ElasticError, RequestError) as exc:
        return f"{exc} (see docs/elastic.md)"
    return None
