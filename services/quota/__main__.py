"""`python -m tessera.quota`: namespace GPU quotas over NATS."""

from tessera.quota.service import QuotaService

from tessera.cluster.factory import cluster_from_settings
from tessera.service import ServiceContext, run_service


async def serve_quota(ctx: ServiceContext) -> None:
    service = QuotaService(
        ctx.nc,
        ctx.buckets,
        ctx.settings,
        cluster=cluster_from_settings(ctx.settings),
        log=ctx.log,
        clock=ctx.clock,
        keeper=ctx.keeper,
    )
    ctx.metrics = service.metrics.render  # /metrics beside the probes on TESSERA_LISTEN
    await service.run(ctx.stop)


def main() -> None:
    run_service("quota", "namespace GPU quotas over NATS", serve_quota, health_probes=True)


if __name__ == "__main__":
    main()
