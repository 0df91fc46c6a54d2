"""What a test module must leave as it found it in the pytest process (tests/conftest.py checks
it after every module): tests share a worker process, in whatever order `--dist loadscope` hands
modules out, so state one module leaves behind changes what a later one sees.

Checked, because each has broken the suite or nearly so:
- environment variables (change them with `monkeypatch`, or `pytest.MonkeyPatch.context()` in a
  module-scoped fixture);
- the current directory, signal handlers, the cyclic GC's state, the event loop policy, the root
  logger's handlers and level, and the levels of our loggers (`tessera.*`) and nats-py's;
- driver libraries mapped into the process (libnvidia-ml, libcuda). Such a library cannot be
  unloaded, and the dynamic loader answers a later dlopen by soname ("libnvidia-ml.so.1", as
  pynvml does) with the first library of that soname the process holds, whichever test loaded
  it. A module that needs one in-process is marked `driver_library_in_process` and reaches
  drivers by path only (`bind_nvml_library` for pynvml), as must every test after it.

Cheap (a few dictionaries and one read of /proc/self/maps per module) and deterministic: every
value compared is one the module's own code sets.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

DRIVER_LIBRARY_NAMES = ("libnvidia-ml.so", "libcuda.so")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1,
           signal.SIGUSR2, signal.SIGPIPE)  # fmt: skip  (SIGALRM: pytest-timeout's, per test)
# pytest itself names the running test in the environment, and adds its log capture handlers to
# the root logger around every phase of a test.
_PYTEST_ENV_PREFIX = "PYTEST_"
_OWN_LOGGERS = frozenset({"tessera", "test", "nats"})


def driver_libraries() -> frozenset[str]:
    """Paths of the driver libraries mapped into this process."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(DRIVER_LIBRARY_NAMES):
            found.add(fields[5])
    return frozenset(found)


def _own_root_handlers() -> tuple[logging.Handler, ...]:
    return tuple(h for h in logging.getLogger().handlers
                 if not type(h).__module__.startswith("_pytest"))  # fmt: skip


def _logger_levels() -> dict[str, int]:
    """The root logger's level and our own loggers' (and nats-py's, which we quiet). Third-party
    servers started in-process set their own loggers' levels (uvicorn's configuration does, the
    same values every time): those are left out."""
    levels = {"": logging.getLogger().level}
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and name.split(".")[0] in _OWN_LOGGERS:
            levels[name] = logger.level
    return levels


@dataclass(frozen=True)
class ProcessState:
    env: dict[str, str]
    cwd: str
    signals: tuple[object, ...]
    gc: tuple[bool, tuple[int, ...]]
    loop_policy: type
    root_handlers: tuple[logging.Handler, ...]
    logger_levels: dict[str, int]
    drivers: frozenset[str]

    @classmethod
    def now(cls) -> ProcessState:
        return cls(
            env={k: v for k, v in os.environ.items() if not k.startswith(_PYTEST_ENV_PREFIX)},
            cwd=os.getcwd(),
            signals=tuple(signal.getsignal(s) for s in SIGNALS),
            gc=(gc.isenabled(), gc.get_threshold()),
            loop_policy=type(asyncio.get_event_loop_policy()),
            root_handlers=_own_root_handlers(),
            logger_levels=_logger_levels(),
            drivers=driver_libraries(),
        )

    def left_behind(self, after: ProcessState, drivers_allowed: bool) -> list[str]:
        """What changed between this state and `after`, in words (empty: nothing)."""
        problems = []
        for key in sorted(self.env.keys() | after.env.keys()):
            if self.env.get(key) != after.env.get(key):
                problems.append(f"environment variable {key}: {self.env.get(key)!r} -> "
                                f"{after.env.get(key)!r}")  # fmt: skip
        if self.cwd != after.cwd:
            problems.append(f"current directory {self.cwd} -> {after.cwd}")
        for sig, before, now in zip(SIGNALS, self.signals, after.signals, strict=True):
            if before != now:
                problems.append(f"handler of {sig.name}: {before!r} -> {now!r}")
        if self.gc != after.gc:
            problems.append(f"cyclic GC (enabled, thresholds): {self.gc} -> {after.gc}")
        if self.loop_policy is not after.loop_policy:
            problems.append(f"event loop policy {self.loop_policy.__name__} -> "
                            f"{after.loop_policy.__name__}")  # fmt: skip
        if self.root_handlers != after.root_handlers:
            problems.append(f"root logger handlers {list(self.root_handlers)} -> "
                            f"{list(after.root_handlers)}")  # fmt: skip
        for name, level in self.logger_levels.items():
            if after.logger_levels.get(name, level) != level:
                problems.append(f"level of logger {name or 'root'!r}: "
                                f"{logging.getLevelName(level)} -> "
                                f"{logging.getLevelName(after.logger_levels[name])}")
        new_drivers = after.drivers - self.drivers
        if new_drivers and not drivers_allowed:
            problems.append(
                f"driver libraries mapped into the process: {sorted(new_drivers)} (mark the "
                "module `driver_library_in_process` and reach them by path only)")
        return problems
