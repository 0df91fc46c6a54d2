"""The check every test module passes at its teardown (tests/process_state.py): it names what a
module left behind, and nothing when the module left the process as it found it."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from process_state import ProcessState

TESTS = Path(__file__).resolve().parents[1]


def test_nothing_changed_is_nothing_reported() -> None:
    before = ProcessState.now()
    assert before.left_behind(ProcessState.now(), drivers_allowed=False) == []


def test_an_environment_variable_a_handler_and_a_logger_level_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bus_logger = logging.getLogger("tessera.bus")
    before = ProcessState.now()
    monkeypatch.setenv("TESSERA_LEFT_BEHIND", "1")
    monkeypatch.delenv("PATH")
    level = bus_logger.level
    bus_logger.setLevel(logging.ERROR)  # (setLevel: it also drops the loggers' cached levels)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        problems = before.left_behind(ProcessState.now(), drivers_allowed=False)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        bus_logger.setLevel(level)
    assert any(p.startswith("environment variable TESSERA_LEFT_BEHIND: None -> '1'")
               for p in problems), problems  # fmt: skip
    assert any(p.startswith("environment variable PATH:") for p in problems), problems
    assert any("SIGUSR1" in p for p in problems), problems
    was = logging.getLevelName(before.logger_levels["tessera.bus"])
    assert f"level of logger 'tessera.bus': {was} -> ERROR" in problems, problems


LOAD_A_DRIVER = """\
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from process_state import ProcessState
before = ProcessState.now()
ctypes.CDLL(sys.argv[2])
after = ProcessState.now()
print(len(before.left_behind(after, drivers_allowed=True)))
print(before.left_behind(after, drivers_allowed=False))
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the stand-in library")
def test_a_driver_library_mapped_in_is_named_unless_the_module_says_it_maps_one(
    tmp_path: Path,
) -> None:
    # In a child process: a library of the driver's soname mapped into this one would stay.
    source = tmp_path / "cuda.c"
    source.write_text("int cuInit(unsigned int flags) { (void)flags; return 0; }\n")
    library = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(library),
                    str(source)], check=True)  # fmt: skip
    done = subprocess.run([sys.executable, "-c", LOAD_A_DRIVER, str(TESTS), str(library)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    allowed, refused = done.stdout.splitlines()
    assert allowed == "0"
    assert str(library) in refused and "driver_library_in_process" in refused
