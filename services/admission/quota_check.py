"""Ask tessera.quota.reserve, in check-only mode, whether a GPU pod fits its namespace quota."""

from __future__ import annotations

import logging

import nats.errors
from nats.aio.client import Client as NatsClient

from tessera import bus
from tessera.codec import CodecError, encode
from tessera.models import QuotaReply, QuotaRequest, RemoteError, decode_reply
from tessera.signing import Signer, process_signer

from .rules import QuotaAsk, QuotaVerdict

log = logging.getLogger("tessera.admission")


class QuotaChecker:
    """One request/reply per GPU pod; every failure becomes a verdict, never an exception."""

    def __init__(
        self, nc: NatsClient, timeout_s: float, signer: Signer | None = None
    ) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self.signer = signer or process_signer(None)

    async def check(self, ask: QuotaAsk, pod_uid: str = "") -> QuotaVerdict:
        request = QuotaRequest(
            namespace=ask.namespace,
            pod_uid=pod_uid,
            name=ask.name,
            memory_mib=ask.memory_mib,
            cores=ask.cores,
            gpus=ask.gpus,
            check_only=True,
        )
        if not self.nc.is_connected:
            # Reconnecting: answer at once instead of letting every review wait for the timeout.
            return QuotaVerdict(None, "the webhook is not connected to NATS")
        try:
            payload = encode(request)
            reply = await self.nc.request(
                bus.QUOTA_RESERVE, payload, timeout=self.timeout_s,
                headers=self.signer.headers(bus.QUOTA_RESERVE, payload),
            )
        except nats.errors.NoRespondersError:
            return QuotaVerdict(None, "no quota service is running")
        except nats.errors.TimeoutError:
            return QuotaVerdict(None, f"the quota service did not answer within {self.timeout_s} s")
        except Exception as exc:  # connection closed, draining, reconnecting...
            log.warning("quota request failed", extra={"err": str(exc)})
            return QuotaVerdict(None, f"the quota service could not be reached: {exc}")
        try:
            answer = decode_reply(reply.data, QuotaReply)
        except RemoteError as refused:
            return QuotaVerdict(None, f"the quota service refused the request: {refused.reason}")
        except CodecError as exc:
            return QuotaVerdict(None, f"the quota service answered garbage: {exc}")
        return QuotaVerdict(answer.ok, answer.reason)
