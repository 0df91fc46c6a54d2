"""Rebuilding the ledger from the cluster: the cluster is the durable record.

Every pod the scheduler binds carries its grants in HAMi's annotations
(`hami.io/vgpu-devices-to-allocate`, `hami.io/vgpu-node`, `hami.io/bind-phase`); a pod the DRA
allocator placed, in its ResourceClaims' allocation (rebuild_dra.py). When the ledger
is empty or lost (NATS lost its store, a bucket was deleted), the bound pods still run on those
grants, so before any new placement the scheduler lists every pod and writes back, per node, the
allocations the ledger is missing. Each node is one compare-and-set that only ever *adds* missing
pods, so any number of replicas may rebuild at once, and a rebuild over an intact ledger writes
nothing.

`restore_mutate` is pure (reading the pods is `tessera.restore`, shared with quota, which rebuilds
its charges from the same pods); `LedgerRebuilder` does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from tessera.bus import CasConflictError, NoChange, Versioned, cas_update
from tessera.cluster.port import ClusterPort
from tessera.cluster.resources_port import list_claims_if_served
from tessera.cluster.slim_pods import list_pods_slim
from tessera.dra_restore import claim_nodes
from tessera.models import Allocation, DeviceInfo, InFlightClaim, NodeLedger
from tessera.restore import RestoreReport, RestoreRules, allocations_from_pods, checked_restore
from tessera.settings import TesseraSettings
from tessera.signing import TrustStore

from .foreign import ForeignCapacity
from .index import ClusterIndex
from .rebuild_dra import merge_dra
from .stale import Listing, UnlistedRecorder

log = logging.getLogger("tessera.scheduler")


Check = Callable[
    [list[tuple[Allocation, InFlightClaim | None]], NodeLedger | None],
    list[tuple[Allocation, InFlightClaim | None]],
]


def restore_mutate(
    node: str,
    found: list[tuple[Allocation, InFlightClaim | None]],
    restored: list[str],
    current: NodeLedger | None,
    check: Check | None = None,
) -> NodeLedger:
    """Add the pods the node's ledger lacks; never change or drop what it holds. The claim is
    restored only when the node has none. `check` (tessera.restore.checked_restore) gets what
    would be added and the ledger it would join, and answers what may be."""
    restored.clear()
    ledger = current or NodeLedger(node=node)
    if check is not None:
        found = check([f for f in found if not _held(ledger, f[0].pod_uid)], current)
    allocations = dict(ledger.allocations)
    claim = ledger.claim
    for allocation, pod_claim in found:
        held = allocations.get(allocation.pod_uid)
        if held is not None and held.active:
            continue
        allocations[allocation.pod_uid] = allocation
        restored.append(allocation.pod_uid)
        if claim is None and pod_claim is not None:
            claim = pod_claim
    if not restored:
        raise NoChange
    return ledger.model_copy(update={"allocations": allocations, "claim": claim})


def restore_rules(settings: TesseraSettings) -> RestoreRules:
    """The checks of restored grants, with the node agents' keys from the trust file."""
    trust = TrustStore.load(settings.command_trust_file) if settings.command_trust_file else None
    return RestoreRules(settings, trust.keys if trust is not None else None)


def _held(ledger: NodeLedger, uid: str) -> bool:
    held = ledger.allocations.get(uid)
    return held is not None and held.active


