"""Dynamic limits: tessera.node.<node>.limits.set rewrites a running container's sealed limits.

The request is validated against the node's GPUs first (a value no GPU here can hold is
rejected and reported). The ledger is the truth and is changed first (CAS, so a raise can never
push a GPU past its advertised capacity, whatever the scheduler does at the same time); the
pod's quota charge is resized with it (through tessera.quota.reserve, which refuses a raise the
namespace quota cannot hold, before anything is written), the pod's
`hami.io/vgpu-devices-allocated` annotation records the new grants, then the sealed file
changes; libvgpu applies it within 100 ms. Shrinking memory below what the container uses now
is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Service
from prometheus_client import CollectorRegistry
from tessera.node_agent.containers import ContainerDir, ContainerStore
from tessera.node_agent.state import DeviceState

from tessera import bus, hami, signing
from tessera.cluster.port import ClusterError, ClusterPort
from tessera.codec import CodecError, decode, encode
from tessera.device_kinds import pod_grants
from tessera.models import (
    Allocation,
    LimitsSetReply,
    LimitsSetRequest,
    NodeLedger,
    QuotaReply,
    QuotaRequest,
    decode_reply,
    now,
)
from tessera.region import RegionFormatError, read_limits, read_region, set_device_flags
from tessera.settings import TesseraSettings
from tessera.signing import CommandGate, process_signer, verifier_from_file
from tessera.validation import Rejections, limits_problem

SERVICE_VERSION = "0.1.0"


class LimitsError(Exception):
    """A limits change that cannot be made (the reply carries the message)."""


def pod_usage_on(allocation: Allocation, uuid: str) -> tuple[int, int]:
    """(MiB, cores) a pod holds on one GPU: max(init peak, app sum), as HAMi counts it."""
    init = allocation.init_grants()
    app = allocation.app_grants()

    def on(grants: list) -> tuple[int, int]:
        g = next((g for g in grants if g.uuid == uuid), None)
        return (g.memory_mib, g.cores) if g else (0, 0)

    app_mem = sum(on(c)[0] for c in app)
    app_cores = sum(on(c)[1] for c in app)
    if allocation.init_done or not init:
        return app_mem, app_cores
    return max(app_mem, *(on(c)[0] for c in init)), max(app_cores, *(on(c)[1] for c in init))


def apply_change(
    ledger: NodeLedger | None,
    pod_uid: str,
    index: int,
    uuids: list[str],
    memory_mib: int | None,
    cores: int | None,
    capacity: dict[str, tuple[int, int]],
) -> NodeLedger:
    """Ledger CAS body: new grants for one container, refusing to exceed a GPU's capacity."""
    if ledger is None or pod_uid not in ledger.allocations:
        raise LimitsError("the pod has no allocation on this node")
    new = ledger.model_copy(deep=True)
    allocation = new.allocations[pod_uid]
    if not allocation.active:
        raise LimitsError(f"the pod's allocation is {allocation.state}")
    if allocation.reason == "dra":  # dra/accounting.py: the allocator's accounting is the claim
        raise LimitsError("the pod's GPUs come from a DRA ResourceClaim: its slice is the "
                          "claim's consumed capacity; change the claim, not the limits")
    for grant in allocation.containers[index]:
        if grant.uuid not in uuids:
            continue
        if memory_mib is not None:
            grant.memory_mib = memory_mib
        if cores is not None:
            grant.cores = cores
        total_mem = total_cores = 0
        for other in new.allocations.values():
            if other.active:
                mem, c = pod_usage_on(other, grant.uuid)
                total_mem, total_cores = total_mem + mem, total_cores + c
        cap_mem, cap_cores = capacity.get(grant.uuid, (0, 0))
        if total_mem > cap_mem:
            raise LimitsError(
                f"GPU {grant.uuid} would hold {total_mem} MiB of {cap_mem} MiB: not enough memory"
            )
        if total_cores > cap_cores:
            raise LimitsError(
                f"GPU {grant.uuid} would hold {total_cores}% compute of {cap_cores}%"
            )
    allocation.updated_at = now()
    return new


