"""A DRA pod's charge against its namespace quota, held from prepare to unprepare.

In extender mode the scheduler reserves a pod's charge when it places it; in DRA mode
kube-scheduler's allocator places and knows nothing of Tessera's quotas, so the driver holds
the charge (`tessera.quota.reserve`, idempotent per pod, signed as the agent's `limits.set`
resizes are) before it seals anything: a claim the namespace's quota cannot hold is not
prepared, and kubelet reports the quota's sentence on the pod. Unprepare resizes the charge to
what the pod still holds (zero when its last claim goes); the scheduler's release of a deleted
pod frees it as for any pod. (The webhook already refuses a pod whose ask cannot fit.)
"""

from __future__ import annotations

from tessera import bus, hami
from tessera.codec import encode
from tessera.models import Allocation, QuotaReply, QuotaRequest, QuotaShare, decode_reply
from tessera.settings import TesseraSettings
from tessera.signing import process_signer


def charge_of(allocation: Allocation | None) -> tuple[int, int, int]:
    """(memory MiB, cores, GPUs) as HAMi counts the allocation's grants (None: nothing)."""
    if allocation is None:
        return 0, 0, 0
    return hami.grants_quota_charge(allocation.containers, allocation.init_count)


class QuotaRefused(Exception):
    """The quota service refused (or did not answer); the message is its sentence."""


class DraQuota:
    def __init__(self, nc, settings: TesseraSettings, clock=None) -> None:
        self.nc = nc
        self.settings = settings
        self.signer = (
            process_signer(settings.command_key_file, clock)
            if clock
            else process_signer(settings.command_key_file)
        )

    @property
    def enabled(self) -> bool:
        return bool(self.settings.quota_enabled and self.nc is not None)

    async def hold(self, namespace: str, pod_uid: str, name: str,
                   allocation: Allocation | None, handed_from: str = "",
                   handed_from_keeps: Allocation | None = None) -> None:  # fmt: skip
        """Charge the pod what `allocation` holds (None: nothing); `handed_from`: in the same
        write, the charge of that (ended) pod is freed (a shared claim handed on), or shrunk to
        what `handed_from_keeps` holds (its other claims)."""
        if not self.enabled:
            return
        memory, cores, gpus = charge_of(allocation)
        keeps = None
        if handed_from and handed_from_keeps is not None:
            kept = charge_of(handed_from_keeps)
            keeps = QuotaShare(memory_mib=kept[0], cores=kept[1], gpus=kept[2])
        request = QuotaRequest(namespace=namespace, pod_uid=pod_uid, name=name,
                               memory_mib=memory, cores=cores, gpus=gpus,
                               handed_from=handed_from, handed_from_keeps=keeps)  # fmt: skip
        payload = encode(request)
        try:
            msg = await self.nc.request(
                bus.QUOTA_RESERVE,
                payload,
                timeout=self.settings.request_timeout_s,
                headers=self.signer.headers(bus.QUOTA_RESERVE, payload),
            )
            reply = decode_reply(msg.data, QuotaReply)
        except Exception as exc:
            raise QuotaRefused(
                f"the quota service did not answer ({exc}); kubelet retries"
            ) from exc
        if not reply.ok:
            raise QuotaRefused(f"quota: {reply.reason}")
