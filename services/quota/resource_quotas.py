"""Namespace limits from Kubernetes ResourceQuota objects, watched through the cluster port.

Keys honoured in `spec.hard` (names follow the configured resource names):
`limits.nvidia.com/gpumem` (MiB), `limits.nvidia.com/gpucores` (% of a GPU),
`limits.nvidia.com/gpu` / `requests.nvidia.com/gpu` (GPU count). Several objects in one
namespace all apply (the smallest limit wins); each change is written in one CAS.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tessera.quota import arithmetic as qa

from tessera.cluster.port import ClusterPort, KubeObject, ObjectRef
from tessera.models import QuotaAmount
from tessera.settings import TesseraSettings

ApplyQuotas = Callable[[str, dict[str, QuotaAmount]], Awaitable[None]]


class ResourceQuotaWatcher:
    def __init__(
        self,
        cluster: ClusterPort,
        settings: TesseraSettings,
        apply: ApplyQuotas,
        log: logging.Logger,
    ) -> None:
        self.cluster = cluster
        self.keys = qa.ResourceQuotaKeys.from_resource_names(
            settings.resource_name, settings.resource_mem, settings.resource_cores
        )
        self.apply = apply
        self.log = log
        # namespace -> ResourceQuota name -> its GPU limits (only objects that set one).
        self.known: dict[str, dict[str, QuotaAmount]] = {}
        # Namespaces whose last change could not be written (NATS away): retried until it is.
        self.pending: set[str] = set()

    async def run(self, stop: asyncio.Event, retry_s: float = 2.0) -> None:
        retry = asyncio.create_task(self._retry_pending(stop, retry_s))
        try:
            await self._watch(stop)
        finally:
            retry.cancel()

    async def _retry_pending(self, stop: asyncio.Event, retry_s: float) -> None:
        while not stop.is_set():
            await asyncio.sleep(retry_s)
            for namespace in sorted(self.pending):
                await self._apply(namespace)

    async def _watch(self, stop: asyncio.Event) -> None:
        backoff = 0.5
        while not stop.is_set():
            try:
                async for event in self.cluster.watch_resource_quotas():
                    await self.handle(event.type, event.object)
                    backoff = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("ResourceQuota watch failed", extra={"err": str(exc)})
            await asyncio.sleep(backoff)
            backoff = min(10.0, backoff * 2)

    async def handle(self, kind: str, obj: KubeObject) -> None:
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        try:
            qa.check_namespace(namespace)
        except qa.QuotaInputError:
            return
        quotas = self.known.setdefault(namespace, {})
        if kind == "DELETED":
            quotas.pop(name, None)
        else:
            hard = (obj.get("spec") or {}).get("hard") or {}
            if not isinstance(hard, dict):
                hard = {}
            limits, problems = qa.limits_from_hard(hard, self.keys)
            if problems:
                await self._report(namespace, name, meta.get("uid", ""), problems)
            if qa.has_any_limit(limits):
                quotas[name] = limits
            else:
                quotas.pop(name, None)
        await self._apply(namespace)

    async def _apply(self, namespace: str) -> None:
        quotas = self.known.get(namespace, {})
        try:
            await self.apply(namespace, dict(quotas))
        except Exception as exc:
            self.pending.add(namespace)
            self.log.warning(
                "could not apply ResourceQuota limits; will retry",
                extra={"namespace": namespace, "err": str(exc)},
            )
            return
        self.pending.discard(namespace)
        if not quotas:
            self.known.pop(namespace, None)

    async def _report(self, namespace: str, name: str, uid: str, problems: list[str]) -> None:
        message = "ignored GPU quota values: " + "; ".join(problems)
        self.log.warning(message, extra={"namespace": namespace, "quota": name})
        try:
            await self.cluster.record_event(
                ObjectRef(kind="ResourceQuota", namespace=namespace, name=name, uid=uid),
                "InvalidGPUQuota",
                message,
                "Warning",
            )
        except Exception as exc:
            self.log.debug("event not recorded", extra={"err": str(exc)})