class LimitsService:
    def __init__(
        self,
        *,
        node: str,
        nc: NatsClient,
        store: ContainerStore,
        state: DeviceState,
        ledger_kv: KeyValue,
        log: logging.Logger,
        settings: TesseraSettings | None = None,
        cluster: ClusterPort | None = None,
        js: JetStreamContext | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.nc = nc
        self.store = store
        self.state = state
        self.ledger_kv = ledger_kv
        self.log = log
        self.settings = settings or TesseraSettings()
        self.cluster = cluster
        self.rejections = Rejections(f"node-agent/{node}", js, CollectorRegistry())
        # limits.set is taken only signed by the admin; the agent's own quota.reserve is signed.
        self.commands = CommandGate(verifier_from_file(self.settings.command_trust_file, clock),
                                    self.rejections, f"node-agent/{node}")  # fmt: skip
        self.signer = process_signer(self.settings.command_key_file, clock)
        self._micro: Service | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        self._micro = await add_service(
            self.nc,
            name=bus.NODE_SERVICE,
            version=SERVICE_VERSION,
            description="Tessera node agent: dynamic container limits",
            metadata={"node": self.node},
        )
        await self._micro.add_endpoint(
            name="limits-set", subject=bus.node_limits_subject(self.node), handler=self._on_set
        )
        await bus.flush(self.nc)  # registered: a request from another connection now is answered

    async def stop(self) -> None:
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
            self._micro = None

    async def _on_set(self, request: Request) -> None:
        refused = self.commands.node_command_refused(request._msg, self.node)
        if refused is not None:
            if refused.answerable:
                with contextlib.suppress(Exception):
                    await request.respond(encode(LimitsSetReply(ok=False, reason=refused.reason)))
            return
        try:
            body = decode(request.data, LimitsSetRequest)
            async with self._lock:
                reply = await self.set_limits(body)
        except CodecError as exc:
            reply = LimitsSetReply(ok=False, reason=f"bad LimitsSetRequest: {exc}"[:500])
        except Exception as exc:
            self.log.exception("limits.set failed")
            reply = LimitsSetReply(ok=False, reason=f"internal error: {exc}"[:500])
        with contextlib.suppress(Exception):
            await request.respond(encode(reply))

    def _find(self, req: LimitsSetRequest) -> ContainerDir:
        matches = [
            c for c in self.store.all()
            if (c.prepared.pod_uid == req.pod_uid if req.pod_uid else
                (c.prepared.namespace, c.prepared.pod) == (req.namespace, req.pod))
            and c.prepared.container == req.container
        ]
        who = req.pod_uid or f"{req.namespace}/{req.pod}"
        if not matches:
            raise LimitsError(f"no container {req.container!r} of pod {who} on node {self.node}")
        if len(matches) > 1:
            raise LimitsError(f"pod {who} matches several pods here; give its uid")
        return matches[0]

    async def _resize_quota(
        self, before: Allocation, after: Allocation, *, best_effort: bool = False
    ) -> bool:
        """Resize the pod's quota charge to `after`'s grants; True when a request was made."""
        if not (self.settings.quota_enabled and after.quota_held):
            return False
        old = hami.grants_quota_charge(before.containers, before.init_count)
        new = hami.grants_quota_charge(after.containers, after.init_count)
        if old == new:
            return False
        request = QuotaRequest(
            namespace=after.namespace, pod_uid=after.pod_uid, name=after.name,
            memory_mib=new[0], cores=new[1], gpus=new[2],
        )  # fmt: skip
        try:
            payload = encode(request)
            msg = await self.nc.request(
                bus.QUOTA_RESERVE, payload, timeout=self.settings.request_timeout_s,
                headers=self.signer.headers(bus.QUOTA_RESERVE, payload),
            )
            reply = decode_reply(msg.data, QuotaReply)
        except Exception as exc:  # timeout, ErrorReply (RemoteError), garbage, NATS away
            if best_effort:
                self.log.warning("quota charge not restored", extra={"err": str(exc)})
                return True
            raise LimitsError(f"the quota service did not resize the charge: {exc}") from exc
        if not reply.ok and not best_effort:
            raise LimitsError(f"quota: {reply.reason}")
        return True

    async def _record_on_pod(self, allocation: Allocation) -> None:
        """The pod's hami.io/vgpu-devices-allocated carries the grants as they are now (the node
        agent checks a restarted container's grant against it)."""
        if self.cluster is None:
            return
        value = hami.encode_pod_devices(allocation.containers)
        try:
            await self.cluster.patch_pod_metadata(
                allocation.namespace, allocation.name,
                annotations={**pod_grants.grant_annotations(allocation.containers,
                                                            (pod_grants.ALLOCATED,)),
                             # the agent trusts a grant above the request only with this
                             signing.RECORD_ANNOTATION: signing.record_signature(
                                 self.signer, allocation.pod_uid, value)},
            )  # fmt: skip
        except ClusterError as exc:
            self.log.warning("pod annotation not updated after limits.set",
                             extra={"pod": f"{allocation.namespace}/{allocation.name}",
                                    "err": str(exc)})  # fmt: skip

    async def set_limits(self, req: LimitsSetRequest) -> LimitsSetReply:
        try:
            return await self._set_limits(req)
        except LimitsError as exc:
            return LimitsSetReply(ok=False, reason=str(exc))

    async def _set_limits(self, req: LimitsSetRequest) -> LimitsSetReply:
        if req.memory_mib is None and req.cores is None:
            raise LimitsError("nothing to change: give a memory and/or a cores limit")
        problem = limits_problem(req, self.state.devices())
        if problem is not None:
            self.rejections.reject("limits", bus.node_limits_subject(self.node), problem)
            raise LimitsError(problem.detail)
        cdir = await asyncio.to_thread(self._find, req)
        try:
            sealed = await asyncio.to_thread(read_limits, cdir.limits_dir)
        except RegionFormatError as exc:
            raise LimitsError(f"the container's limits file is damaged: {exc}") from exc
        if sealed is None:
            raise LimitsError("the container has not started yet (no sealed limits)")
        uuids = [d.uuid for d in sealed.devices]
        if req.device_uuid:
            if req.device_uuid not in uuids:
                raise LimitsError(f"the container has no GPU {req.device_uuid}")
            uuids = [req.device_uuid]
        if req.memory_mib is not None:
            try:
                usage = await asyncio.to_thread(read_region, cdir.region_file)
            except RegionFormatError:
                usage = None
            for uuid in uuids:
                used = usage.device(uuid) if usage else None
                if used and used.used_bytes > req.memory_mib << 20:
                    raise LimitsError(
                        f"the container uses {used.used_bytes >> 20} MiB on {uuid}, more than "
                        f"the new limit of {req.memory_mib} MiB: free memory first"
                    )
        capacity = {d.uuid: (d.memory_mib, d.cores) for d in self.state.devices()}
        p = cdir.prepared

        def change(ledger: NodeLedger | None) -> NodeLedger:
            return apply_change(
                ledger, p.pod_uid, p.index, uuids, req.memory_mib, req.cores, capacity
            )

        current = await bus.read(self.ledger_kv, self.node, NodeLedger)
        before = current.value.allocations.get(p.pod_uid) if current else None
        after = change(current.value if current else None).allocations[p.pod_uid]
        assert before is not None  # apply_change refuses a pod with no allocation
        resized = await self._resize_quota(before, after)
        try:
            result = await bus.cas_update(self.ledger_kv, self.node, NodeLedger, change)
        except Exception as exc:
            if resized:
                await self._resize_quota(after, before, best_effort=True)
            if isinstance(exc, bus.NoChange):
                raise LimitsError("the pod has no allocation on this node") from exc
            raise
        await self._record_on_pod(result.value.allocations[p.pod_uid])
        for uuid in uuids:
            await asyncio.to_thread(
                set_device_flags, cdir.limits_dir, uuid,
                mem_limit_bytes=None if req.memory_mib is None else req.memory_mib << 20,
                sm_limit_pct=req.cores,
            )
        changes = []
        if req.memory_mib is not None:
            changes.append(f"memory {req.memory_mib} MiB")
        if req.cores is not None:
            changes.append(f"cores {req.cores}%")
        self.log.info("limits changed", extra={
            "pod": f"{p.namespace}/{p.pod}", "container": p.container, "gpus": uuids,
            "memory_mib": req.memory_mib, "cores": req.cores,
        })
        return LimitsSetReply(ok=True, reason=f"{', '.join(changes)} on {', '.join(uuids)}")
