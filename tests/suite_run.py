"""How the suite runs on several workers (pytest-xdist, `make test`) without tests disturbing
one another. Used by tests/conftest.py's hooks and by the stack fixtures.

- A readers-writer lock over files shared by the run's workers: every test holds it shared while
  it runs (setup and teardown included), a test marked `serial` exclusive, so a real-time
  measurement or a convergence bound under crashes runs with nothing else beside it (a worker's
  consecutive serial tests keep the exclusive hold from one to the next).
- Teardowns that only wait (a local stack stopping: SIGTERM, then waiting seconds for each
  process) run in a thread beside the next tests. Each holds the lock shared until it is done, and
  all are done before a `serial` test starts and before the worker's session ends.
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path


class RunLock:
    """Files in a folder of the run. A waiting writer holds the gate, so new readers queue
    behind it and a `serial` test is not starved by a stream of short ones."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.gate = folder / "gate.lock"
        self.main = folder / "main.lock"

    @contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        with self.gate.open("a") as gate, self.main.open("a") as main:
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_EX)
                fcntl.flock(main, fcntl.LOCK_EX)
            else:
                fcntl.flock(gate, fcntl.LOCK_SH)
                fcntl.flock(main, fcntl.LOCK_SH)
                fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(main, fcntl.LOCK_UN)
                fcntl.flock(gate, fcntl.LOCK_UN)

    def join_shared(self) -> Callable[[], None]:
        """One more shared hold, taken by a process that already holds it shared (so it passes
        no gate, which a waiting writer may hold); returns its release."""
        main = self.main.open("a")
        fcntl.flock(main, fcntl.LOCK_SH)

        def release() -> None:
            fcntl.flock(main, fcntl.LOCK_UN)
            main.close()

        return release


@dataclass
class SuiteRun:
    """This process's part of the run: its lock (None in a single-process run), whether the
    test now running holds it exclusively, and the teardowns still running.

    Consecutive `serial` tests of this process keep the exclusive hold from one to the next:
    taking it waits for the test another worker is running to end, and between two serial
    tests that worker would start another (a stack's test of tens of seconds, say), which the
    next serial test would wait for again with this worker idle."""

    lock: RunLock | None = None
    exclusive: bool = False
    teardowns: list[threading.Thread] = field(default_factory=list)
    kept: ExitStack | None = None  # the exclusive hold the last serial test left for the next

    @contextmanager
    def test(self, serial: bool, next_serial: bool = False) -> Iterator[None]:
        """Around one test; `next_serial`: this process runs a `serial` test next."""
        if serial:
            self.finish_teardowns()
        if self.lock is None:
            yield
            return
        hold, self.kept = self.kept, None
        if hold is not None and not serial:  # (not expected: kept only for a serial test)
            hold.close()
            hold = None
        if hold is None:
            hold = ExitStack()
            hold.enter_context(self.lock.hold(exclusive=serial))
        self.exclusive = serial
        try:
            yield
        finally:
            self.exclusive = False
            if serial and next_serial:
                self.kept = hold
            else:
                hold.close()

    def release_kept(self) -> None:
        hold, self.kept = self.kept, None
        if hold is not None:
            hold.close()

    def teardown_in_background(self, name: str, teardown: Callable[[], None]) -> None:
        """Run `teardown` beside the next tests (inline when a `serial` test is running)."""
        if self.exclusive:
            teardown()
            return
        release = self.lock.join_shared() if self.lock is not None else None

        def run() -> None:
            try:
                teardown()
            finally:
                if release is not None:
                    release()

        thread = threading.Thread(target=run, name=f"teardown {name}")
        thread.start()
        self.teardowns.append(thread)

    def finish_teardowns(self) -> None:
        while self.teardowns:
            self.teardowns.pop().join()


# One per pytest process (each xdist worker is a process of its own).
RUN = SuiteRun()


# --- The order modules are handed out in (tests/conftest.py's xdist scheduler) ---------------

# How long modules take (seconds of one worker on the 2-core CI machine, quiet; from --durations
# and `--suite-timeline` runs): the work queue is handed out longest first (longest processing
# time first), so the run ends on short modules and neither worker is left running a long one
# while the other idles. xdist's own order (most tests first) ended the run on the stack tests:
# one to five tests each, tens of seconds each. A module not listed is estimated from its count
# of tests and its folder (STACK_FOLDERS: each starts processes, a stack or containers).
MODULE_SECONDS: dict[str, float] = {
    "tests/native/test_build.py": 120,  # the whole native suite again under ASan
    "tests/compose/test_compose_stack.py": 110,  # the image, then the stack in containers
    "tests/scheduler/test_concurrency.py": 15,
    "tests/admission/test_admission_fuzz.py": 85,
    "tests/cli/test_stack_commands.py": 80,
    "tests/e2e/test_nats_cluster.py": 60,
    "tests/charts/test_charts.py": 55,
    "tests/e2e/test_elastic_memory_stack.py": 45,
    "tests/e2e/test_whatif.py": 45,
    "tests/node_agent/test_watchdog.py": 40,
    "tests/cli/test_finding_the_stack.py": 40,
    "tests/e2e/test_demo_twice.py": 35,
    "tests/scheduler/test_decision_reference.py": 35,
    "tests/e2e/test_dra_stack.py": 30,
    "tests/e2e/test_oci_pods.py": 30,
    "tests/compose/test_image_runs.py": 30,
    "tests/native/test_driver_variants.py": 25,
    "tests/kube_sim/test_shutdown.py": 20,
    "tests/native/test_real_container.py": 20,
    "tests/native/test_tenant_races.py": 15,  # the tenant's libvgpu built, then 7 tests
}
STACK_FOLDERS = ("tests/e2e/", "tests/compose/", "tests/cli/")
STACK_MODULE_S, SECONDS_PER_TEST = 15.0, 0.25

# Modules with `serial` tests (e2e convergence bounds under crashes; native real-time shares,
# the `timing` ones): handed out last, after every other module. A serial test runs with the other
# worker idle wherever it is placed; early or midway it would also wait for a long test the other
# worker had started, and hold that worker back from its own long modules.
SERIAL_MODULES = frozenset({
    "tests/e2e/test_crash.py", "tests/e2e/test_preemption.py", "tests/native/test_compute.py",
    "tests/native/test_compute_elastic.py", "tests/native/test_compute_sharing.py",
    "tests/native/test_tenant.py",
})  # fmt: skip


def module_order_key(module: str, tests: int) -> tuple[bool, float]:
    """Sort key of a module in the work queue: ordinary modules first, longest first."""
    seconds = MODULE_SECONDS.get(module)
    if seconds is None:
        stack = module.startswith(STACK_FOLDERS)
        seconds = tests * SECONDS_PER_TEST + (STACK_MODULE_S if stack else 0.0)
    return (module in SERIAL_MODULES, -seconds)
