"""Dynamic MIG on the node: make the GPU's instances match what allocations want.

`plan` (pure) compares the instances allocations want (`Wanted`: GPU, profile, placement start,
for which pod) with what NVML holds, and says what to create, what to destroy and what vanished:

- a wanted instance with none at its GPU/profile/start is created — unless the allocation had
  it already (`present_before`: after an agent restart or reboot), then it *vanished* and is
  reported, not silently remade under a running pod;
- an instance no allocation wants is an orphan: destroyed once it has been one for `grace_s`
  (an allocation being written may not be visible yet), and only if no process runs in it
  (NVML refuses with IN_USE otherwise; it is retried next pass).

`MigReconciler` runs a plan through NVML (nvml_mig.py, in a thread) and publishes `mig.created`,
`mig.destroyed`, `mig.vanished` events; a creation NVML refuses comes back as a failure with the
reason, for the caller to release the allocation with.

Not wired yet: the ledger does not record a grant's MIG placement, so no allocation feeds
`Wanted` today (see the scheduler README, "MIG").
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

    @property
    def place(self) -> tuple[str, str, int]:
        return self.gpu_uuid, self.profile, self.start


@dataclass(frozen=True)
class MigPlan:
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
) -> MigPlan:
    have = {(d.parent_uuid, d.profile, d.start): d for d in existing}
    wanted_places = set()
    out = MigPlan()
    for w in wanted:
        wanted_places.add(w.place)
        if w.place in have:
            continue
        (out.vanished if w.present_before else out.create).append(w)
    for place, device in have.items():
        if place in wanted_places:
            continue
        since = orphan_since.get(device.uuid, now)
        out.orphans[device.uuid] = since
        if now - since >= grace_s:
            out.destroy.append(device)
    return out


@dataclass
class Outcome:
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

    def existing(self) -> list[MigDevice]:
        return [d for handle, index in self.handles.values() for d in self._list(handle, index)]

    async def reconcile(self, wanted: list[Wanted]) -> Outcome:
        existing = await asyncio.to_thread(self.existing)
        todo = plan(wanted, existing, self._orphans, self.clock(), self.grace_s)
        self._orphans = todo.orphans
        out = Outcome(vanished=list(todo.vanished))
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
        for device in todo.destroy:
            handle, _index = self.handles[device.parent_uuid]
            try:
                await asyncio.to_thread(self._destroy, handle, device.gi_id)
            except MigNvmlError as exc:
                if not exc.in_use:
                    raise
                out.busy.append(device)
                continue
            self._orphans.pop(device.uuid, None)
            out.destroyed.append(device)
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

