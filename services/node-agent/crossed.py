"""Crossed attributions repaired before anything is sealed. With several pods in flight
Allocate may count kubelet's devices for the wrong pod (the guess crossed them);
PreStartContainer learns from kubelet which pod really holds them, and this puts it right:
relabelling the container directories, or exchanging the two pods' grants in the ledger (one
CAS, every card keeps its amounts), or undoing a preparation that belongs to no holder."""

from __future__ import annotations

import asyncio

from tessera.node_agent import handshake as hs
from tessera.node_agent.containers import ContainerDir

from tessera import bus, hami
from tessera.models import Allocation, NodeLedger, allocation_layout, allocation_shape

from . import ledger_mutations as lm
from .plugin_context import PluginContext
from .pod_records import PodRecords


class CrossRepair:
    def __init__(self, ctx: PluginContext, records: PodRecords) -> None:
        self.ctx = ctx
        self.records = records

    async def repair(
        self, candidates: list[ContainerDir], holders: list[tuple[str, str, str]]
    ) -> bool:
        """kubelet gave these devices to pod H while the Allocate was counted for pod L (several
        pods in flight, the guess crossed them). Repaired before anything is sealed, when
        neither pod has started a container:
        - H was granted exactly these GPUs for that container (one GPU layout): the directory
          is relabelled to H (and H's own, if it has one there, to L); no grant moves;
        - H and L have one shape: they exchange grants and progress in the ledger (one CAS,
          every card keeps the same amounts) and their directories are relabelled.
        L, left without a directory, is in flight again and its own Allocate still comes.
        True when repaired."""
        ctx = self.ctx
        label = next((c for c in candidates if not ctx.sealed(c)), None)
        pods = {(ns, pod) for ns, pod, _ in holders}
        ledger = await ctx.ledger()
        if label is None or len(pods) != 1 or ledger is None:
            return False
        (namespace, name), = pods
        holder = next((a for a in ledger.allocations.values()
                       if (a.namespace, a.name) == (namespace, name) and a.active), None)
        labelled = ledger.allocations.get(label.prepared.pod_uid)
        if holder is None or labelled is None or holder.pod_uid == labelled.pod_uid:
            return False
        theirs, mine = ctx.served(holder), ctx.served(labelled)
        if any(ctx.sealed(c) for c in theirs + mine):
            return False
        repaired = await self._relabel_one(label, holder, labelled, theirs)
        # One shape: a swap moves no capacity. Other amounts: a trade, only when the holder is
        # in flight (the labelled pod was counted served by the cross itself); a pod already
        # served that kubelet admits again is not repaired.
        tradable = allocation_layout(holder) == allocation_layout(labelled) and (
            allocation_shape(holder) == allocation_shape(labelled)
            or holder.pod_uid in {a.pod_uid for a in hs.in_flight(ledger)}
        )
        if not repaired and tradable:
            repaired = await self._swap_pods(holder, labelled, theirs, mine)
        if not repaired:
            return False
        ctx.log.warning("crossed in-flight pods repaired before sealing", extra={
            "holder": f"{holder.namespace}/{holder.name}",
            "counted_for": f"{labelled.namespace}/{labelled.name}",
        })
        current = await ctx.ledger()
        for pod in (holder, labelled):
            now_ = current.allocations.get(pod.pod_uid) if current else None
            if now_ is None:
                continue
            if ctx.served(now_):
                await self.records.maybe_finish(now_)
            else:
                await self.records.give_back_claim(now_)
            # The scheduler wrote the old grants into the pod at bind: record the new ones.
            served = bool(ctx.served(now_))
            ctx.spawn(self.records.annotate(now_, {
                hami.ANN_BIND_PHASE: (hami.BIND_PHASE_SUCCESS if served
                                      else hami.BIND_PHASE_ALLOCATING),
            }, (hami.ANN_DEVICES_TO_ALLOCATE, hami.ANN_DEVICES_ALLOCATED)))  # fmt: skip
        return True

    def _gpus(self, cdir: ContainerDir) -> set[str]:
        return set(hs.gpus_of(cdir.prepared.device_ids, self.ctx.state.by_uuid()))

    async def _relabel(self, cdir: ContainerDir, owner: Allocation) -> None:
        i = cdir.prepared.index
        await asyncio.to_thread(self.ctx.store.relabel, cdir, cdir.prepared.model_copy(update={
            "pod_uid": owner.pod_uid, "namespace": owner.namespace, "pod": owner.name,
            "container": hs.container_name(owner, i), "grants": owner.containers[i],
        }))  # fmt: skip

    async def _relabel_one(
        self, label: ContainerDir, holder: Allocation, labelled: Allocation,
        theirs: list[ContainerDir],
    ) -> bool:
        i = label.prepared.index
        if i >= len(holder.containers) or {g.uuid for g in holder.containers[i]} != self._gpus(
            label
        ):
            return False
        displaced = [c for c in theirs if c.prepared.index == i]
        for other in displaced:  # crossed both ways: H's directory there is really L's
            if {g.uuid for g in labelled.containers[i]} != self._gpus(other):
                return False
        await self._relabel(label, holder)
        for other in displaced:
            await self._relabel(other, labelled)
        return True

    async def _swap_pods(
        self, holder: Allocation, labelled: Allocation,
        theirs: list[ContainerDir], mine: list[ContainerDir],
    ) -> bool:
        ctx = self.ctx
        capacity = {d.uuid: (d.memory_mib, d.cores) for d in ctx.state.devices()}
        if allocation_shape(holder) != allocation_shape(labelled):  # a trade moves room
            left = await ctx.room_beside_hami(capacity)
            if left is None:
                return False
            capacity = left
        try:
            result = await bus.cas_update(
                ctx.ledger_kv, ctx.node, NodeLedger,
                lambda current: lm.swap_mutation(
                    labelled.pod_uid, holder.pod_uid, current, capacity
                ),
            )
        except hs.HandshakeError as exc:
            ctx.log.warning("crossed pods cannot be exchanged", extra={"err": str(exc)})
            return False
        except bus.NoChange:
            return False
        swapped = result.value.allocations
        for c in mine:
            await self._relabel(c, swapped[holder.pod_uid])
        for c in theirs:
            await self._relabel(c, swapped[labelled.pod_uid])
        return True

    async def undo_misattributed(self, cdir: ContainerDir) -> None:
        """An Allocate answered for the wrong pod: forget that preparation, and give the pod it
        was counted for its claim back so that its own Allocate still succeeds."""
        ctx = self.ctx
        p = cdir.prepared
        await asyncio.to_thread(ctx.store.remove_container, cdir)
        if any(c.prepared.pod_uid == p.pod_uid for c in ctx.store.for_pod(p.pod_uid)):
            return  # other containers of that pod were served: leave its state alone
        ledger = await ctx.ledger()
        allocation = ledger.allocations.get(p.pod_uid) if ledger else None
        if allocation is not None:
            await self.records.give_back_claim(allocation)
            ctx.log.warning("claim given back after a mis-attributed Allocate", extra={
                "pod": f"{p.namespace}/{p.pod}",
            })
