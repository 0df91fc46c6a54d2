"""Checks before a container's limits are sealed, and after: the ledger's grant must be what
the pod asked for (a grant forged on the bus is refused), a grant must not put a card over its
capacity beside what the node's containers have sealed, and a ledger that places sealed
containers on other cards is reported and put back (grant_check.py holds the pure rules)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import zlib

from tessera.node_agent import handshake as hs
from tessera.node_agent.containers import ContainerDir
from tessera.node_agent.grant_check import (
    GrantRefused,
    check_grant,
    check_sealed_capacity,
    counted_sealed,
    recorded_text,
    sealed_disagreements,
    sealed_repair,
)

from tessera import bus, signing
from tessera.cluster.port import ClusterError
from tessera.models import Allocation, NodeLedger
from tessera.region import LIMITS_FILE_NAME
from tessera.validation import Problem

from . import mps
from .plugin_context import PluginContext


class SealedChecks:
    def __init__(self, ctx: PluginContext) -> None:
        self.ctx = ctx
        # limits file -> ((inode, mtime ns, size), what it seals): every PreStartContainer
        # compares with every sealed container of the node, so each file is decoded once and
        # then only stat'ed (seal_limits writes by rename: a rewrite is a new inode).
        self._sealed_read: dict[str, tuple[tuple[int, int, int], dict[str, int]]] = {}
        self._sealed_revision = 0  # the ledger revision last compared with what is sealed
        self._sealed_checked_at = 0.0

    def _record_ok(self, pod: dict) -> bool:
        """The pod's `-allocated` record is limits.set's, signed with this agent's own key."""
        signer = self.ctx.record_signer
        if signer.key is None:
            return False  # no key: a grant above the request is never believed
        uid, value, signature = recorded_text(pod)
        return value is not None and signing.record_verifies(
            signature, uid, value, signer.user, {signer.user: signer.key.public_key()})

    def _sealed_memory(self, cdir: ContainerDir) -> dict[str, int]:
        """mps.sealed_memory, decoded again only when the limits file changed (in a thread)."""
        path = cdir.limits_dir / LIMITS_FILE_NAME
        try:
            st = os.stat(path)
        except OSError:
            self._sealed_read.pop(str(path), None)
            return mps.sealed_memory(cdir)  # (none sealed: as it says)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        known = self._sealed_read.get(str(path))
        if known is not None and known[0] == key:
            return dict(known[1])
        memory = mps.sealed_memory(cdir)
        self._sealed_read[str(path)] = (key, memory)
        if len(self._sealed_read) > 4 * (len(self.ctx.store.all()) + 16):  # forget the gone
            self._sealed_read.clear()
        return dict(memory)

    async def check_grant(self, allocation: Allocation, index: int) -> dict | None:
        """The ledger's grant must be what the pod asked for (grant_check): a grant forged on
        the bus is refused before it is sealed. Without a cluster API there is no pod to ask.
        Returns the pod read (what else the seal takes from it: its spill), or None."""
        ctx = self.ctx
        if ctx.cluster is None:
            return None
        who = hs.describe(allocation, index)
        try:
            pod = await ctx.cluster.get_pod(allocation.namespace, allocation.name)
        except ClusterError as exc:
            raise hs.HandshakeError(
                f"{who}: cannot read the pod to check its grant: {exc}"
            ) from exc
        try:
            if (pod.get("metadata") or {}).get("uid") != allocation.pod_uid:
                raise GrantRefused(f"{who}: the cluster's pod has another uid than the ledger's")
            check_grant(pod, index, allocation.containers[index], ctx.state.by_uuid(),
                        ctx.settings, self._record_ok(pod))  # fmt: skip
        except GrantRefused as exc:
            ctx.rejections.reject("ledger", ctx.node, Problem("grant_above_request", str(exc)))
            raise hs.HandshakeError(str(exc), mismatch=True) from exc
        return pod

    async def reconcile(self, every_s: float = 2.0) -> None:
        """When the ledger changed: every allocated container it places on other cards than
        the ones it sealed (a rebuild from a forged annotation) is reported, and the ledger is
        put back on the sealed cards where they hold it (grant_check.sealed_repair)."""
        ctx = self.ctx
        if time.monotonic() - self._sealed_checked_at < every_s:
            return
        self._sealed_checked_at = time.monotonic()
        current = await bus.read(ctx.ledger_kv, ctx.node, NodeLedger)
        if current is None or current.revision == self._sealed_revision:
            return
        async with ctx.lock:
            self._sealed_revision = current.revision
            active = {u: a for u, a in current.value.allocations.items() if a.active}

            def read() -> dict[tuple[str, int], dict[str, int]]:
                return {(c.prepared.pod_uid, c.prepared.index): self._sealed_memory(c)
                        for c in ctx.store.all() if c.prepared.pod_uid in active}

            sealed = counted_sealed(await asyncio.to_thread(read), active, ("", -1))
            names = {u: f"{a.namespace}/{a.name}" for u, a in active.items()}
            found = sealed_disagreements(sealed, {u: a.containers for u, a in active.items()},
                                         names)
            if not found:
                return
            for message in found:  # each its own event (not deduplicated by problem code)
                ctx.rejections.reject("ledger", ctx.node,
                                      Problem("sealed_grant_disagrees", message),
                                      zlib.crc32(message.encode()) or 1)
            changed, unrepaired = sealed_repair(active, sealed, ctx.state.by_uuid())
            for who in unrepaired:
                ctx.rejections.reject("ledger", ctx.node, Problem(
                    "sealed_grant_unrepaired", f"{who}: the cards it sealed cannot hold it "
                    "in the ledger; new grants there are refused until it ends"))

            def put_back(ledger: NodeLedger | None) -> NodeLedger:
                if ledger is None:
                    raise bus.NoChange
                ledger = ledger.model_copy(deep=True)
                for uid, allocation in changed.items():
                    if ledger.allocations.get(uid) == active[uid]:  # unchanged since read
                        ledger.allocations[uid] = allocation
                return ledger

            if changed:
                ctx.moves += 1  # grants moved: a PreStart checked before this checks again
                with contextlib.suppress(bus.NoChange):
                    await bus.cas_update(ctx.ledger_kv, ctx.node, NodeLedger, put_back)
                ctx.log.warning("ledger put back on the cards the containers sealed",
                                extra={"pods": sorted(names[u] for u in changed)})

    async def check_sealed(
        self, allocation: Allocation, index: int, cdir: ContainerDir,
        ledger: NodeLedger | None = None,
    ) -> None:
        """What the node's containers have sealed is what they hold, whatever the ledger says
        (it may have been restored from a forged annotation, grant_check): a grant that would
        put a card over its capacity beside it is refused, and every sealed container the
        ledger places on other cards is reported."""
        ctx = self.ctx
        # `ledger`: the caller's read (PreStart's). A read before others' seals is as good:
        # the ledger only says which pods are active (what they sealed is read from disk), and
        # a pod that became active since has sealed nothing yet.
        if ledger is None:
            ledger = await ctx.ledger()
        active = {u: a for u, a in (ledger.allocations.items() if ledger else ()) if a.active}
        others = [c for c in ctx.store.all()
                  if c.path != cdir.path and c.prepared.pod_uid in active]

        def read() -> dict[tuple[str, int], dict[str, int]]:
            return {(c.prepared.pod_uid, c.prepared.index): self._sealed_memory(c) for c in others}

        sealed = counted_sealed(await asyncio.to_thread(read), active,
                                (allocation.pod_uid, index))
        names = {u: f"{a.namespace}/{a.name}" for u, a in active.items()}
        for message in sealed_disagreements(sealed, {u: a.containers for u, a in active.items()},
                                            names):
            ctx.rejections.reject("ledger", ctx.node, Problem("sealed_grant_disagrees", message),
                                  zlib.crc32(message.encode()) or 1)
        try:
            check_sealed_capacity(hs.describe(allocation, index), allocation.containers[index],
                                  sealed, ctx.state.by_uuid())
        except GrantRefused as exc:
            ctx.rejections.reject("ledger", ctx.node, Problem("sealed_over_capacity", str(exc)))
            raise hs.HandshakeError(str(exc), mismatch=True) from exc
