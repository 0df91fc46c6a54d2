"""What the device plugin records of a pod: the ledger's progress (allocated, a claim given
back), its events (allocated, mismatch) and its annotations (bind-phase, the grants, signed)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

from tessera.node_agent import handshake as hs
from tessera.node_agent.grant_check import GrantRefused, check_grant

from tessera import bus, hami, signing
from tessera.device_kinds import pod_grants
from tessera.models import Allocation, AllocationEvent, NodeLedger
from tessera.validation import Problem

from . import ledger_mutations as lm
from .plugin_context import PluginContext

# `annotate`'s grant keys name a role by NVIDIA's key; each family's own key of it is written
_ROLE_OF_KEY = {hami.ANN_DEVICES_TO_ALLOCATE: pod_grants.TO_ALLOCATE,
                hami.ANN_DEVICES_ALLOCATED: pod_grants.ALLOCATED}


class PodRecords:
    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx
        # pod uid -> its finish, written after Allocate answered (finish_soon)
        self.finishing: dict[str, asyncio.Task[None]] = {}

    def _served(self, allocation: Allocation) -> bool:
        """Every GPU container of the pod is served (the pod may be finished)."""
        prepared = {c.prepared.index for c in self.ctx.store.for_pod(allocation.pod_uid)}
        if not set(hs.gpu_containers(allocation)) <= prepared:
            return False
        if self.ctx.run == allocation.pod_uid:
            self.ctx.run = None
        return True

    def finish_soon(self, allocation: Allocation) -> None:
        """`maybe_finish` written after Allocate has answered: kubelet's next admission does
        not wait for this pod's ledger write. PreStartContainer waits for it (`settle`), and
        writes it itself when it finds it still undone (an agent killed in between)."""
        if not self._served(allocation) or allocation.pod_uid in self.finishing:
            return
        uid = allocation.pod_uid

        async def finish() -> None:
            try:
                await self.maybe_finish(allocation)
            except Exception as exc:  # kept in `finishing`: PreStartContainer writes it
                self.ctx.log.warning("pod not recorded allocated yet", extra={
                    "pod": f"{allocation.namespace}/{allocation.name}", "err": str(exc)})
            else:
                self.finishing.pop(uid, None)

        task = asyncio.create_task(finish())
        self.finishing[uid] = task
        self.ctx.background.add(task)
        task.add_done_callback(self.ctx.background.discard)

    def answered(self, pod_uid: str) -> bool:
        """Allocate answered for every GPU container of the pod and its finish is still on
        its way (or failed: PreStartContainer writes it): not a pod kubelet is admitting
        anew, though the ledger may still show it only bound."""
        return pod_uid in self.finishing

    async def settle(self, pod_uid: str) -> None:
        """Wait for the pod's finish in flight (finish_soon), if any; forget it then."""
        task = self.finishing.get(pod_uid)
        if task is not None:
            await asyncio.shield(task)
            self.finishing.pop(pod_uid, None)

    async def maybe_finish(self, allocation: Allocation) -> None:
        """Once every GPU container is served: allocated, claim released, event, bind-phase."""
        ctx = self.ctx
        if not self._served(allocation):
            return
        finish = lm.Finish(allocation.pod_uid)
        try:
            await ctx.watched.cas(finish.mutate)  # from the entry known: one round trip
        except bus.NoChange:
            return
        if finish.wrote:  # (cas_update returns the entry as it is when there was nothing to do)
            ctx.spawn(self.announce_allocated(allocation))

    async def announce_allocated(self, allocation: Allocation) -> None:
        ctx = self.ctx
        event = AllocationEvent(
            event_id=f"{allocation.pod_uid}:allocated",
            action="allocated",
            node=ctx.node,
            pod_uid=allocation.pod_uid,
            namespace=allocation.namespace,
            name=allocation.name,
            containers=allocation.containers,
            source=f"node-agent/{ctx.node}",
        )
        try:
            await bus.publish_event(ctx.js, event)
        except Exception as exc:
            ctx.log.warning("allocated event not published", extra={"err": str(exc)})
        # HAMi's record of what the pod was given (the grants kubelet's devices carry).
        await self.annotate(allocation, {hami.ANN_BIND_PHASE: hami.BIND_PHASE_SUCCESS},
                            (hami.ANN_DEVICES_ALLOCATED,))  # fmt: skip

    async def give_back_claim(self, allocation: Allocation) -> None:
        """A pod counted as served that was not: in flight again, so its Allocate can come."""
        ctx = self.ctx
        with contextlib.suppress(bus.NoChange):
            await bus.cas_update(
                ctx.ledger_kv, ctx.node, NodeLedger,
                lambda ledger: lm.reclaim_mutation(
                    allocation.pod_uid, ledger, f"node-agent/{ctx.node}",
                    ctx.settings.reservation_ttl_s, ctx.clock,
                ),
            )

    async def annotate(
        self, allocation: Allocation, annotations: dict[str, str],
        grant_keys: tuple[str, ...] = (), attempts: int = 5,
    ) -> None:
        """Patch the pod's annotations (the cluster is the durable record of grants), retried.
        `grant_keys` (NVIDIA's keys, naming a role: tessera.device_kinds.pod_grants) get the
        pod's grants as the ledger holds them when the patch is sent, each held family's under
        its own key, so a late patch never writes grants a repair has since replaced."""
        ctx = self.ctx
        if ctx.cluster is None:
            return
        for attempt in range(1, attempts + 1):
            try:
                values = dict(annotations)
                if grant_keys:
                    ledger = await ctx.ledger()
                    current = ledger.allocations.get(allocation.pod_uid) if ledger else None
                    if current is None:
                        return  # released meanwhile: nothing to record
                    keys = await self._recordable(current, grant_keys)
                    # each held family's own key of the role (HAMi's per-vendor records)
                    values |= pod_grants.grant_annotations(
                        current.containers, [_ROLE_OF_KEY[k] for k in keys])
                    if hami.ANN_DEVICES_ALLOCATED in keys:  # what this agent allocated, signed
                        devices = hami.encode_pod_devices(current.containers)
                        values[signing.RECORD_ANNOTATION] = signing.record_signature(
                            ctx.record_signer, current.pod_uid, devices)
                        values |= pod_grants.family_extras(current.containers,
                                                           ctx.state.by_uuid())
                    if mig := hami.encode_mig_instances(current.containers):
                        values[hami.ANN_MIG_INSTANCES] = mig  # with the instances' UUIDs
                await ctx.cluster.patch_pod_metadata(
                    allocation.namespace, allocation.name, annotations=values
                )
                return
            except Exception as exc:
                if attempt == attempts:
                    ctx.log.warning("pod annotations not written", extra={
                        "pod": f"{allocation.namespace}/{allocation.name}", "err": str(exc),
                    })  # fmt: skip
                    return
                await asyncio.sleep(0.2 * attempt)

    async def _recordable(
        self, allocation: Allocation, grant_keys: tuple[str, ...]
    ) -> tuple[str, ...]:
        """`grant_keys` without `hami.io/vgpu-devices-allocated` when the ledger's grants are
        not what the pod asked for: grant_check trusts that annotation as limits.set's record,
        so a grant forged on the bus must never be copied into it."""
        ctx = self.ctx
        if hami.ANN_DEVICES_ALLOCATED not in grant_keys or ctx.cluster is None:
            return grant_keys
        try:
            pod = await ctx.cluster.get_pod(allocation.namespace, allocation.name)
            if (pod.get("metadata") or {}).get("uid") != allocation.pod_uid:
                raise GrantRefused("the cluster's pod has another uid than the ledger's")
            devices = ctx.state.by_uuid()
            for index, grants in enumerate(allocation.containers):
                if grants:
                    check_grant(pod, index, grants, devices, ctx.settings)
        except GrantRefused as exc:
            ctx.rejections.reject("ledger", ctx.node, Problem("grant_above_request", str(exc)))
            return tuple(k for k in grant_keys if k != hami.ANN_DEVICES_ALLOCATED)
        return grant_keys

    # --- events ----------------------------------------------------------------------------

    def publish_mismatch(self, allocation: Allocation, ids: list[str], reason: str) -> None:
        self.publish_mismatch_raw(
            allocation.pod_uid, allocation.namespace, allocation.name, ids, reason
        )

    def publish_mismatch_raw(
        self, pod_uid: str, namespace: str, name: str, ids: list[str], reason: str
    ) -> None:
        ctx = self.ctx
        digest = hashlib.sha256(",".join(sorted(ids)).encode()).hexdigest()[:12]
        event = AllocationEvent(
            event_id=f"{pod_uid}:mismatch:{digest}",
            action="mismatch",
            node=ctx.node,
            pod_uid=pod_uid,
            namespace=namespace,
            name=name,
            reason=reason,
            source=f"node-agent/{ctx.node}",
        )
        ctx.spawn(self._publish_quietly(event))

    async def _publish_quietly(self, event: AllocationEvent) -> None:
        try:
            await bus.publish_event(self.ctx.js, event)
        except Exception as exc:
            self.ctx.log.warning("event not published", extra={"err": str(exc)})
