"""Namespace quota as the scheduler sees it: the headroom left (pure, from the quota KV as the
runtime watches it) and the calls to the quota service that hold and release a pod's charge."""

from __future__ import annotations

import logging

from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from tessera import bus, hami
from tessera.codec import CodecError, encode
from tessera.models import (
    DeviceGrant,
    QuotaReply,
    QuotaRequest,
    QuotaState,
    RemoteError,
    decode_reply,
)
from tessera.settings import TesseraSettings
from tessera.signing import Signer, process_signer

from .background import BackgroundTasks
from .pods import PodIdentity
from .rules import RESOURCE_QUOTA_NOT_FIT, QuotaBudget

log = logging.getLogger("tessera.scheduler")


def grants_charge(
    containers: list[list[DeviceGrant]], init_count: int, sidecars: frozenset[int] = frozenset()
) -> tuple[int, int, int]:
    """(memory, cores, gpus) for quota as HAMi counts it: app summed, init by max; native
    sidecars (init containers that keep running) are summed with the app; only the grants of
    device families that count in the quota (hami.quota_grants)."""
    containers = hami.quota_grants(containers)

    def total(grants: list[list[DeviceGrant]]) -> tuple[int, int, int]:
        return (
            sum(g.memory_mib for c in grants for g in c),
            sum(g.cores for c in grants for g in c),
            sum(len(c) for c in grants),
        )

    app = total([*(containers[i] for i in sorted(sidecars) if i < init_count),
                 *containers[init_count:]])
    peaks = [total([c]) for i, c in enumerate(containers[:init_count]) if i not in sidecars]
    return tuple(max([app[i], *(p[i] for p in peaks)]) for i in range(3))  # type: ignore[return-value]


def quota_budget(state: QuotaState | None, uid: str) -> QuotaBudget:
    """What the namespace has left for pod `uid` (its own charge, if held, not counted)."""
    if state is None:
        return QuotaBudget()
    used = state.used()  # settled totals + recent charges
    own = state.charges.get(uid)
    limits = state.limits

    def left(limit: int | None, used: int) -> int | None:
        return None if limit is None else max(0, limit - used)

    return QuotaBudget(
        left(limits.memory_mib, (used.memory_mib or 0) - (own.memory_mib if own else 0)),
        left(limits.cores, (used.cores or 0) - (own.cores if own else 0)),
    )


class QuotaClient:
    """Requests to the quota service (tessera.quota.reserve / release)."""

    def __init__(
        self, nc: NatsClient, settings: TesseraSettings, tasks: BackgroundTasks,
        signer: Signer | None = None,
    ) -> None:  # fmt: skip
        self.nc = nc
        self.settings = settings  # request_timeout_s, read per call
        self.tasks = tasks
        # Every reserve/release is signed with the scheduler's key (tessera.signing).
        self.signer = signer or process_signer(settings.command_key_file)

    async def reserve(self, ident: PodIdentity, charge: tuple[int, int, int]) -> str:
        """'' when held, else the refusal text (a timeout is a refusal, never a hang)."""
        memory, cores, gpus = charge
        body = QuotaRequest(namespace=ident.namespace, pod_uid=ident.uid, name=ident.name,
                            memory_mib=memory, cores=cores, gpus=gpus)  # fmt: skip
        timeout = self.settings.request_timeout_s
        try:
            payload = encode(body)
            msg = await self.nc.request(bus.QUOTA_RESERVE, payload, timeout=timeout,
                                        headers=self.signer.headers(bus.QUOTA_RESERVE, payload))
            reply = decode_reply(msg.data, QuotaReply)
        except (NatsTimeoutError, NoRespondersError, TimeoutError):
            return f"{RESOURCE_QUOTA_NOT_FIT}: quota service did not answer within {timeout:g} s"
        except RemoteError as error:
            return f"{RESOURCE_QUOTA_NOT_FIT}: quota service error: {error.reason}"
        except CodecError as exc:
            return f"{RESOURCE_QUOTA_NOT_FIT}: quota service answered garbage: {exc}"
        if not reply.ok:
            return f"{RESOURCE_QUOTA_NOT_FIT}: {reply.reason or 'namespace quota exceeded'}"
        return ""

    def release_soon(self, namespace: str, uid: str, name: str = "") -> None:
        """Release the pod's charge in the background (a failure is logged)."""
        self.tasks.spawn(self.release(namespace, uid, name))

    async def release(self, namespace: str, uid: str, name: str = "") -> None:
        body = QuotaRequest(namespace=namespace, pod_uid=uid, name=name)
        try:
            payload = encode(body)
            await self.nc.request(bus.QUOTA_RELEASE, payload,
                                  timeout=self.settings.request_timeout_s,
                                  headers=self.signer.headers(bus.QUOTA_RELEASE, payload))
        except Exception as exc:
            log.warning("quota release failed", extra={"pod_uid": uid, "err": str(exc)})
