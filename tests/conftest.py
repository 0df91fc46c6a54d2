"""Shared fixtures: a real nats-server with JetStream, started once per test session.

The suite also runs on several workers (pytest-xdist, `make test`: `-n 2 --dist loadscope`); the
hooks at the end keep that safe: a module's tests stay on one worker (its module-scoped stack
starts once), and a test marked `serial` runs while no other test does.

Modules share a worker process in whatever order they are handed out, so each must leave the
process as it found it: an autouse check fails a module at its teardown when it did not
(tests/process_state.py says what is checked and why).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from process_state import ProcessState
from suite_run import RUN, SERIAL_MODULES, RunLock, module_order_key
from suite_timeline import TimelineWriter
from suite_timeline import summary as timeline_summary

from tessera.bus import Buckets, connect, ensure_bus
from tessera.settings import NatsSettings, TesseraSettings
from tessera_cli.nats_embedded import EmbeddedNats
from tessera_cli.stack_auth import StackAuth

# Hypothesis judges how fast it generates inputs; on a busy 2-core CI machine (whole suites side
# by side) that check failed while every property held. Input speed is not behaviour: it is off,
# and so is the per-example deadline, for the same reason.
settings.register_profile("tessera", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("tessera")

# The GPU nodes the authenticated server has identities for (a dotted name included).
AUTH_NODES = ("node-a", "node-b", "gpu.node-c")


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_the_process_as_it_found_it(request: pytest.FixtureRequest) -> Iterator[None]:
    """Modules share a worker process in any order: one that leaves an environment variable, a
    signal handler, a logger's level or a driver library behind fails here, at its own
    teardown, instead of a later module failing for it (tests/process_state.py)."""
    before = ProcessState.now()
    yield
    allowed = request.node.get_closest_marker("driver_library_in_process") is not None
    problems = before.left_behind(ProcessState.now(), drivers_allowed=allowed)
    settle = time.monotonic() + 5  # a thread still finishing (a render pausing the GC) may undo
    while problems and time.monotonic() < settle:  # its change: only what stays is reported
        time.sleep(0.1)
        problems = before.left_behind(ProcessState.now(), drivers_allowed=allowed)
    if problems:
        pytest.fail(f"{request.node.nodeid} left process-wide state behind:\n  "
                    + "\n  ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def fresh_nats() -> Iterator[EmbeddedNats]:
    """A private server for tests that stop, kill or restart the broker."""
    server = EmbeddedNats()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


class AuthNats:
    """A nats-server enforcing the generated permissions, and every identity's password."""

    def __init__(self, server: EmbeddedNats, auth: StackAuth) -> None:
        self.server = server
        self.auth = auth
        self.url = server.url
        self.nodes = AUTH_NODES

    def settings(self, role: str, node: str | None = None) -> NatsSettings:
        return self.auth.settings(self.url, role, node)


@pytest.fixture(scope="session")
def auth_nats() -> Iterator[AuthNats]:
    """A private server with authorization on: one user per service and per node agent of
    AUTH_NODES, anonymous clients refused (tessera.bus_permissions)."""
    auth = StackAuth.generate(AUTH_NODES)
    server = EmbeddedNats(auth_config=auth.server_config())
    server.start()
    try:
        yield AuthNats(server, auth)
    finally:
        server.cleanup()


@pytest.fixture
def settings() -> TesseraSettings:
    return TesseraSettings()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[object]:
    client = await connect(NatsSettings(NATS_URL=nats_url), name="tessera-test")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def buckets(nc: object, settings: TesseraSettings) -> Buckets:
    """The bus on the session server. Tests must use unique keys (uuid) to stay independent."""
    return await ensure_bus(nc.jetstream(), settings)  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    timeline = config.getoption("suite_timeline", None)
    if timeline and not hasattr(config, "workerinput"):  # the run's one process, or xdist's
        Path(timeline).write_text("")  # controller, before any worker starts: this run's lines
    # Services read settings from the environment; keep a developer's shell out of the tests.
    for key in list(os.environ):
        if key.startswith("TESSERA_") or key.startswith("NATS_"):
            del os.environ[key]
    config.addinivalue_line(
        "markers",
        "serial: runs while no other test of the run does (real-time shares, convergence bounds"
        " under a crash): with several workers, the others wait",
    )
    config.addinivalue_line(
        "markers",
        "driver_library_in_process: the module maps a driver library (libnvidia-ml, libcuda) into"
        " the test process; it, and every test after it, reaches drivers by path only"
        " (tests/process_state.py)",
    )


# --- Several workers (pytest-xdist) ---------------------------------------------------------


def _lock_folder(testrunuid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"tessera-pytest-{testrunuid}"


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:  # an xdist worker: the run's lock
        RUN.lock = RunLock(_lock_folder(worker["testrunuid"]))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: object) -> None:
    """On the controller, per worker: remember the run's lock folder, to remove at the end."""
    folder = _lock_folder(node.workerinput["testrunuid"])  # type: ignore[attr-defined]
    config = node.config  # type: ignore[attr-defined]
    config._tessera_lock_folders = {*getattr(config, "_tessera_lock_folders", ()), folder}


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in getattr(config, "_tessera_lock_folders", ()):
        shutil.rmtree(folder, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-timeline", metavar="FILE", default=None,
                     help="append one JSON line per test (worker, lock wait, start, end) to FILE;"
                          " `python tests/suite_timeline.py FILE` summarises it")  # fmt: skip


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Outermost wrapper: the wait for the lock is not part of the test's own timeout.
    serial = item.get_closest_marker("serial") is not None
    next_serial = nextitem is not None and nextitem.get_closest_marker("serial") is not None
    held = RUN.test(serial=serial, next_serial=next_serial)
    timeline = item.config.getoption("suite_timeline")
    if timeline is None:
        with held:
            yield
        return
    worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
    writer = TimelineWriter(Path(timeline).resolve(), worker)
    with writer.test(item.nodeid, serial, held):
        yield


def pytest_terminal_summary(terminalreporter: object, config: pytest.Config) -> None:
    timeline = config.getoption("suite_timeline", None)
    if timeline and not hasattr(config, "workerinput"):
        lines = [json.loads(line) for line in Path(timeline).read_text().splitlines() if line]
        terminalreporter.write_sep("=", "where the time went (--suite-timeline)")  # type: ignore[attr-defined]
        terminalreporter.write_line(timeline_summary(lines))  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session) -> None:
    RUN.release_kept()
    RUN.finish_teardowns()


@pytest.hookimpl(trylast=True)  # after tests/native/conftest.py marks its `timing` tests serial
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unlisted = sorted({item.nodeid.split("::", 1)[0] for item in items
                       if item.get_closest_marker("serial")} - SERIAL_MODULES)  # fmt: skip
    if unlisted:
        warnings.warn(pytest.PytestWarning(
            f"modules with serial tests missing from tests/suite_run.py SERIAL_MODULES (they are"
            f" handed out among the others, not last): {', '.join(unlisted)}"), stacklevel=1)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadscope`: whole modules to a worker (a module-scoped stack starts once), the
    longest first and the ones with `serial` tests last (module_order_key)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LongestModuleFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

        def _assign_work_unit(self, node: object) -> None:
            first = min(self.workqueue,
                        key=lambda scope: module_order_key(scope, len(self.workqueue[scope])))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return LongestModuleFirst(config, log)
