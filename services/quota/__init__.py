"""tessera-quota: namespace GPU quotas over NATS.

QuotaService serves tessera.quota.{reserve,release,status,set} over KV tessera-quota; the rules
are the pure functions of `arithmetic`; `recovery` keeps usage true to the ledger.
"""

from tessera.quota.service import QuotaService

__all__ = ["QuotaService"]
