"""kube-sim's loops end within a bound once stopped, even when the cancel that ends one is lost
(Python 3.11's wait_for drops a cancel landing as its awaitable completes: a container process
exiting, a plugin's channel getting ready; tests/lost_cancel.py). Before, the stop cancelled
once and waited for ever."""

from __future__ import annotations

import asyncio

from lost_cancel import dropping_the_first_cancel
from tessera.kube_sim.apiserver import ApiServer
from tessera.kube_sim.controllers import WorkloadControllers
from tessera.kube_sim.store import ObjectStore

STOP_BOUND_S = 5.0


async def test_the_workload_controllers_stop_while_a_pass_loses_its_cancel(monkeypatch) -> None:
    controllers = WorkloadControllers(ApiServer(ObjectStore()))
    in_pass = asyncio.Event()

    async def reconcile() -> None:  # a pass waiting on something that loses the first cancel
        in_pass.set()
        await dropping_the_first_cancel()

    monkeypatch.setattr(controllers, "reconcile", reconcile)
    stop = asyncio.Event()
    task = asyncio.create_task(controllers.run(stop))
    await asyncio.wait_for(in_pass.wait(), 10)
    stop.set()
    done, _ = await asyncio.wait({task}, timeout=STOP_BOUND_S)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=STOP_BOUND_S)
    assert done, f"not stopped within {STOP_BOUND_S:g} s"
    task.result()
