"""HAMi's per-container webhook rules for NVIDIA (specs/hami-compat.md, "Webhook rules", rule
3): the env a request implies, the default count, a whole card when no memory is asked. Pure:
the container (a writable copy) is changed in place and every change is said."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from typing import Any

from tessera.hami import (
    ContainerRequest,
    RequestError,
    parse_container_request,
    parse_quantity,
    raw_percentage,
)
from tessera.settings import TesseraSettings

from ..edits import ensure_env, raw_resource, set_resource

ENV_TASK_PRIORITY = "CUDA_TASK_PRIORITY"
ENV_CORE_POLICY = "GPU_CORE_UTILIZATION_POLICY"
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


def admit_container(
    container: dict[str, Any],
    label: str,
    settings: TesseraSettings,
    changes: list[str],
    warnings: list[str],
) -> ContainerRequest | None:
    """HAMi's per-container webhook rules, applied in place; the request as normalised (None =
    asks no GPU), equal to what parse_container_request reads from the changed container."""
    where = f"container {label}: "
    try:
        percentage = raw_percentage(container, settings)
    except RequestError as exc:
        message = str(exc)
        named = message if message.startswith("container ") else where + message
        raise RequestError(named) from exc
    if percentage is not None and not Decimal(0) <= percentage <= Decimal(100):
        raise RequestError(
            f"{where}{settings.resource_mem_percentage} must be between 0 and 100, "
            f"got {raw_resource(container, settings.resource_mem_percentage)!r}"
        )
    # Validates every GPU quantity (malformed, negative, absurd → RequestError with a sentence).
    request = parse_container_request(container, settings)
    raw_count = raw_resource(container, settings.resource_name)
    raw_mem = raw_resource(container, settings.resource_mem)
    raw_pct = raw_resource(container, settings.resource_mem_percentage)
    raw_cores = raw_resource(container, settings.resource_cores)
    raw_priority = raw_resource(container, settings.resource_priority)

    if raw_priority is not None:
        priority = str(int(parse_quantity(raw_priority, settings.resource_priority)))
        if ensure_env(container, ENV_TASK_PRIORITY, priority):
            changes.append(f"{label}: env {ENV_TASK_PRIORITY}={priority}")
    if request is None:
        if settings.env_overwrite and ensure_env(container, ENV_VISIBLE_DEVICES, "none"):
            changes.append(f"{label}: env {ENV_VISIBLE_DEVICES}=none (asks no GPU)")
        return None

    others = [r for r, raw in (
        (settings.resource_mem, raw_mem),
        (settings.resource_mem_percentage, raw_pct),
        (settings.resource_cores, raw_cores),
    ) if raw is not None]
    if raw_count is not None and parse_quantity(raw_count, settings.resource_name) == 0:
        raise RequestError(
            f"{where}{settings.resource_name} is 0 but {', '.join(others)} is set; ask for at "
            f"least 1 GPU or remove the GPU memory/cores request"
        )
    if settings.core_policy != "default" and ensure_env(
        container, ENV_CORE_POLICY, settings.core_policy
    ):
        changes.append(f"{label}: env {ENV_CORE_POLICY}={settings.core_policy}")
    if raw_count is None:
        set_resource(container, settings.resource_names(), settings.resource_name,
                     str(settings.default_gpu_num))
        changes.append(f"{label}: {settings.resource_name}={settings.default_gpu_num} added")
    asks_no_memory = raw_mem is None and raw_pct is None
    if raw_cores is None and (percentage == 100 or asks_no_memory):
        set_resource(container, settings.resource_names(), settings.resource_cores, "100")
        changes.append(f"{label}: {settings.resource_cores}=100 added (whole card, exclusive)")
        request = replace(request, cores=100)
    return request
