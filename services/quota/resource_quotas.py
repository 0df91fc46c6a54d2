"""Namespace limits from Kubernetes ResourceQuota objects, watched through the cluster port.

Keys honoured in `spec.hard` (names follow the configured resource names), each in its
`limits.` and `requests.` form: `nvidia.com/gpumem` (MiB, or bytes with a unit: `160Gi`),
`nvidia.com/gpucores` (% of a GPU), `nvidia.com/gpu` (GPU count); see quota_units.py. A value
that cannot be read (and `gpumem-percentage`, which is no namespace total) is not applied and is
reported as an `InvalidGPUQuota` Warning event on the ResourceQuota, never read as unlimited.
Several objects in one namespace all apply (the smallest limit wins); each change is written in
one CAS.

Usage goes back to the objects: `status.used` of the GPU keys in their `limits.` form
(`limits.nvidia.com/gpumem` in MiB, `limits.nvidia.com/gpucores`, `limits.nvidia.com/gpu`), which
kube-controller-manager's quota controller does not evaluate for extended resources (it charges
them only in the `requests.` form, and keeps the used values others write), so `kubectl
describe quota` shows what Tessera charged. Written when it changes (`publish_usage`).

DRA device keys (`<class>.deviceclass.resource.k8s.io/devices` and kin, tessera/dra_quota.py)
are kube-apiserver's to count and enforce: they are kept as the objects say (hard, and used as
the quota controller wrote it) and shown by `status` beside Tessera's limits (`device_quotas`).

A watch starts with a list of every object. Nothing is applied during that list: applying a
namespace's first object before its second arrived would loosen its limit for a moment. Once
the stream has been quiet for `settle_s`, the listed set replaces what was known, and
namespaces whose ResourceQuotas vanished meanwhile (even while the service was down) lose the
limits those objects had set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from tessera.quota import arithmetic as qa

from tessera import dra_quota, quantity
from tessera.cluster.port import ClusterPort, KubeObject, ObjectRef, WatchEvent
from tessera.models import DeviceQuota, QuotaAmount
from tessera.settings import TesseraSettings

ApplyQuotas = Callable[[str, dict[str, QuotaAmount]], Awaitable[None]]
# Namespaces whose stored limits came from ResourceQuota objects (read from KV tessera-quota).
ListQuotaNamespaces = Callable[[], Awaitable[set[str]]]

_END = object()


async def _end_once(stop: asyncio.Event, queue: asyncio.Queue[object]) -> None:
    """End the watch's queue once `stop` is set."""
    await stop.wait()
    queue.put_nowait(_END)


