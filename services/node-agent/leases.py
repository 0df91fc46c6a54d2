"""The lease service: each container's device-memory account, held here, out of the tenant's reach.

libvgpu (inside the container) may charge an allocation only against memory it holds on lease
from this service; the sum of a container's leases never exceeds its sealed limit, whatever the
tenant writes into its usage region. One unix stream socket per container, `lease.sock` in its
limits directory (mounted read-only: the tenant can connect but not replace it). The protocol is
in native/libvgpu/include/tessera_region.h; in short:

    libvgpu -> agent   A <uuid> <need> <want>   lease need..want bytes more -> G <bytes> | N
                       R <uuid> <bytes>         give back
                       H <uuid> <bytes>         already held (after a reconnect)
                       D                        a recall answered (after its R lines)
    agent -> libvgpu   C                        recall: give back what you hold unused
                       W                        still waiting (the answer follows)

Spill (limits 1.3, `spill_bytes`, docs/elastic.md) is leased the same way under the name
`host-spill` (region.LEASE_SPILL_NAME) in place of a GPU uuid: a hard slice of the sealed
`spill_bytes` for the container's processes together, never lent, on no card.

Leases are counted per connection, and each connection is named by its peer's credentials
(SO_PEERCRED: the host pid). A closed connection — the process exited or was killed — returns
its leases. A live connection is also the process's attestation: a process using memory on a
limited GPU with no connection here is not running libvgpu (the watchdog's business).

Elastic memory (issue 33): a container sealed with a guarantee below its limit may lease beyond
the guarantee, up to the limit, while the card has memory nobody is guaranteed
(`memory_lending.offer`: the card-wide rule, across every container the service serves on that
card). When a guaranteed
request finds the card's free memory held by borrowers, the borrowers' unused leases are recalled,
their next request beyond the guarantee is refused, borrowers that opted in are evicted (the
agent's `evict` callback) and the request waits for the memory (`reclaim_wait_s`). A container
that opted in to waiting (`PreparedContainer.memory_wait_s`) has a request that does not fit
wait that long for memory to be freed instead of failing at once. While a request waits the
service writes `W` lines (ignored by libvgpu) so its reply timeout does not run out.

The node's say (`enforcement`, TESSERA_MEMORY_RECLAIM_ENFORCEMENT): a guaranteed request still
short after `reclaim_grace_s` has the borrowers that did not give the memory back evicted, whatever
their own policy (`evict`, the default), or only those that opted in (`borrower`).

Guarantees are known before their containers start: `set_booked` (fed from the node's ledger,
ledger_guarantees.py) gives every pod's guarantee per GPU from the moment it is bound to the
node; until its containers are sealed the unsealed part counts as a neighbour's guarantee
nobody holds yet, so nothing is lent out of it.

`LeaseBook` is the pure account; `ContainerLeases` serves one socket; `LeaseService` keeps one
per prepared container directory and is the card-wide view (`CardView`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .container_leases import (
    KEEPALIVE_S,
    LIMITS_RECHECK_S,
    RECALL_WAIT_S,
    CardView,
    ContainerLeases,
    memory_bounds,
)
from .containers import ContainerDir
from .lease_protocol import MAX_CONNECTIONS, LeaseBook, Peer, ProtocolError, parse_line
from .memory_lending import (
    ENFORCE_EVICT,
    ENFORCEMENTS,
    RECLAIM_POLICIES,
    Holder,
    reclaim_victims,
)

__all__ = [
    "KEEPALIVE_S", "LIMITS_RECHECK_S", "MAX_CONNECTIONS", "RECALL_WAIT_S", "CardView",
    "ContainerLeases", "LeaseBook", "LeaseService", "Peer", "ProtocolError", "ReclaimNotice",
    "memory_bounds", "parse_line",
]

SYNC_S = 0.2  # how often the service looks for new or removed container directories
READY_WAIT_S = 2.0  # how long a seal waits for its directory's socket (`LeaseService.ready`)
RECLAIM_WAIT_S = 15.0  # how long a guaranteed request waits for borrowed memory to come back
RECLAIM_GRACE_S = 5.0  # how long borrowers have to give it back before the node evicts them


@dataclass(frozen=True)
class ReclaimNotice:
    """Borrowed memory taken back on a card: `reclaimed` (the borrower's unused leases recalled,
    its allocations beyond its guarantee refused while the card is short) or `evicted` (the
    borrower opted in to eviction: the agent evicts its pod)."""

    action: str  # "reclaimed" | "evicted"
    device_uuid: str
    borrower: ContainerLeases
    borrowed_bytes: int
    short_bytes: int
    for_pod: str  # namespace/name of the container whose guarantee was due
    for_pod_uid: str
    by_node: bool = False  # evicted by the node's enforcement (not its own opt-in) ...
    after_s: float = 0.0  # ... after it kept the memory this long


class LeaseService:
    """A lease socket for every prepared container directory, opened and closed as the store's
    directories come and go (`sync`, every SYNC_S in `run`), and the card-wide view every
    container's account asks about memory beyond guarantees (`CardView`)."""

    def __init__(self, containers: Callable[[], Iterable[ContainerDir]],
                 log: logging.Logger | None = None,
                 version: Callable[[], int] | None = None,
                 card_memory: Callable[[str], int] | None = None,
                 on_reclaim: Callable[[ReclaimNotice], Awaitable[None] | None] | None = None,
                 reclaim_wait_s: float = RECLAIM_WAIT_S,
                 notice_every_s: float = 5.0,
                 enforcement: str | Callable[[], str] = ENFORCE_EVICT,
                 reclaim_grace_s: float = RECLAIM_GRACE_S) -> None:  # fmt: skip
        self.containers = containers
        self.log = log or logging.getLogger("tessera.node_agent.leases")
        self.version = version  # when given: sync only after it moved (ContainerStore.version)
        self.card_memory = card_memory  # uuid -> physical bytes (None/0: nothing is lent)
        self.on_reclaim = on_reclaim  # events, and the eviction of borrowers that opted in
        self.reclaim_wait_s = reclaim_wait_s
        self.reclaim_grace_s = reclaim_grace_s
        self._enforcement = enforcement  # a value, or read at each use (a live setting)
        self.notice_every_s = notice_every_s
        self.changed = asyncio.Condition()  # one for the node: a free anywhere may be awaited
        self.served: dict[Path, ContainerLeases] = {}
        self._by_pod: dict[str, list[ContainerLeases]] = {}  # pod uid -> its containers'
        self._synced: int | None = None
        self._failed = False
        self._noticed: dict[tuple[str, str], float] = {}  # (borrower key, uuid) -> when
        self.evicted: set[str] = set()  # pod uids evicted for their borrowed memory
        self.reclaims = 0  # times a guarantee found borrowers in its way (metrics)
        self._tasks: set[asyncio.Task[None]] = set()
        self._borrowers: dict[str, set[str]] = {}  # uuid -> keys of containers borrowing there
        self._booked: dict[str, dict[str, int]] = {}  # uuid -> pod uid -> guaranteed bytes
        self._unservable: set[Path] = set()  # directories the last sweep failed to serve
        self._sweeping = asyncio.Lock()  # the loop's sweeps and `ready` never open one socket twice

    async def sync(self) -> None:
        version = self.version() if self.version else None
        if version is not None and version == self._synced and not self._failed:
            return
        async with self._sweeping:
            await self._sweep(version)

    async def ready(self, limits_dir: Path, timeout_s: float = READY_WAIT_S) -> bool:
        """Serve a just-sealed container's directory now, not at the next sweep: its container
        may start as soon as kubelet hears back, and libvgpu finding no service refuses every
        allocation until one answers. True once its socket is open; False after `timeout_s`
        (said in the log: the container then waits for the next sweep)."""
        deadline = time.monotonic() + timeout_s
        while True:
            async with self._sweeping:
                if limits_dir not in self.served:
                    await self._sweep(self.version() if self.version else None)
            if limits_dir in self.served:
                return True
            if limits_dir in self._unservable:  # (the sweep said why; the next one tries again)
                return False
            if time.monotonic() >= deadline:
                self.log.warning("lease service: %s is not served %.1f s after its limits were "
                                 "sealed; its container waits for the next sweep", limits_dir,
                                 timeout_s)  # fmt: skip
                return False
            await asyncio.sleep(0.05)

    async def _sweep(self, version: int | None) -> None:
        """Open a socket for every prepared directory not served yet, close those gone."""
        self._failed = False
        unservable: set[Path] = set()
        present = {c.limits_dir: c for c in self.containers()}
        for path in [p for p in self.served if p not in present]:
            gone = self.served.pop(path)
            await gone.close()
            for keys in self._borrowers.values():
                keys.discard(gone.key)
        for path, cdir in present.items():
            if path in self.served or not path.is_dir():
                continue
            leases = ContainerLeases(cdir.key, path, self.log, cdir.prepared, self)
            try:
                await leases.start()
            except OSError as e:
                self.log.error("lease service: cannot serve %s: %s", path, e)
                self._failed = True  # try again at the next sync
                unservable.add(path)
                continue
            self.served[path] = leases
            self._arrived(leases)
        self._by_pod = {}
        for c in self.served.values():
            self._by_pod.setdefault(c.pod_uid, []).append(c)
        # Recorded only once the sweep is through: one that raised is swept again next time.
        self._synced = version
        self._unservable = unservable
        async with self.changed:
            self.changed.notify_all()  # a container gone: its memory may be what one waits for

    # ---- the card-wide view (CardView) --------------------------------------------------------

    @property
    def enforcement(self) -> str:
        value = self._enforcement() if callable(self._enforcement) else self._enforcement
        return value if value in ENFORCEMENTS else ENFORCE_EVICT

    def _arrived(self, new: ContainerLeases) -> None:
        """A container was sealed onto cards: where its guarantee leaves borrowers holding more
        than the card has room for, their unused leases come back now (their next allocation
        beyond the guarantee asks, and is refused while the card is short)."""
        new.limit("")  # read its sealed limits
        for uuid in new.uuids():
            self._recall_if_short(uuid, new)

    def _recall_if_short(self, uuid: str, new: ContainerLeases | None = None) -> None:
        card = self.card_bytes(uuid)
        if not card or not self._borrowers.get(uuid):
            return
        holders = [c.holder(uuid, fresh=False) for c in self.served.values()]
        if card - sum(h.reserved for h in holders + self._pending(uuid)) < 0:
            for c in self.served.values():
                if c is not new and c.holder(uuid, fresh=False).borrowed:
                    c.recall_all(uuid)

    def set_booked(self, booked: dict[str, dict[str, int]]) -> None:
        """The guarantees on the node's ledger: GPU uuid -> pod uid -> bytes guaranteed (every
        active allocation: reserved, bound, allocated). A pod's guarantee counts from here on,
        before its containers are sealed; borrowers whose loans it leaves the card short of
        have their unused leases recalled at once."""
        changed = {u for u in booked.keys() | self._booked.keys()
                   if booked.get(u) != self._booked.get(u)}  # fmt: skip
        self._booked = {u: dict(pods) for u, pods in booked.items() if pods}
        for uuid in changed:
            self._recall_if_short(uuid)

    def _pending(self, uuid: str) -> list[Holder]:
        """The part of each booked guarantee on `uuid` that no sealed container of its pod
        holds yet, as a neighbour that holds nothing yet (it may not be lent)."""
        out = []
        for pod, booked in self._booked.get(uuid, {}).items():
            sealed = sum(c.holder(uuid, fresh=False).guarantee for c in self._by_pod.get(pod, ()))
            if booked > sealed:
                out.append(Holder(f"{pod}/booked", booked - sealed, booked - sealed, 0))
        return out

    def card_bytes(self, uuid: str) -> int:
        if self.card_memory is None:
            return 0
        try:
            return max(0, int(self.card_memory(uuid)))
        except Exception:  # an unknown card lends nothing
            return 0

    def others(self, me: ContainerLeases, uuid: str) -> list[Holder]:
        out = []
        for c in self.served.values():
            if c is me:
                continue
            h = c.holder(uuid, fresh=False)
            if h.limit:
                out.append(h)
        return out + self._pending(uuid)

    def held_changed(self, c: ContainerLeases, uuid: str) -> None:
        """Keep the set of borrowers per GPU (a hard slice's request asks only that)."""
        if c.holder(uuid, fresh=False).borrowed:
            self._borrowers.setdefault(uuid, set()).add(c.key)
        elif uuid in self._borrowers:
            self._borrowers[uuid].discard(c.key)

    def borrowing(self, uuid: str, other_than: ContainerLeases) -> bool:
        """Some container other than `other_than` holds memory beyond its guarantee on `uuid`."""
        keys = self._borrowers.get(uuid)
        return bool(keys) and (len(keys) > 1 or other_than.key not in keys)

    def recall_freed(self, uuid: str) -> None:
        """A request on `uuid` waits: processes that freed memory since their last recall
        probably keep a chunk of it unused (libvgpu does): ask for it once more."""
        for c in self.served.values():
            c.recall_freed(uuid)

    def reclaim(self, me: ContainerLeases, uuid: str, short: int) -> None:
        """`me`'s guarantee on `uuid` is due and borrowers hold the memory: recall their unused
        leases, evict those that opted in (enough to cover `short`), say so."""
        self.reclaims += 1
        borrowers = [c for c in self.served.values()
                     if c is not me and c.holder(uuid).borrowed]  # fmt: skip
        victims = {h.key for h in reclaim_victims([c.holder(uuid) for c in borrowers], short)}
        now = time.monotonic()
        for c in borrowers:
            c.recall_all(uuid)
            evict = c.key in victims and c.pod_uid not in self.evicted
            if evict:
                self.evicted.add(c.pod_uid)
            elif now - self._noticed.get((c.key, uuid), -1e18) < self.notice_every_s:
                continue
            self._noticed[(c.key, uuid)] = now
            p = me.prepared
            notice = ReclaimNotice(
                "evicted" if evict else "reclaimed", uuid, c, c.holder(uuid).borrowed, short,
                f"{p.namespace}/{p.pod}" if p else "", me.pod_uid)
            self.log.warning("lease service: borrowed memory %s", notice.action, extra={
                "container": c.key, "device": uuid, "borrowed": notice.borrowed_bytes,
                "short": short, "for": notice.for_pod})  # fmt: skip
            self._emit(notice)

    def enforce(self, me: ContainerLeases, uuid: str, short: int, waited_s: float) -> None:
        """`me`'s guarantee on `uuid` has waited `waited_s` (the grace bound) and is still
        `short`: under the node's enforcement `evict`, evict the borrowers that kept the memory,
        whatever their own policy, most borrowed first, beyond what evictions already under way
        will free. Under `borrower` nothing more happens (the wait runs out; the driver decides).
        """
        if self.enforcement != ENFORCE_EVICT or short <= 0:
            return
        borrowers = [c for c in self.served.values()
                     if c is not me and c.holder(uuid).borrowed]  # fmt: skip
        coming = sum(c.holder(uuid).leased for c in borrowers if c.pod_uid in self.evicted)
        rest = [c.holder(uuid) for c in borrowers if c.pod_uid not in self.evicted]
        victims = {h.key for h in reclaim_victims(rest, short - coming, RECLAIM_POLICIES)}
        p = me.prepared
        for c in borrowers:
            if c.key not in victims or c.pod_uid in self.evicted:
                continue
            self.evicted.add(c.pod_uid)
            notice = ReclaimNotice(
                "evicted", uuid, c, c.holder(uuid).borrowed, short,
                f"{p.namespace}/{p.pod}" if p else "", me.pod_uid, by_node=True, after_s=waited_s)
            self.log.warning("lease service: borrower evicted by the node's policy", extra={
                "container": c.key, "device": uuid, "borrowed": notice.borrowed_bytes,
                "short": short, "for": notice.for_pod, "after_s": round(waited_s, 1)})  # fmt: skip
            self._emit(notice)

    def _emit(self, notice: ReclaimNotice) -> None:
        if self.on_reclaim is None:
            return
        try:
            out = self.on_reclaim(notice)
        except Exception:
            self.log.exception("lease service: reclaim callback failed")
            return
        if out is not None:
            task = asyncio.ensure_future(out)
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("lease service: reclaim callback failed: %s", task.exception())

    def memory_view(self) -> list[tuple[ContainerLeases, str, Holder]]:
        """(container, GPU, its guarantee / limit / leased) for every sealed GPU served."""
        return [(c, u, c.holder(u)) for c in self.served.values() for u in c.uuids()]

    # ---- per pod (the watchdog's questions) ---------------------------------------------------

    def attested(self) -> dict[int, str]:
        """host pid -> pod uid, for every process with a live lease connection."""
        return {p.pid: c.pod_uid for c in self.served.values() for p in c.peers.values()}

    def leased_by_pod(self, pod_uid: str, uuid: str) -> int:
        """What the pod's containers hold on lease on `uuid`."""
        return sum(c.leased(uuid) for c in self._by_pod.get(pod_uid, ()))

    def leases_memory(self, pod_uid: str, uuid: str) -> bool:
        """Some container of the pod leases its memory on `uuid` (sealed with a limit there)."""
        return any(c.leasing(uuid) for c in self._by_pod.get(pod_uid, ()))

    def limit_of_pod(self, pod_uid: str, uuid: str) -> int:
        return sum(c.limit(uuid) for c in self._by_pod.get(pod_uid, ()))

    def for_key(self, key: str) -> ContainerLeases | None:
        return next((c for c in self.served.values() if c.key == key), None)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    await self.sync()
                except Exception:
                    self.log.exception("lease service: sync failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), SYNC_S)
        finally:
            await self.close()

    async def close(self) -> None:
        for leases in self.served.values():
            await leases.close()
        self.served.clear()
        self._by_pod.clear()
        for task in list(self._tasks):
            task.cancel()
