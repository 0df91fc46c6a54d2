"""What the device plugin's parts share: the node's state, the ledger, the container store, the
cluster, and the hints that carry from one kubelet call to the next. No logic of its own beyond
reading the ledger and running background publishes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from tessera.node_agent.containers import ContainerDir, ContainerStore
from tessera.node_agent.foreign import hami_held
from tessera.node_agent.metrics import NodeAgentMetrics
from tessera.node_agent.state import DeviceState

from tessera import signing
from tessera.cluster.port import ClusterPort
from tessera.kubeapi import pr
from tessera.models import Allocation, NodeLedger
from tessera.region import LIMITS_FILE_NAME
from tessera.settings import TesseraSettings
from tessera.validation import Rejections

from .watched_ledger import WatchedLedger


@dataclass
class PluginContext:
    settings: TesseraSettings
    node: str
    state: DeviceState
    store: ContainerStore
    ledger_kv: KeyValue
    js: JetStreamContext
    cluster: ClusterPort | None
    log: logging.Logger
    pod_resources: Callable[[str], Awaitable[list[pr.PodResources]]]
    clock: Callable[[], float] | None
    metrics: NodeAgentMetrics
    # The settings with this node's device configuration (memory scaling > 1 means
    # CUDA_OVERSUBSCRIBE and oversubscribe in the sealed limits); node_config.py.
    node_settings: Callable[[], TesseraSettings]
    rejections: Rejections
    # limits.set's records on pods are signed with this key (grant_check.record_ok).
    record_signer: signing.Signer
    # The extended resource this plugin serves to kubelet (its family's count resource).
    resource_name: str = ""
    # One lock serialises GetPreferredAllocation, Allocate, PreStartContainer's seal (its
    # proof is taken outside and checked again under it: plugin.py) and the sealed
    # reconciliation.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The pod the last GetPreferredAllocation answered for, and the pod whose containers the
    # last Allocate served: hints for attributing the next Allocate (never proof).
    guess: str | None = None
    # Bumped whenever the plugin moves a grant or relabels/undoes a prepared directory (a
    # crossed repair, a followed reuse, the sealed reconciliation): PreStartContainer proves
    # identity outside the lock and seals only if nothing moved meanwhile (plugin.py).
    moves: int = 0
    run: str | None = None
    background: set[asyncio.Task[None]] = field(default_factory=set)
    _watched: WatchedLedger | None = field(default=None, repr=False)

    @property
    def watched(self) -> WatchedLedger:
        """The node's ledger entry, followed by a watch while `run_ledger_watch` runs."""
        if self._watched is None:
            self._watched = WatchedLedger(self.ledger_kv, self.node, self.log)
        return self._watched

    async def ledger(self, fresh_within: float | None = None) -> NodeLedger | None:
        """The node's ledger as KV holds it now (exact); with `fresh_within`, the entry known
        (watched_ledger.py) when an exact read was made that recently, at least as new as it.
        Shared between calls: treat it as read-only (every mutation in the plugin copies
        first, as a CAS body must)."""
        if fresh_within is None:
            return await self.watched.exact()
        return await self.watched.read(fresh_within)

    async def run_ledger_watch(self, stop: asyncio.Event) -> None:
        await self.watched.run(stop)

    def served(self, allocation: Allocation) -> list[ContainerDir]:
        """The pod's containers prepared on this node (by Allocate)."""
        return self.store.for_pod(allocation.pod_uid)

    @staticmethod
    def sealed(cdir: ContainerDir) -> bool:
        """Whether PreStartContainer sealed the container's limits (it may start)."""
        return (cdir.limits_dir / LIMITS_FILE_NAME).is_file()

    async def room_beside_hami(
        self, capacity: dict[str, tuple[int, int]]
    ) -> dict[str, tuple[int, int]] | None:
        """`capacity` less what HAMi's pods bound to this node hold on each card (a cluster
        migrating from HAMi: they are in no ledger, foreign.py), so that a trade is judged with
        every consumer of its cards. None when they cannot be judged (the pods cannot be listed,
        or a HAMi pod's grants do not read): the trade is refused, never made blind. Without a
        cluster port there is no Kubernetes, so no HAMi pod: `capacity` as it is."""
        if self.cluster is None:
            return capacity
        try:
            pods = await self.cluster.list_pods(node_name=self.node)
            held = hami_held(pods, self.node, self.settings)
        except Exception as exc:  # the API away, or a HAMi pod unreadable: fail closed
            self.log.warning("crossed pods not traded: HAMi's pods here cannot be judged",
                             extra={"err": str(exc)})  # fmt: skip
            return None
        return {uuid: (mem - held.get(uuid, (0, 0))[0], cores - held.get(uuid, (0, 0))[1])
                for uuid, (mem, cores) in capacity.items()}  # fmt: skip

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def drain(self) -> None:
        """Wait for background publishes (on stop)."""
        if self.background:
            await asyncio.wait(set(self.background), timeout=3.0)
