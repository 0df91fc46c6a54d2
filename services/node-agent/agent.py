"""The node agent, assembled: devices → registration and health → device plugin → regions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from tessera.node_agent import mig_static
from tessera.node_agent.containers import ContainerStore
from tessera.node_agent.devices import DeviceSource
from tessera.node_agent.lending import ComputeLending, LendingCollector
from tessera.node_agent.limits import LimitsService
from tessera.node_agent.metrics import NodeAgentMetrics
from tessera.node_agent.mig_plugin import MigPlugins, run_static_mig
from tessera.node_agent.plugin import DevicePluginService, PluginEndpoint, list_pod_resources
from tessera.node_agent.registration import HealthMonitor, NodeRegistrar
from tessera.node_agent.state import DeviceState
from tessera.node_agent.usage import UsageSampler

from tessera import bus, mig
from tessera.bus import Buckets
from tessera.cancelling import cancel_and_wait
from tessera.cluster.port import ClusterPort
from tessera.device_kinds import registry
from tessera.kubeapi import pr
from tessera.models import NodeLedger
from tessera.region import LEASE_SPILL_NAME
from tessera.settings import TesseraSettings

from .compute_reclaims import ComputeReclaimReporter
from .dra.runner import start_driver
from .elastic_memory import LeaseCollector, ReclaimReporter, card_memory
from .leases import LeaseService
from .ledger_guarantees import LedgerGuarantees
from .mig_dynamic import MigReconciler
from .mig_service import DynamicMig
from .mps import MPS_DIR, MpsDaemons
from .node_config import NodeConfigurator
from .nvml_processes import ProcessProbe
from .spill_metrics import SpillCollector
from .watchdog import CachedLedger, Watchdog, watchdog_from_settings


class NodeAgent:
    """Everything one node runs. Build it with its dependencies, then `await run(stop)`."""

    def __init__(
        self,
        *,
        settings: TesseraSettings,
        node: str,
        nc: NatsClient,
        js: JetStreamContext,
        buckets: Buckets,
        source: DeviceSource,
        cluster: ClusterPort | None = None,
        log: logging.Logger | None = None,
        pod_resources: Callable[[str], Awaitable[list[pr.PodResources]]] = list_pod_resources,
        clock: Callable[[], float] | None = None,
        process_probe: ProcessProbe | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock  # the NATS server's clock: claims it gives back are judged on it
        self.node = node
        self.nc = nc
        self.js = js
        self.buckets = buckets
        self.source = source
        self.cluster = cluster
        self.log = log or logging.getLogger("tessera.node_agent")
        self.pod_resources = pod_resources
        self.instance = uuid.uuid4().hex[:8]
        self.state = DeviceState()
        self.store = ContainerStore(settings.region_host_dir)
        self.metrics = NodeAgentMetrics()
        self.metrics.watch(self.state.devices, lambda: [c.region_file for c in self.store.all()])
        self.lending: ComputeLending | None = None  # elastic compute, started with the sampler
        self.metrics.registry.register(LendingCollector(lambda: self.lending))
        self.metrics.registry.register(SpillCollector(  # host memory promised, and spilled
            self.store.all, leased=lambda key: self._spill_leased(key)))
        self.ready = asyncio.Event()
        self.plugin: DevicePluginService | None = None
        self.endpoint: PluginEndpoint | None = None
        self.health: HealthMonitor | None = None
        self.sampler: UsageSampler | None = None
        self.process_probe = process_probe
        self.watchdog: Watchdog | None = None
        # each container's memory account, out of the tenant's reach (libvgpu leases from it)
        self.leases = LeaseService(
            self.store.all, self.log, version=lambda: self.store.version,
            # elastic memory: the cards' sizes, and what a reclaim does (docs/elastic.md)
            card_memory=card_memory(self.state.devices),
            on_reclaim=ReclaimReporter(node=node, js=js, cluster=cluster, log=self.log,
                                       source=f"node-agent/{node}/{self.instance}",
                                       evict_grace_s=settings.memory_evict_grace_s),
            reclaim_wait_s=settings.memory_reclaim_wait_s,
            # the node's say past the grace bound (docs/elastic.md, "Reclaim")
            enforcement=self._memory_reclaim,
            reclaim_grace_s=settings.memory_reclaim_grace_s)  # fmt: skip
        self.metrics.registry.register(LeaseCollector(self.leases))
        self.configurator: NodeConfigurator | None = None
        self.limits: LimitsService | None = None  # serves limits.set once running
        self.mig_plugins: MigPlugins | None = None
        self.dynamic_mig: DynamicMig | None = None
        self.mps = MpsDaemons(
            binary=settings.mps_control_binary, root=Path(settings.region_host_dir) / MPS_DIR,
            node=node, log=self.log, js=js, source=f"node-agent/{node}/{self.instance}",
        )
        self.metrics.watch_watchdog(lambda: self.watchdog)
        self.compute_reclaims: ComputeReclaimReporter | None = None  # started with lending
        self.dra = None  # the DRA driver's endpoint in DRA mode (dra/runner.py)
        self.dra_task: asyncio.Task[None] | None = None

    def _memory_reclaim(self) -> str:
        """The node's enforcement of memory guarantees: its device configuration's
        `memoryreclaim` (live), else the setting."""
        if self.configurator is not None:
            return self.configurator.config.memory_reclaim
        return self.settings.memory_reclaim_enforcement

    def _spill_leased(self, key: str) -> int:
        """The host memory a container holds leased for spill (`host-spill`; 0: none)."""
        served = self.leases.for_key(key)
        return served.leased(LEASE_SPILL_NAME) if served is not None else 0

    async def _ledger(self) -> NodeLedger | None:
        current = await bus.read(self.buckets.ledger, self.node, NodeLedger)
        return current.value if current else None


    def _dynamic_mig(self) -> DynamicMig | None:
        """Dynamic MIG (mig_service.py) when the node's migstrategy is `dynamic` at start and
        the device source can make instances (NVML, or the static source's simulation)."""
        assert self.configurator is not None
        backend_of = getattr(self.source, "mig_backend", None)
        if self.configurator.config.mig_strategy != mig.STRATEGY_DYNAMIC or backend_of is None:
            return None
        mig.parse_geometries(self.settings.mig_geometries)  # a bad setting stops the start
        backend = backend_of()
        reconciler = MigReconciler(
            node=self.node, handles=backend.handles, list_devices=backend.list_devices,
            create=backend.create, destroy=backend.destroy, js=self.js, log=self.log,
            clock=self.clock or time.time, grace_s=self.settings.mig_orphan_grace_s,
        )
        return DynamicMig(node=self.node, reconciler=reconciler, ledger_kv=self.buckets.ledger,
                          js=self.js, cluster=self.cluster, log=self.log,
                          source=f"node-agent/{self.node}/{self.instance}")

    async def _static_mig(self, stop: asyncio.Event) -> None:
        """Existing MIG instances served as their own resources (mig_plugin.py)."""
        configurator = self.configurator
        assert configurator is not None
        self.mig_plugins = MigPlugins(self.settings.device_plugin_dir, self.log)
        seen = [-1]

        async def changed() -> None:  # the advertised GPUs changed (config, health)
            _devices, seen[0] = await self.state.wait_change(seen[0])

        await run_static_mig(
            source=self.source, strategy=lambda: configurator.config.mig_strategy,
            health=lambda: {d.uuid: d.healthy for d in configurator.physical()},
            plugins=self.mig_plugins, gpu_resource=self.settings.resource_name,
            interval_s=self.settings.node_heartbeat_s, stop=stop, log=self.log, changed=changed,
            gpus=configurator.offered_gpus, single=configurator.set_mig_single,
            served=self._show_mig_instances,
        )

    async def _show_mig_instances(self, offers: list) -> None:
        """Static instances per card with the pod kubelet gave each (its pod-resources API), for
        the registration and so the dashboard."""
        holders: dict[str, str] = {}
        if offers:
            try:
                pods = await self.pod_resources(self.settings.pod_resources_socket)
            except Exception:
                pods = []  # kubelet unreachable: the instances without their holders
            for pod in pods:
                for container in pod.containers:
                    for devices in container.devices:
                        if devices.resource_name.startswith(mig.MIG_RESOURCE_PREFIX):
                            for device_id in devices.device_ids:
                                holders[device_id] = f"{pod.namespace}/{pod.name}"
        assert self.configurator is not None
        models = {g.uuid: mig.model_for(g.name) for g in self.configurator.gpus}
        await self.configurator.set_mig_instances(
            mig_static.instances_by_gpu(offers, holders, models))

    async def _reconcile_family(self, stop: asyncio.Event) -> None:
        """What the family's node side made for containers (an sMLU, a vDCU's file) is undone
        once their pod's directories are gone (usage.py removes them when the pod's allocation
        ended and kubelet no longer lists it), every usage interval."""
        node_family = registry.node_family(self.settings.device_family)
        if node_family is None:
            return
        while not stop.is_set():
            try:
                live = await asyncio.to_thread(
                    lambda: {c.prepared.pod_uid for c in self.store.all()})
                await asyncio.to_thread(node_family.reconcile, live)
            except Exception as exc:
                self.log.warning("device instances not reconciled", extra={"err": str(exc)})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.usage_interval_s)

    async def _pods_listed(self) -> set[tuple[str, str]] | None:
        try:
            pods = await self.pod_resources(self.settings.pod_resources_socket)
        except Exception:
            return None  # kubelet unreachable: decide from the ledger alone
        return {(p.namespace, p.name) for p in pods}

    async def run(self, stop: asyncio.Event) -> None:
        gpus = await asyncio.to_thread(self.source.discover)
        await asyncio.to_thread(self.store.ensure_root)
        common = {"node": self.node, "log": self.log}
        # The advertised devices under the node's configuration, before anything registers.
        self.configurator = NodeConfigurator(
            settings=self.settings, state=self.state, gpus=gpus, ledger_kv=self.buckets.ledger,
            js=self.js, nc=self.nc, cluster=self.cluster, metrics=self.metrics,
            clock=self.clock, **common,
        )
        await self.configurator.start()
        registrar = NodeRegistrar(
            settings=self.settings, state=self.state, nodes_kv=self.buckets.nodes, js=self.js,
            cluster=self.cluster, instance=self.instance, **common,
        )
        self.health = HealthMonitor(
            source=self.source, gpus=gpus, settings=self.settings, state=self.state,
            registrar=registrar, log=self.log, metrics=self.metrics,
            apply_health=self.configurator.set_unhealthy,
        )
        self.dynamic_mig = self._dynamic_mig()
        self.plugin = DevicePluginService(
            settings=self.settings, state=self.state, store=self.store,
            ledger_kv=self.buckets.ledger, js=self.js, cluster=self.cluster,
            pod_resources=self.pod_resources, clock=self.clock, metrics=self.metrics,
            node_settings=self.configurator.node_settings, mps=self.mps, mig=self.dynamic_mig,
            family=self.settings.device_family or None, lease_ready=self.leases.ready, **common,
        )
        self.endpoint = PluginEndpoint(
            self.settings.device_plugin_dir, self.plugin.ctx.resource_name, self.plugin, self.log
        )
        # elastic compute (limits 1.2); its reclaims coalesced into events (docs/elastic.md)
        self.compute_reclaims = ComputeReclaimReporter(
            node=self.node, js=self.js, cluster=self.cluster, log=self.log,
            source=f"node-agent/{self.node}/{self.instance}",
            window_s=self.settings.compute_reclaim_event_window_s,
            names=lambda: self.lending.names if self.lending else {})
        self.lending = ComputeLending(self.log, on_reclaims=self.compute_reclaims.offer)
        self.sampler = UsageSampler(
            store=self.store, state=self.state, ledger_kv=self.buckets.ledger, nc=self.nc,
            js=self.js, source=self.source, interval_s=self.settings.usage_interval_s,
            pod_listing=self._pods_listed, lending=self.lending, **common,
        )
        limits = LimitsService(
            nc=self.nc, store=self.store, state=self.state, ledger_kv=self.buckets.ledger,
            settings=self.settings, cluster=self.cluster, js=self.js,
            clock=self.clock or time.time, **common,
        )
        self.limits = limits
        await limits.start()
        self.watchdog = await watchdog_from_settings(
            self.settings, probe=self.process_probe, store=self.store,
            ledger=CachedLedger(self.buckets.ledger, self.node), js=self.js,
            leases=self.leases, **common,
        )
        tasks = [
            asyncio.create_task(self.leases.run(stop)),
            asyncio.create_task(registrar.run(stop)),
            asyncio.create_task(self.health.run(stop)),
            asyncio.create_task(self.sampler.run(stop)),
            asyncio.create_task(self.configurator.run(stop)),
            asyncio.create_task(self.mps.run(
                stop, self.state.devices, self._ledger, self.store.all,
                self.settings.mps_reconcile_s,
            )),
        ]
        # DRA mode: the node is a kubelet DRA plugin instead of a device plugin (dra/).
        if start_driver(self, stop) is None:
            tasks.append(asyncio.create_task(self.endpoint.run(stop)))
            # kubelet's calls read the node's ledger from a watch (watched_ledger.py)
            tasks.append(asyncio.create_task(self.plugin.watch_ledger(stop)))
        else:
            tasks.append(self.dra_task)  # type: ignore[arg-type]
        if self.watchdog is not None:
            tasks.append(asyncio.create_task(self.watchdog.run(stop)))
        if self.settings.device_family:  # another vendor's node: its instances of gone pods
            tasks.append(asyncio.create_task(self._reconcile_family(stop)))
        tasks.append(asyncio.create_task(self._static_mig(stop)))
        tasks.append(asyncio.create_task(self.lending.run(stop)))  # elastic compute
        tasks.append(asyncio.create_task(self.compute_reclaims.run(stop)))
        # elastic memory: guarantees count from the ledger, before their containers start
        tasks.append(asyncio.create_task(LedgerGuarantees(
            self.buckets.ledger, self.node, self.leases, self.log).run(stop)))
        if self.dynamic_mig is not None:
            tasks.append(asyncio.create_task(
                self.dynamic_mig.run(stop, self.settings.mig_reconcile_s)))
        self.log.info("node agent running", extra={
            "node": self.node, "gpus": len(gpus), "plugin_dir": self.settings.device_plugin_dir,
        })
        self.ready.set()
        try:
            await stop.wait()
        finally:
            await limits.stop()
            done, pending = await asyncio.wait(tasks, timeout=3.0)
            for task in done:
                with contextlib.suppress(BaseException):
                    task.result()
            # (a cancel Python 3.11's wait_for drops is sent again)
            stuck = await cancel_and_wait(pending) if pending else []
            if stuck:
                self.log.error("tasks did not stop", extra={"tasks": [t.get_name() for t in stuck]})
            await self.plugin.drain()
            await asyncio.to_thread(self.source.close)
