"""What the scheduler reads from the bus is validated before the index sees it.

- A node registration with a problem (capacity no GPU has, ...) is not applied: the node keeps
  its last valid registration (or stays unknown), and the rejection is counted and published.
- A ledger entry that does not decode, or holds a grant beyond its device, puts the node in
  quarantine: the index keeps the node's last valid ledger (its allocations still count), filter
  and bind refuse the node with `LedgerUnreadable: ...`, and a repair rewrites the key from the
  newest valid revision in the KV history, then lets `rebuild` (the cluster-side rebuild: pods
  bound to the node carry their grants in annotations) complete it. The repair is a CAS against
  the bad revision, so concurrent replicas repair once and a legitimate write in between wins.
  `LedgerGuard.repair(node)` is the hook other code (the lost-ledger rebuild) may call.
- A quota record with a problem is ignored (the last valid one stays).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from tessera import bus, hami
from tessera.cluster.port import ClusterError, ClusterPort
from tessera.codec import CodecError, decode, encode
from tessera.device_kinds import pod_grants
from tessera.models import Allocation, AllocationState, NodeLedger, NodeRegistration, QuotaState
from tessera.validation import (
    Bounds,
    Problem,
    Rejections,
    ledger_problem,
    quota_problem,
    registration_problem,
)

from .index import ClusterIndex
from .wire_fast import LedgerWire, RegistrationWire

log = logging.getLogger("tessera.scheduler.validation")
LEDGER_UNREADABLE = "LedgerUnreadable"
_FINISHED = ("Succeeded", "Failed")

# (node, the newest valid value from history or None) -> the value to write back
Rebuild = Callable[[str, NodeLedger | None], Awaitable[NodeLedger]]


def _whole_entry_check(allocation: Allocation) -> bool:
    """Whether `ledger_problem` judges this allocation against the whole entry and the clock
    (a preemption mark, a dynamic-MIG grant)."""
    return bool(allocation.preempted_by or allocation.preempted_until is not None
                or allocation.mig_grants())


def _counted_within(key: str, value: LedgerWire, registration: Any, bounds: Bounds) -> bool:
    """Whether an entry read whole at start-up passes `ledger_problem`, judged on the sums
    `wire_fast.slim_all` counted as it read it (5,000 entries, 80,000 allocations at start-up:
    one comparison per GPU instead of one per grant).

    slim_all counts only an entry every allocation of which passes the checks
    `ledger_problem` makes of it alone (its uid, its node is the entry's, its container count,
    no GPU twice in a container) and carries no preemption mark; and a complete entry holds no
    MIG grant (wire_fast's complete grant has none). What is left is every grant within its
    card (the registration's memory and cores, the bounds' for a GPU it lacks): amounts are
    never negative (msgspec checked `ge=0`), so a GPU whose grants' sums are within its card
    holds every one of them within it. True only then; False says nothing (the whole entry
    is judged as always, problem and wording included)."""
    usage = value.usage
    if usage is None or value.node != key:
        return False
    capacity = (
        {d.uuid: (d.memory_mib, d.cores) for d in registration.devices}
        if registration is not None
        else {}
    )
    for uuid, (memory, cores, _slots) in usage.items():
        card = capacity.get(uuid)
        if card is None:  # a GPU the registration lacks: judged against the bounds
            card = (bounds.max_advertised_mib, bounds.max_cores)
        if memory > card[0] or cores > card[1]:
            return False
    return True


class LedgerGuard:
    """Validates registrations, ledger entries and quota records; quarantines and repairs."""

    def __init__(
        self,
        *,
        bounds: Bounds,
        index: ClusterIndex,
        ledger_kv: KeyValue,
        rejections: Rejections,
        rebuild: Rebuild | None = None,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bounds = bounds
        self.clock = clock  # judges preemption marks (tessera.validation.mark_problem)
        self.index = index
        self.ledger_kv = ledger_kv
        self.rejections = rejections
        self.rebuild = rebuild
        self.retry_s = retry_s
        self.quarantined: dict[str, tuple[int, Problem]] = {}  # node -> (bad revision, why)
        self._repairs: dict[str, asyncio.Task[None]] = {}
        # node -> (the devices list, the allocations map of a value judged valid with them)
        self._judged: dict[str, tuple[Any, dict[str, Allocation]]] = {}

    # --- checks called by the watches -----------------------------------------------------------
    def registration_ok(
        self, key: str, value: NodeRegistration | RegistrationWire, revision: int = 0
    ) -> bool:
        problem = registration_problem(key, value, self.bounds)
        if problem is None:
            self.rejections.accepted("registration", key)
            return True
        self.rejections.reject("registration", key, problem, revision)
        return False

    def registration_undecodable(self, key: str, exc: Exception) -> None:
        self.rejections.reject("registration", key, Problem("undecodable", str(exc)[:300]))

    def quota_ok(self, key: str, value: QuotaState, revision: int = 0) -> bool:
        problem = quota_problem(key, value)
        if problem is None:
            return True
        self.rejections.reject("quota", key, problem, revision)
        return False

    def quota_undecodable(self, key: str, exc: Exception) -> None:
        self.rejections.reject("quota", key, Problem("undecodable", str(exc)[:300]))

    def ledger_ok(self, key: str, value: NodeLedger, revision: int) -> bool:
        entry = self.index.entries.get(key)
        registration = entry.registered if entry is not None else None
        problem = self._ledger_problem(key, value, registration)
        if problem is None:
            self.ledger_valid(key)
            return True
        self.ledger_rejected(key, revision, problem)
        return False

    def _ledger_problem(
        self, key: str, value: NodeLedger, registration: Any
    ) -> Problem | None:
        """`tessera.validation.ledger_problem`, judging again only what changed.

        A node's entry is rewritten for one pod at a time, and the codec hands the allocations
        that did not change over as the very objects of the value before. Every check
        `ledger_problem` makes of an allocation without a preemption mark or a MIG grant reads
        only that allocation, its uid, the key and the registration's devices. So when the
        last value judged valid under this key was judged with the same devices list, and
        neither it nor any changed allocation has a mark or a MIG grant (those are judged
        against the whole entry and the clock), only the allocations that are not the same
        objects as then are judged; the rest passed the same checks. On a problem the whole
        value is judged again, so the problem reported is the one it always was. An entry
        read at start-up whose usage was counted as it was read is cleared on those sums
        when they fit its cards (`_counted_within`), else judged whole."""
        if type(value) is LedgerWire and _counted_within(key, value, registration, self.bounds):
            self._judged.pop(key, None)
            return None
        devices = registration.devices if registration is not None else None
        fresh = type(value) is NodeLedger
        judged = self._judged.get(key) if fresh else None
        if judged is not None and judged[0] is devices and value.node == key:
            seen = judged[1]
            changed = {uid: a for uid, a in value.allocations.items() if seen.get(uid) is not a}
            if not any(map(_whole_entry_check, changed.values())):
                subset = value.model_copy(update={"allocations": changed})
                if ledger_problem(key, subset, registration, self.bounds) is None:
                    self._judged[key] = (devices, value.allocations)
                    return None
        problem = ledger_problem(key, value, registration, self.bounds, self.clock())
        if problem is None and fresh and not any(map(_whole_entry_check,
                                                     value.allocations.values())):  # fmt: skip
            self._judged[key] = (devices, value.allocations)
        else:
            self._judged.pop(key, None)
        return problem

    def ledger_valid(self, key: str) -> None:
        """A valid value (or a delete) arrived: the node leaves quarantine."""
        if self.quarantined.pop(key, None) is not None:
            log.info("ledger entry valid again", extra={"node": key})
        self.rejections.accepted("ledger", key)

    def ledger_rejected(self, key: str, revision: int, problem: Problem) -> None:
        self.quarantined[key] = (revision, problem)
        self.rejections.reject("ledger", key, problem, revision)
        task = self._repairs.get(key)
        if task is None or task.done():
            self._repairs[key] = asyncio.get_running_loop().create_task(self._repair_until_ok(key))

    # --- what filter and bind ask ----------------------------------------------------------------
    def refusal(self, node: str) -> str | None:
        bad = self.quarantined.get(node)
        if bad is None:
            return None
        return (f"{LEDGER_UNREADABLE}: the node's ledger entry (revision {bad[0]}) was rejected "
                f"({bad[1].code}); it is being repaired")  # fmt: skip

    def refusals(self, names: list[str]) -> dict[str, str]:
        if not self.quarantined:
            return {}
        out = {}
        for name in names:
            why = self.refusal(name)
            if why is not None:
                out[name] = why
        return out

    # --- repair ----------------------------------------------------------------------------------
    async def _repair_until_ok(self, node: str) -> None:
        while node in self.quarantined:
            try:
                if await self.repair(node):
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("ledger repair failed; retrying", extra={"node": node, "err": str(exc)})
            await asyncio.sleep(self.retry_s)

    async def repair(self, node: str) -> bool:
        """Rewrite the node's ledger entry from its newest valid revision (+ `rebuild`).

        True when the key now holds a valid value (written by this call, or by anyone)."""
        try:
            history = await bus.history(self.ledger_kv, node)
        except KeyNotFoundError:
            self.ledger_valid(node)
            return True
        latest = history[-1]
        good: NodeLedger | None = None
        for entry in reversed(history):
            if entry.operation in ("DEL", "PURGE") or entry.value is None:
                if entry is latest:
                    self.ledger_valid(node)
                    return True
                break  # the key was deleted before: empty is the last valid state
            value = self._valid(node, entry.value)
            if value is not None:
                if entry is latest:  # valid already (someone wrote one): nothing to repair
                    self.ledger_valid(node)
                    return True
                good = value
                break
        repaired = await self.rebuild(node, good) if self.rebuild else good
        repaired = repaired or NodeLedger(node=node)
        try:
            await self.ledger_kv.update(node, encode(repaired), last=latest.revision)
        except KeyWrongLastSequenceError:
            return False  # someone wrote meanwhile: the watch judges that value
        log.warning("ledger entry repaired", extra={
            "node": node, "from_revision": latest.revision,
            "allocations": len(repaired.allocations),
        })  # fmt: skip
        return True

    def _valid(self, node: str, payload: bytes) -> NodeLedger | None:
        try:
            value = decode(payload, NodeLedger)
        except CodecError:
            return None
        entry = self.index.entries.get(node)
        registration = entry.registered if entry is not None else None
        problem = ledger_problem(node, value, registration, self.bounds, self.clock())
        return value if problem is None else None

    async def stop(self) -> None:
        for task in self._repairs.values():
            task.cancel()
        for task in self._repairs.values():
            with contextlib.suppress(BaseException):
                await task
        self._repairs.clear()


def cluster_rebuild(cluster: ClusterPort) -> Rebuild:
    """Complete a repaired ledger from the cluster: every live pod bound to the node whose
    HAMi annotation carries its grants and that the history value lacks is added back, so no
    running pod loses its allocation (and its GPU is never handed out twice)."""

    async def rebuild(node: str, base: NodeLedger | None) -> NodeLedger:
        ledger = base.model_copy(deep=True) if base is not None else NodeLedger(node=node)
        try:
            pods = await cluster.list_pods(node_name=node)
        except ClusterError as exc:
            if base is None:
                raise  # nothing to write that would not lose allocations: retry later
            log.warning("ledger repair without the cluster", extra={"err": str(exc)})
            return ledger
        for pod in pods:
            allocation = allocation_from_pod(pod, node)
            if allocation is not None and allocation.pod_uid not in ledger.allocations:
                ledger.allocations[allocation.pod_uid] = allocation
        return ledger

    return rebuild


def allocation_from_pod(pod: dict[str, Any], node: str) -> Allocation | None:
    """The allocation a bound, live pod's annotations describe (None if it has none)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if (pod.get("status") or {}).get("phase") in _FINISHED:
        return None
    if (pod.get("spec") or {}).get("nodeName") != node or not meta.get("uid"):
        return None
    try:
        text = pod_grants.pod_grants_text(annotations)  # each family's record
        if not text:
            return None
        containers = hami.decode_pod_devices(text)
    except ValueError:
        return None
    placements = annotations.get(hami.ANN_MIG_INSTANCES)
    if isinstance(placements, str) and placements:
        # dynamic MIG: the node agent adopts the instances it finds there. Unreadable: the
        # grants still count (as slices, so no MIG pod joins the card until they are gone).
        with contextlib.suppress(ValueError):
            containers = hami.apply_mig_instances(containers, placements)
    spec = pod.get("spec") or {}
    names = [c.get("name", "") for c in (spec.get("initContainers") or [])]
    names += [c.get("name", "") for c in (spec.get("containers") or [])]
    return Allocation(
        pod_uid=meta["uid"], namespace=meta.get("namespace") or "default", name=meta["name"],
        node=node, containers=containers, init_count=len(spec.get("initContainers") or []),
        state=AllocationState.ALLOCATED, container_names=names,
        reason="rebuilt from the pod's annotations after a ledger repair",
    )  # fmt: skip
