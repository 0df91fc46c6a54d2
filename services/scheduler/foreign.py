"""Capacity HAMi holds while a cluster migrates to Tessera node by node.

The procedure: docs/migrating-from-hami.md.

During a migration both systems run. Tessera places pods only on nodes its own node agent
registered (only there is a slice enforced and its identity proven), so a node registered by
HAMi's device plugin is **read-only**: its `hami.io/node-nvidia-register` is read, shown in
refusals, and never placed on. So are the other families' registrations HAMi's scheduler reads
(`hami.io/node-register-<commonWord>` of HAMi's Ascend plugin, `hami.io/node-dcu-register`, the
MLU capacity Cambricon's plugin advertises: `DeviceFamily.hami_registration`): named in a refusal
of a node no Tessera agent registered, and of a node whose Tessera agent serves another family
(the annotation of a family it serves is its own).

Pods HAMi's scheduler placed (their `hami.io/vgpu-devices-allocated` or `-to-allocate`,
`hami.io/vgpu-node` and `hami.io/bind-phase` annotations; another family's own record) hold
devices wherever they run, also on a node that has since switched to Tessera's node agent: what
they hold counts as used, in the index and in the reservation's compare-and-set, and is never
written to the ledger (the ledger is Tessera's record; the cluster is HAMi's pods' record). A
910C pod's record lists each NPU, as HAMi's Ascend plugin registers them; Tessera's registration
lists the module (`ForeignNode.held`).

A pod is HAMi's when its `spec.schedulerName` is set and is not Tessera's and it carries HAMi's
placement annotations. It holds its grants from the moment HAMi's scheduler names its node until
it ends (Succeeded, Failed, deleted) or its bind failed before it was bound. Anything unreadable
fails closed: a HAMi pod whose annotations do not decode, disagree with its node, or name a GPU
the node's Tessera registration does not list puts the node under quarantine
(`HAMiCapacityUnknown: ...`, nothing placed there) until the pod is fixed or gone; an unreadable
node registration is reported, the node stays unusable (as every node without Tessera's agent).

Fed by the scheduler's pod watch, a node watch, the rebuild before the scheduler serves (so a
restart rebuilds all of it from the cluster) and the periodic reconcile. No KV, no bus.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge

from tessera import hami
from tessera.cluster.port import WatchEvent
from tessera.device_kinds import pod_grants, registry
from tessera.device_kinds.types import HamiRegistration
from tessera.models import Allocation, AllocationState, DeviceInfo, NodeLedger
from tessera.restore import FINISHED_PHASES, init_containers_succeeded
from tessera.settings import TesseraSettings

from .foreign_node import ForeignNode, ForeignPod
from .validation import Rebuild

if TYPE_CHECKING:
    from .index import ClusterIndex

log = logging.getLogger("tessera.scheduler.foreign")

ANN_ALLOCATION_MODE = "tessera.io/allocation-mode"
# HAMi's scheduler writes `hami.io/vgpu-node` for a pod of any device type, and each family's
# own record (tessera.device_kinds.pod_grants): an Ascend, MLU or DCU pod HAMi placed holds too.
_HAMI_KEYS = (hami.ANN_DEVICES_ALLOCATED, hami.ANN_DEVICES_TO_ALLOCATE, hami.ANN_VGPU_NODE)
_TOMBSTONE_S = 600.0
_LISTING_SLACK_S = 5.0


class ForeignCapacity:
    """Keeps `index.foreign` (node -> ForeignNode) current from pods and Node objects."""

    def __init__(
        self,
        *,
        settings: TesseraSettings,
        index: ClusterIndex,
        cluster: Any = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float],
    ) -> None:
        self.settings = settings
        self.scheduler_name = settings.scheduler_name
        self.index = index
        self.cluster = cluster
        self.clock = clock
        self.pods: dict[str, ForeignPod] = {}
        self.by_node: dict[str, dict[str, ForeignPod]] = {}
        # node -> (HAMi's devices or None, why its annotation was refused)
        self.registers: dict[str, tuple[tuple[DeviceInfo, ...] | None, str]] = {}
        self._texts: dict[str, object] = {}  # node -> the annotation text last decoded
        # node -> other families' HAMi registrations (`_read_vendors`), and what they were read
        # from
        self.vendor_registers: dict[str, tuple[HamiRegistration, ...]] = {}
        self._vendor_inputs: dict[str, tuple[Any, ...]] = {}
        self.dra_nodes: set[str] = set()  # nodes whose agent serves DRA (never placed on)
        self.nodes_listed = asyncio.Event()  # the Node watch's first listing applied
        self._gone: dict[str, float] = {}  # uid -> when it stopped holding (deleted, finished)
        if registry is not None:
            self._gauges(registry)

    # --- reading one pod ----------------------------------------------------------------------
    def classify(self, pod: dict[str, Any]) -> tuple[bool, ForeignPod | None]:
        """(is it HAMi's, what it holds now: None = nothing)."""
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        spec = pod.get("spec") if isinstance(pod, dict) else None
        if not isinstance(meta, dict) or not isinstance(spec, dict):
            return False, None
        annotations = meta.get("annotations") or {}
        scheduler = spec.get("schedulerName")
        if not isinstance(annotations, dict) or not scheduler or scheduler == self.scheduler_name:
            return False, None
        if not any(key in annotations for key in _HAMI_KEYS):
            return False, None
        uid, name = meta.get("uid"), meta.get("name")
        if not isinstance(uid, str) or not uid:
            return True, None  # nothing to follow it by (the API server always sets one)
        status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
        bound = spec.get("nodeName") or ""
        decided = annotations.get(hami.ANN_VGPU_NODE) or ""
        if status.get("phase") in FINISHED_PHASES:
            return True, None
        if not bound and (not decided or
                          annotations.get(hami.ANN_BIND_PHASE) == hami.BIND_PHASE_FAILED):
            return True, None
        node = str(bound or decided)
        namespace = str(meta.get("namespace") or "default")
        version = str(meta.get("resourceVersion") or "")
        now = self.clock()
        if not isinstance(name, str) or not name:
            return True, ForeignPod(uid, namespace, "?", node, None, "pod without a name", version,
                                    now)  # fmt: skip
        try:
            allocation = self._allocation(pod, spec, annotations, uid, namespace, name, node,
                                          bound, decided, now)  # fmt: skip
        except (ValueError, TypeError, AttributeError, KeyError) as exc:  # hostile shapes too
            why = str(exc) if isinstance(exc, ValueError) else f"malformed pod ({exc!r})"
            return True, ForeignPod(uid, namespace, name, node, None, why[:300], version, now)
        if allocation is None:
            return True, None
        return True, ForeignPod(uid, namespace, name, node, allocation, "", version, now)

    def _allocation(
        self, pod: dict[str, Any], spec: dict[str, Any], annotations: dict[str, Any], uid: str,
        namespace: str, name: str, node: str, bound: str, decided: str, now: float,
    ) -> Allocation | None:  # fmt: skip
        if bound and decided and decided != bound:
            raise ValueError(f"{hami.ANN_VGPU_NODE} says {str(decided)[:80]} but the pod is "
                             f"bound to {bound}")  # fmt: skip
        init = spec.get("initContainers") or []
        app = spec.get("containers") or []
        if not isinstance(init, list) or not isinstance(app, list):
            raise ValueError("containers must be lists")
        # A pod that asks for no device (of any family) is given none by kubelet, whatever its
        # annotations say.
        if not hami.asks_gpu([*init, *app], self.settings):
            return None
        grants = pod_grants.placed_grants(annotations, len(init) + len(app))
        if not any(grants):
            raise ValueError("HAMi's scheduler named its node but it lists no device in "
                             f"{hami.ANN_DEVICES_ALLOCATED} or another device family's "
                             "hami.io/…-devices-allocated")  # fmt: skip
        grants = grants + [[] for _ in range(len(init) + len(app) - len(grants))]
        names = [str((c or {}).get("name", "")) if isinstance(c, dict) else ""
                 for c in [*init, *app]]  # fmt: skip
        return Allocation(
            pod_uid=uid, namespace=namespace, name=name, node=node, containers=grants,
            init_count=len(init), init_done=init_containers_succeeded(pod),
            sidecars=sorted(hami.sidecar_indices(init)), state=AllocationState.ALLOCATED,
            created_at=now, updated_at=now, container_names=names,
            reason="placed by HAMi's scheduler (read-only to Tessera)",
        )  # fmt: skip

    def repairing(self, rebuild: Rebuild) -> Rebuild:
        """The ledger repair's completion from the pods (validation.cluster_rebuild), minus
        HAMi's pods: they are counted here, never written into Tessera's ledger."""

        async def without_hami(node: str, base: NodeLedger | None) -> NodeLedger:
            ledger = await rebuild(node, base)
            kept = base.allocations if base is not None else {}
            hamis = {u for u in ledger.allocations if u in self.pods and u not in kept}
            if not hamis:
                return ledger
            allocations = {u: a for u, a in ledger.allocations.items() if u not in hamis}
            return ledger.model_copy(update={"allocations": allocations})

        return without_hami

    # --- the watches --------------------------------------------------------------------------
    def on_pod_event(self, event: WatchEvent) -> None:
        """Every pod event the scheduler sees; cheap for pods that are not HAMi's."""
        is_hami, record = self.classify(event.object)
        meta = event.object.get("metadata") if isinstance(event.object, dict) else None
        uid = meta.get("uid") if isinstance(meta, dict) else None
        if not isinstance(uid, str) or not uid:
            return
        if not is_hami:
            if uid in self.pods:
                self._drop(uid)
            return
        if event.type == "DELETED" or record is None:
            self._gone[uid] = self.clock()
            self._drop(uid)
            return
        self._put(record)

    def load(self, pods: list[dict[str, Any]], listed_at: float) -> list[dict[str, Any]]:
        """A full listing (the rebuild before serving, the periodic reconcile): HAMi's pods are
        taken in (and those no longer listed dropped); the others are returned for the ledger
        rebuild, which must never restore HAMi's pods as Tessera's."""
        self._expire_tombstones()
        rest: list[dict[str, Any]] = []
        listed: set[str] = set()
        for pod in pods:
            is_hami, record = self.classify(pod)
            if not is_hami:
                rest.append(pod)
                continue
            uid = ((pod.get("metadata") or {}).get("uid")) or ""
            listed.add(uid)
            if record is None:
                self._drop(uid)
            elif uid not in self._gone:  # deleted since the listing was taken: stays gone
                self._put(record)
        for uid, held in list(self.pods.items()):
            if uid not in listed and held.seen_at < listed_at - _LISTING_SLACK_S:
                self._drop(uid)
        return rest

    async def watch_nodes(self) -> None:
        """List then watch Node objects for HAMi's registration annotation and the DRA mode.
        `nodes_listed` is set once the first listing is applied: until then a node whose GPUs
        DRA allocates (a lost ledger holds nothing of its claims) may look free."""
        marked = getattr(self.cluster, "watch_nodes_marked", None)
        if marked is None:
            self.nodes_listed.set()  # a stand-in without the mark: taken as listed at once
        async for event in marked() if marked is not None else self.cluster.watch_nodes():
            if event is None:
                self.nodes_listed.set()
            else:
                self.on_node_event(event)

    def on_node_event(self, event: WatchEvent) -> None:
        meta = event.object.get("metadata") if isinstance(event.object, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            return
        annotations = meta.get("annotations") or {}
        text = annotations.get(hami.ANN_NODE_REGISTER) if isinstance(annotations, dict) else None
        if event.type == "DELETED":
            text = None
        vendors_changed = self._read_vendors(name, event)
        dra = (event.type != "DELETED" and isinstance(annotations, dict)
               and annotations.get(ANN_ALLOCATION_MODE) == "dra")  # fmt: skip
        if dra != (name in self.dra_nodes):
            (self.dra_nodes.add if dra else self.dra_nodes.discard)(name)
            self._texts.pop(name, None)  # decode again below and publish the change
        if name in self._texts and self._texts[name] == text:
            if vendors_changed:
                self._publish(name)
            return  # Node objects change often (status); the annotation seldom: decode it once
        if text is None:
            self._texts.pop(name, None)
        else:
            self._texts[name] = text
        value: tuple[tuple[DeviceInfo, ...] | None, str] | None = None
        if text is not None:
            try:
                value = (tuple(hami.read_node_register(text)), "")
            except ValueError as exc:
                value = (None, str(exc)[:300])
                log.warning("HAMi node registration quarantined",
                            extra={"node": name, "err": value[1]})  # fmt: skip
        if self.registers.get(name) == value and (name in self.dra_nodes) == (
                (self.index.foreign.get(name) or ForeignNode()).dra):
            if vendors_changed:
                self._publish(name)
            return
        if value is None:
            self.registers.pop(name, None)
        else:
            self.registers[name] = value
        self._publish(name)

    def _read_vendors(self, name: str, event: WatchEvent) -> bool:
        """Take in the other families' HAMi registrations of a Node (decoded only when their
        inputs changed: its `…register…` annotations and its capacity); True when they
        changed."""
        inputs: tuple[Any, ...] = ()
        node = event.object
        if event.type != "DELETED":
            annotations = node["metadata"].get("annotations") or {}
            status = node.get("status") if isinstance(node.get("status"), dict) else {}
            capacity = status.get("capacity") if isinstance(status.get("capacity"), dict) else {}
            if not isinstance(annotations, dict):
                annotations = {}
            registers = tuple(sorted(
                (k, v) for k, v in annotations.items()
                if isinstance(k, str) and "register" in k and k != hami.ANN_NODE_REGISTER))
            inputs = (registers, tuple(sorted((str(k), str(v)) for k, v in capacity.items())))
        if self._vendor_inputs.get(name) == inputs:
            return False
        if inputs:
            self._vendor_inputs[name] = inputs
        else:
            self._vendor_inputs.pop(name, None)
        found = registry.hami_registrations(dict(inputs[0]), dict(inputs[1]), self.settings) \
            if inputs else ()
        if found == self.vendor_registers.get(name, ()):
            return False
        if found:
            self.vendor_registers[name] = found
        else:
            self.vendor_registers.pop(name, None)
        return True

    # --- state --------------------------------------------------------------------------------
    def _put(self, record: ForeignPod) -> None:
        old = self.pods.get(record.uid)
        if old is not None and _older(record.resource_version, old.resource_version):
            return  # a listing taken before the event we already applied
        if record.same_as(old):
            self.pods[record.uid] = record
            return
        if old is None:
            log.info("counting a HAMi pod's GPUs as used", extra={
                "pod": record.ref, "node": record.node, "problem": record.problem})  # fmt: skip
        if old is not None and old.node != record.node:
            self._drop(record.uid)
        self.pods[record.uid] = record
        self.by_node.setdefault(record.node, {})[record.uid] = record
        self._publish(record.node)

    def _drop(self, uid: str) -> None:
        old = self.pods.pop(uid, None)
        if old is None:
            return
        on_node = self.by_node.get(old.node, {})
        on_node.pop(uid, None)
        if not on_node:
            self.by_node.pop(old.node, None)
        self._publish(old.node)

    def _publish(self, node: str) -> None:
        pods = tuple(self.by_node.get(node, {}).values())
        devices, problem = self.registers.get(node, (None, ""))
        dra = node in self.dra_nodes
        vendors = self.vendor_registers.get(node, ())
        said = ForeignNode(pods, devices, problem, dra, vendors)
        entry = self.index.node(node)
        if not pods and devices is None and not problem and not dra and not vendors:
            self.index.foreign.pop(node, None)
            self.index.hami_registered.pop(node, None)
        elif said.special(entry.registered if entry is not None else None):
            self.index.foreign[node] = said
            self.index.hami_registered.pop(node, None)
        else:  # only registrations to note (ForeignNode.special)
            self.index.hami_registered[node] = said
            self.index.foreign.pop(node, None)
        self.index.refresh(node, self.clock())

    def _expire_tombstones(self) -> None:
        limit = self.clock() - _TOMBSTONE_S
        for uid in [u for u, at in self._gone.items() if at < limit]:
            del self._gone[uid]

    # --- metrics ------------------------------------------------------------------------------
    def _gauges(self, registry: CollectorRegistry) -> None:
        pods = Gauge("tessera_scheduler_hami_pods",
                     "Pods placed by HAMi's scheduler whose GPUs Tessera counts as used",
                     registry=registry)  # fmt: skip
        pods.set_function(lambda: sum(1 for p in self.pods.values() if p.allocation))
        nodes = Gauge("tessera_scheduler_hami_nodes",
                      "Nodes registered by HAMi's device plugin and not by Tessera's node agent "
                      "(read-only to Tessera)", registry=registry)  # fmt: skip
        nodes.set_function(lambda: sum(
            1 for n in set(self.registers) | set(self.vendor_registers)
            if self.index.node(n) is None and (
                self.registers.get(n, (None, ""))[0] is not None
                or any(v.devices for v in self.vendor_registers.get(n, ())))))  # fmt: skip
        quarantined = Gauge("tessera_scheduler_hami_quarantined",
                            "HAMi records Tessera could not read (kind: pod, node)", ["kind"],
                            registry=registry)  # fmt: skip
        quarantined.labels(kind="pod").set_function(
            lambda: sum(1 for p in self.pods.values() if p.problem))
        quarantined.labels(kind="node").set_function(
            lambda: sum(1 for _d, problem in self.registers.values() if problem))


def _older(candidate: str, known: str) -> bool:
    """True when both resourceVersions are numbers and `candidate` is the older one."""
    if candidate.isdigit() and known.isdigit():
        return int(candidate) < int(known)
    return False