class ResourceQuotaWatcher:
    def __init__(
        self,
        cluster: ClusterPort,
        settings: TesseraSettings,
        apply: ApplyQuotas,
        log: logging.Logger,
        *,
        stored: ListQuotaNamespaces | None = None,
        settle_s: float = 1.0,
    ) -> None:
        self.cluster = cluster
        self.keys = qa.ResourceQuotaKeys.from_resource_names(
            settings.resource_name, settings.resource_mem, settings.resource_cores,
            settings.resource_mem_percentage,
        )
        self.apply = apply
        self.stored = stored
        self.log = log
        self.settle_s = settle_s
        # namespace -> ResourceQuota name -> its GPU limits (only objects that set one).
        self.known: dict[str, dict[str, QuotaAmount]] = {}
        # Namespaces whose last change could not be written (NATS away): retried until it is.
        self.pending: set[str] = set()
        # (namespace, name) -> the `limits.` GPU keys its spec.hard sets; what was last written
        self.usage_keys: dict[tuple[str, str], tuple[str, ...]] = {}
        self.written: dict[tuple[str, str], dict[str, str]] = {}
        self._reporting: set[asyncio.Task[None]] = set()
        # (namespace, name) -> the object's DRA device keys; those seen by the current list
        self.devices: dict[tuple[str, str], list[DeviceQuota]] = {}
        self._listing: set[tuple[str, str]] | None = None

    def device_quotas(self, namespace: str = "") -> list[DeviceQuota]:
        """The DRA device keys of the namespace's ResourceQuotas (every namespace: "")."""
        return [q for (ns, _name), quotas in sorted(self.devices.items())
                if not namespace or ns == namespace for q in quotas]  # fmt: skip

    async def reapply_all(self) -> None:
        """Write every namespace's known limits again (the quota bucket was lost and re-created:
        what the objects say is still in memory). A write that fails is retried as pending."""
        for namespace in sorted(self.known):
            await self._apply(namespace)

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
            queue: asyncio.Queue[object] = asyncio.Queue()
            pump = asyncio.create_task(self._pump(queue))
            # Stopping ends the watch by itself: the stop's cancel can be lost (Python 3.11's
            # asyncio.wait_for swallows one landing as a bus reply arrives, and applying limits
            # makes bus requests), and a watch waiting for its next event never ended.
            ender = asyncio.create_task(_end_once(stop, queue))
            try:
                await self._consume(queue)
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.log.warning("ResourceQuota watch failed", extra={"err": str(exc)})
            finally:
                pump.cancel()
                ender.cancel()
            if stop.is_set():
                return
            await asyncio.sleep(backoff)
            backoff = min(10.0, backoff * 2)

    async def _pump(self, queue: asyncio.Queue[object]) -> None:
        """Move watch events into `queue` (so that waiting for quiet never cancels the watch)."""
        try:
            async for event in self.cluster.watch_resource_quotas():
                queue.put_nowait(event)
            queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)

    async def _consume(self, queue: asyncio.Queue[object]) -> None:
        listed: dict[str, dict[str, QuotaAmount]] | None = {}
        self._listing = set()
        while True:
            try:
                if listed is None:
                    item = await queue.get()
                else:
                    item = await asyncio.wait_for(queue.get(), self.settle_s)
            except TimeoutError:
                assert listed is not None
                await self._settle(listed)
                listed = None
                continue
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            assert isinstance(item, WatchEvent)
            if listed is None:
                await self.handle(item.type, item.object)
            else:
                self._record(listed, item.type, item.object)

    async def _settle(self, listed: dict[str, dict[str, QuotaAmount]]) -> None:
        """The list is complete: it replaces what was known, changed namespaces are applied."""
        previous, self.known = self.known, listed
        seen, self._listing = self._listing or set(), None
        self.devices = {k: v for k, v in self.devices.items() if k in seen}
        touched = set(previous) | set(listed)
        if self.stored is not None:
            try:
                touched |= await self.stored()  # limits set by objects deleted while we were away
            except Exception as exc:
                self.log.warning("could not list stored quotas", extra={"err": str(exc)})
        for namespace in sorted(touched):
            await self._apply(namespace)

    async def handle(self, kind: str, obj: KubeObject) -> None:
        """One change after the initial list: record it and apply the namespace's limits."""
        namespace = self._record(self.known, kind, obj)
        if namespace is not None:
            await self._apply(namespace)

    def _record(
        self, into: dict[str, dict[str, QuotaAmount]], kind: str, obj: KubeObject
    ) -> str | None:
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        try:
            qa.check_namespace(namespace)
        except qa.QuotaInputError:
            return None
        quotas = into.setdefault(namespace, {})
        devices = dra_quota.device_quotas(obj) if kind != "DELETED" else []
        if devices:
            self.devices[(namespace, name)] = devices
        else:
            self.devices.pop((namespace, name), None)
        if self._listing is not None:
            self._listing.add((namespace, name))
        if kind == "DELETED":
            quotas.pop(name, None)
            self.usage_keys.pop((namespace, name), None)
            self.written.pop((namespace, name), None)
        else:
            hard = (obj.get("spec") or {}).get("hard") or {}
            if not isinstance(hard, dict):
                hard = {}
            ours = (self.keys.memory[0], self.keys.cores[0], self.keys.gpus[0])
            self.usage_keys[(namespace, name)] = tuple(k for k in ours if k in hard)
            used = (obj.get("status") or {}).get("used") or {}
            self.written[(namespace, name)] = {k: str(used[k]) for k in ours if k in used}
            limits, problems = qa.limits_from_hard(hard, self.keys)
            if problems:
                self._report(namespace, name, meta.get("uid", ""), problems)
            if qa.has_any_limit(limits):
                quotas[name] = limits
            else:
                quotas.pop(name, None)
        return namespace

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

    async def publish_usage(self, used: dict[str, QuotaAmount]) -> None:
        """Write each object's GPU usage (`status.used`) where it changed; a namespace missing
        from `used` charges nothing. A failed write is tried again on the next call."""
        for (namespace, name), keys in list(self.usage_keys.items()):
            if not keys:
                continue
            amount = used.get(namespace) or QuotaAmount()
            values = {self.keys.memory[0]: amount.memory_mib or 0,
                      self.keys.cores[0]: amount.cores or 0, self.keys.gpus[0]: amount.gpus or 0}
            # as the API server stores a quantity (8000 → 8k): compared like with like
            wanted = {k: quantity.canonical(values[k]) for k in keys}
            written = {k: quantity.canonical(v) for k, v in
                       self.written.get((namespace, name), {}).items()}
            if wanted == written:
                continue
            try:
                await self.cluster.patch_resource_quota_used(namespace, name, wanted)
            except Exception as exc:
                self.log.debug("quota usage not written", extra={"quota": name, "err": str(exc)})
                continue
            self.written[(namespace, name)] = wanted

    def _report(self, namespace: str, name: str, uid: str, problems: list[str]) -> None:
        message = "ignored GPU quota values: " + "; ".join(problems)
        self.log.warning(message, extra={"namespace": namespace, "quota": name})

        async def record() -> None:
            try:
                await self.cluster.record_event(
                    ObjectRef(kind="ResourceQuota", namespace=namespace, name=name, uid=uid),
                    "InvalidGPUQuota",
                    message,
                    "Warning",
                )
            except Exception as exc:
                self.log.debug("event not recorded", extra={"err": str(exc)})

        task = asyncio.get_running_loop().create_task(record())
        self._reporting.add(task)
        task.add_done_callback(self._reporting.discard)