class LedgerRebuilder:
    """Lists every pod and restores, node by node, the allocations the ledger lacks."""

    def __init__(
        self,
        *,
        cluster: ClusterPort,
        index: ClusterIndex,
        write: Callable[..., Any],
        quota_enabled: bool,
        claim_ttl_s: float,
        clock: Callable[[], float],
        foreign: ForeignCapacity | None = None,
        rules: RestoreRules | None = None,
        registration_wait_s: float = 0.0,
    ) -> None:
        self.cluster = cluster
        self.foreign = foreign  # HAMi's pods: counted apart (foreign.py), never restored here
        self.index = index
        self.write = write  # (node, mutate) -> Versioned[NodeLedger]; the ledger KV's CAS
        self.quota_enabled = quota_enabled
        self.claim_ttl_s = claim_ttl_s
        self.clock = clock
        # What the last rebuild's listing lacked (stale.py); taken by the runtime once used.
        self.listed: Listing | None = None
        # Restored grants are checked as live ledger values are (tessera.restore); a node
        # whose registration is not back yet is waited for this long (its capacity is needed).
        self.rules = rules
        self.registration_wait_s = registration_wait_s
        self.on_problem: Callable[[str], None] | None = None  # reports each (runtime: event)

    async def rebuild(self) -> RestoreReport:
        report = RestoreReport()
        # A pod the index already places (an active allocation in the synced ledger: on its
        # node, held; on another, not restored twice) needs nothing: its annotations are not
        # read, and a node whose pods are all placed is neither read nor written (`restore_mutate`
        # would leave it as it is). A restart over an intact ledger used to decode every GPU
        # pod's annotations into models and read and decode every node's entry once more, before
        # serving: at 5,000 nodes and 80,000 pods, seconds. Such a pod that is not HAMi's (see
        # `needed`) is not even decoded: the listing reads its uid and scheduler name first
        # (page by page: placed as the index holds it when the page comes in, where the whole
        # listing was tested once it was in).
        placed = self.index.pod_nodes
        listed_at = self.clock()
        seen = UnlistedRecorder(partial(
            needed, placed, self.foreign.scheduler_name if self.foreign else None), placed)
        listed = await list_pods_slim(self.cluster, seen)
        self.listed = seen.listing(listed_at)
        now = self.clock()
        report.pods_seen += listed.skipped
        pods = listed.pods  # only what the rebuild and HAMi's classification read of a pod
        if self.foreign is not None:
            pods = self.foreign.load(pods, now)
        unplaced = [pod for pod in pods if not _placed(pod, placed)]
        report.pods_seen += len(pods) - len(unplaced)
        by_node = allocations_from_pods(
            unplaced, quota_held=self.quota_enabled, now=now, claim_ttl_s=self.claim_ttl_s,
            report=report,
        )  # fmt: skip
        # DRA pods: their slices are in their ResourceClaims, not in annotations (rebuild_dra).
        claims = []
        if any(_has_claims(p) for p in unplaced):
            claims = await list_claims_if_served(self.cluster)
        dra_nodes = _dra_pod_nodes(unplaced, claim_nodes(claims)) if claims else set()
        if self.rules is not None and (by_node or dra_nodes):
            await self._await_registrations(set(by_node) | dra_nodes)
        if claims:
            merge_dra(by_node, claims, unplaced, self._devices_of,
                      quota_held=self.quota_enabled, now=now, report=report)  # fmt: skip
        pods_by_uid = {str((p.get("metadata") or {}).get("uid")): p for p in unplaced
                       if isinstance(p, dict)} if self.rules is not None else {}  # fmt: skip
        for node, found in by_node.items():
            self._check_devices(node, found, report)
            # Not restored twice: a uid restored on another node in this pass (two pods
            # claiming one uid) is placed there now.
            missing = [f for f in found if placed.get(f[0].pod_uid) in (None, node)]
            restored: list[str] = []
            checked = RestoreReport()
            check = None
            if self.rules is not None:
                check = partial(self._check, node, pods_by_uid, checked)
            try:
                result: Versioned[NodeLedger] = await self.write(
                    node, partial(restore_mutate, node, missing, restored, check=check)
                )
            except NoChange:
                self._announce(checked, report)
                continue
            except CasConflictError as exc:
                raise RuntimeError(f"ledger rebuild of {node} lost too many races") from exc
            self._announce(checked, report)
            self.index.set_ledger(node, result.value, result.revision, self.clock())
            report.restored += len(restored)
            report.nodes_written += 1
        if report.restored or report.unreadable or report.unknown_devices or report.refused:
            log.warning("ledger rebuilt from the cluster's pods", extra={
                "restored": report.restored, "nodes": report.nodes_written,
                "gpu_pods": report.gpu_pods, "unreadable": report.unreadable[:10],
                "unknown_devices": report.unknown_devices[:10],
                "forged": report.forged[:10], "refused": report.refused[:10],
            })  # fmt: skip
        return report

    def _devices_of(self, node: str) -> list[DeviceInfo] | None:
        """The node's registered GPUs (None: it has not registered)."""
        entry = self.index.entries.get(node)
        registration = entry.registration if entry is not None else None
        return list(registration.devices) if registration is not None else None

    def _check(
        self, node: str, pods: dict[str, Any], checked: RestoreReport,
        found: list[tuple[Allocation, InFlightClaim | None]], current: NodeLedger | None,
    ) -> list[tuple[Allocation, InFlightClaim | None]]:
        """restore_mutate's check (called again on a CAS retry: the report is rewritten)."""
        assert self.rules is not None
        checked.forged.clear()
        checked.refused.clear()
        entry = self.index.entries.get(node)
        registration = entry.registration if entry is not None else None
        devices = {d.uuid: d for d in registration.devices} if registration else None
        held = current.allocations.values() if current is not None else ()
        return checked_restore(node, found, pods, devices, held, self.rules, checked)

    def _announce(self, checked: RestoreReport, report: RestoreReport) -> None:
        """Each forged or refused restoration: in the report (logged), and as an event."""
        report.forged += checked.forged
        report.refused += checked.refused
        if self.on_problem is not None:
            for line in [*checked.forged, *checked.refused]:
                self.on_problem(line)

    async def _await_registrations(self, nodes: set[str]) -> None:
        """After NATS lost its store the agents re-register within a heartbeat: wait (at most
        `registration_wait_s`) for those of nodes with pods to restore, so their capacity is
        checked. A node still unknown is restored with grants cut to the requests only (it is
        not schedulable before it registers)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.registration_wait_s
        while loop.time() < deadline:
            missing = [n for n in nodes if (e := self.index.entries.get(n)) is None
                       or e.registered is None]  # fmt: skip
            if not missing:
                return
            await asyncio.sleep(0.1)

    def _check_devices(
        self, node: str, found: list[tuple[Allocation, InFlightClaim | None]],
        report: RestoreReport,
    ) -> None:
        """Grants on devices the node's registration does not list are restored anyway (the pod
        runs on them) but reported: the node agent may have re-registered different GPUs."""
        entry = self.index.entries.get(node)
        if entry is None or entry.registered is None:
            return
        known = {d.uuid for d in entry.registered.devices}  # as read: no model built for this
        for allocation, _claim in found:
            for grant in (g for c in allocation.containers for g in c):
                if grant.uuid not in known:
                    report.unknown_devices.append(
                        f"{allocation.namespace}/{allocation.name} on {node}: {grant.uuid}"
                    )


def needed(placed: dict[str, str], ours: str | None, uids: list[Any], schedulers: list[Any]
           ) -> list[bool]:  # fmt: skip
    """Which listed pods the rebuild reads, by uid and scheduler name: all but those the index
    places (`_placed`) that are not HAMi's — `ForeignCapacity.classify` takes a pod for HAMi's
    only when its scheduler is set and not ours (`ours` None: no HAMi pod is classified here,
    any scheduler name will do)."""
    if ours is None:
        return [not (type(uid) is str and uid in placed) for uid in uids]
    return [not (type(uid) is str and uid in placed and (not scheduler or scheduler == ours))
            for uid, scheduler in zip(uids, schedulers, strict=True)]  # fmt: skip


def _has_claims(pod: Any) -> bool:
    spec = pod.get("spec") if isinstance(pod, dict) else None
    return isinstance(spec, dict) and bool(spec.get("resourceClaims"))


def _dra_pod_nodes(pods: list[Any], pools: set[str]) -> set[str]:
    """The nodes of pods with ResourceClaims that this driver allocated devices on."""
    return {str(p["spec"].get("nodeName")) for p in pods
            if _has_claims(p) and p["spec"].get("nodeName") in pools}  # fmt: skip


def _placed(pod: Any, placed: dict[str, str]) -> bool:
    """Whether the index holds an active allocation for this pod's uid."""
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    uid = meta.get("uid") if isinstance(meta, dict) else None
    return type(uid) is str and uid in placed


async def ledger_cas(kv: Any, node: str, mutate: Callable[[NodeLedger | None], NodeLedger]) -> Any:
    return await cas_update(kv, node, NodeLedger, mutate)
