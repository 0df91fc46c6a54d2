"""Dynamic MIG on the node: make the GPU's instances match what allocations want.

`plan` (pure) compares the instances allocations want (`Wanted`: GPU, profile, placement start,
for which pod) with what NVML holds, and says what to create, what to destroy and what vanished:

- a wanted instance with none at its GPU/profile/start is created — unless the allocation had
  it already (`present_before`: after an agent restart or reboot), then it *vanished* and is
  reported, not silently remade under a running pod; or unless it is not due yet (`pending`:
  a pod not being allocated now). An instance is a pod's only when it is the one the ledger
  records (`mig_uuid`) or one this agent made for that pod: someone else's instance at the
  same place is never handed over (creating there fails, NVML says why);
- an instance no allocation wants is an orphan: destroyed once it has been one for `grace_s`
  (an allocation being written may not be visible yet), at once when it belonged to a pod
  this agent saw and that pod's allocation is gone (`owned`), and only if no process runs
  in it (NVML refuses with IN_USE otherwise; it is retried next pass).

`MigReconciler` runs a plan through NVML (nvml_mig.py, in a thread) and publishes `mig.created`,
`mig.destroyed`, `mig.vanished` events; a creation NVML refuses comes back as a failure with the
reason, for the caller to release the allocation with.

`DynamicMig` (mig_service.py) feeds it from the ledger: at Allocate for the pod being
allocated, and every few seconds for releases, orphans and vanished instances.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from nats.js import JetStreamContext

from tessera import bus
from tessera.models import MigEvent

from .nvml_mig import MigDevice, MigNvmlError


@dataclass(frozen=True, slots=True)
class Wanted:
    pod_uid: str
    gpu_uuid: str
    profile: str
    start: int
    present_before: bool = False  # the allocation had its instance (it was allocated)
    pending: bool = False  # not due yet: kept if there, not created
    mig_uuid: str = ""  # the instance the ledger records for it ("" = none yet)

    @property
    def place(self) -> tuple[str, str, int]:
        return self.gpu_uuid, self.profile, self.start


def owns(w: Wanted, device: MigDevice, owned: Mapping[str, str]) -> bool:
    """Whether `device` is `w`'s instance: at its place and the very instance the ledger
    records, or (none recorded yet) one this agent made for that pod. An instance someone else
    put at the same place is never handed to a pod."""
    if (device.parent_uuid, device.profile, device.start) != w.place:
        return False
    if w.mig_uuid:
        return device.uuid == w.mig_uuid
    return owned.get(device.uuid) == w.pod_uid


@dataclass(frozen=True)
class MigPlan:
    matched: list[tuple[Wanted, MigDevice]] = field(default_factory=list)
    create: list[Wanted] = field(default_factory=list)
    destroy: list[MigDevice] = field(default_factory=list)
    vanished: list[Wanted] = field(default_factory=list)
    orphans: dict[str, float] = field(default_factory=dict)  # MIG uuid -> orphan since


def plan(
    wanted: Iterable[Wanted],
    existing: Iterable[MigDevice],
    orphan_since: Mapping[str, float],
    now: float,
    grace_s: float,
    owned: Mapping[str, str] | None = None,
) -> MigPlan:
    """`owned`: MIG uuid -> the pod this agent made or saw it for; such an instance no
    allocation wants any more was released: destroyed at once."""
    owned = owned or {}
    devices = list(existing)
    have = {(d.parent_uuid, d.profile, d.start): d for d in devices}
    out = MigPlan()
    kept: set[str] = set()
    for w in wanted:
        device = have.get(w.place)
        if device is not None and owns(w, device, owned):
            out.matched.append((w, device))
            kept.add(device.uuid)
        elif w.present_before:
            out.vanished.append(w)
        elif not w.pending:
            out.create.append(w)  # NVML refuses when someone else's instance is there
    for device in devices:
        if device.uuid in kept:
            continue
        since = orphan_since.get(device.uuid, now)
        out.orphans[device.uuid] = since
        if device.uuid in owned or now - since >= grace_s:
            out.destroy.append(device)
    return out


@dataclass
class Outcome:
    matched: list[tuple[Wanted, MigDevice]] = field(default_factory=list)  # already there
    created: list[tuple[Wanted, MigDevice]] = field(default_factory=list)
    failed: list[tuple[Wanted, str]] = field(default_factory=list)  # with NVML's reason
    destroyed: list[MigDevice] = field(default_factory=list)
    busy: list[MigDevice] = field(default_factory=list)  # a process runs in it: kept for now
    vanished: list[Wanted] = field(default_factory=list)


class MigReconciler:
    """One node's dynamic MIG instances. `handles`: GPU uuid → (NVML handle, index)."""

    def __init__(
        self,
        *,
        node: str,
        handles: Mapping[str, tuple[object, int]],
        list_devices: Callable[[object, int], list[MigDevice]],
        create: Callable[[object, int, str, int], MigDevice],
        destroy: Callable[[object, int], None],
        js: JetStreamContext,
        log: logging.Logger,
        clock: Callable[[], float],
        grace_s: float = 30.0,
    ) -> None:
        self.node = node
        self.handles = dict(handles)
        self._list, self._create, self._destroy = list_devices, create, destroy
        self.js = js
        self.log = log
        self.clock = clock
        self.grace_s = grace_s
        self._orphans: dict[str, float] = {}
        self._owned: dict[str, str] = {}  # MIG uuid -> the pod it was wanted by

    def existing(self) -> list[MigDevice]:
        return [d for handle, index in self.handles.values() for d in self._list(handle, index)]

    async def reconcile(self, wanted: list[Wanted]) -> Outcome:
        existing = await asyncio.to_thread(self.existing)
        todo = plan(wanted, existing, self._orphans, self.clock(), self.grace_s, self._owned)
        self._orphans = todo.orphans
        out = Outcome(matched=list(todo.matched), vanished=list(todo.vanished))
        for w, device in todo.matched:
            self._owned[device.uuid] = w.pod_uid
        for w in todo.create:
            if w.gpu_uuid not in self.handles:
                out.failed.append((w, f"this node has no GPU {w.gpu_uuid}"))
                continue
            handle, index = self.handles[w.gpu_uuid]
            try:
                device = await asyncio.to_thread(self._create, handle, index, w.profile, w.start)
            except (MigNvmlError, ValueError) as exc:
                out.failed.append((w, f"creating MIG {w.profile} at slice {w.start} on "
                                      f"{w.gpu_uuid} failed: {exc}"))
                continue
            out.created.append((w, device))
            self._owned[device.uuid] = w.pod_uid
        for device in todo.destroy:
            handle, _index = self.handles[device.parent_uuid]
            try:
                await asyncio.to_thread(self._destroy, handle, device.gi_id)
            except MigNvmlError as exc:
                if not exc.in_use:  # kept, retried next pass
                    self.log.warning("MIG instance not destroyed",
                                     extra={"mig": device.uuid, "err": str(exc)})
                out.busy.append(device)
                continue
            self._orphans.pop(device.uuid, None)
            self._owned.pop(device.uuid, None)
            out.destroyed.append(device)
        alive = {d.uuid for d in existing} | {d.uuid for _, d in out.created}
        for uuid in [u for u in self._owned if u not in alive]:
            self._owned.pop(uuid)  # gone by itself (or vanished)
        await self._announce(out)
        return out

    async def _announce(self, out: Outcome) -> None:
        events = [
            MigEvent(node=self.node, action="created", device_uuid=w.gpu_uuid, mig_uuid=d.uuid,
                     profile=w.profile, start=w.start, pod_uid=w.pod_uid,
                     reason=f"instance for pod {w.pod_uid}")
            for w, d in out.created
        ] + [
            MigEvent(node=self.node, action="destroyed", device_uuid=d.parent_uuid,
                     mig_uuid=d.uuid, profile=d.profile, start=d.start,
                     reason="no allocation holds it any more")
            for d in out.destroyed
        ] + [
            MigEvent(node=self.node, action="vanished", device_uuid=w.gpu_uuid,
                     profile=w.profile, start=w.start, pod_uid=w.pod_uid,
                     reason=f"pod {w.pod_uid}'s instance is no longer on the GPU")
            for w in out.vanished
        ]
        for event in events:
            try:
                await bus.publish_event(self.js, event)
            except Exception as exc:  # an event lost is logged, the instance work stands
                self.log.warning("MIG event not published", extra={"err": str(exc)})

