"""How the suite's workers share the run (tests/suite_run.py): a `serial` test holds the run's
lock exclusively, a worker's consecutive serial tests keep that hold from one to the next, and
anything else is released when its test ends. Another worker is played by a second SuiteRun on
the same lock folder (flock locks belong to each open file, so one process can play both)."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from suite_run import RunLock, SuiteRun, module_order_key
from suite_timeline import TimelineWriter, summary


def others_can_run(folder: Path) -> bool:
    """Whether another worker could start a (non-serial) test now."""
    with (folder / "main.lock").open("a") as main:
        try:
            fcntl.flock(main, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(main, fcntl.LOCK_UN)
        return True


def test_consecutive_serial_tests_keep_the_run_to_themselves(tmp_path: Path) -> None:
    run = SuiteRun(lock=RunLock(tmp_path))
    with run.test(serial=True, next_serial=True):
        assert run.exclusive and not others_can_run(tmp_path)
    assert not others_can_run(tmp_path)  # kept for the next serial test
    with run.test(serial=True, next_serial=False):
        assert run.exclusive and not others_can_run(tmp_path)
    assert others_can_run(tmp_path)  # the last of them let go


def test_a_serial_test_before_an_ordinary_one_lets_go(tmp_path: Path) -> None:
    run = SuiteRun(lock=RunLock(tmp_path))
    with run.test(serial=True, next_serial=False):
        assert not others_can_run(tmp_path)
    assert others_can_run(tmp_path)
    with run.test(serial=False):
        assert not run.exclusive and others_can_run(tmp_path)  # shared with the others


def test_a_hold_kept_when_the_session_ends_is_released(tmp_path: Path) -> None:
    run = SuiteRun(lock=RunLock(tmp_path))
    with run.test(serial=True, next_serial=True):
        pass
    assert not others_can_run(tmp_path)
    run.release_kept()
    assert others_can_run(tmp_path)


def test_the_timeline_names_each_workers_busy_time_and_lock_waits(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.jsonl"
    run = SuiteRun(lock=RunLock(tmp_path / "lock"))
    for worker, nodeid in (("gw0", "tests/a.py::t1"), ("gw1", "tests/b.py::t1")):
        with TimelineWriter(timeline, worker).test(nodeid, False, run.test(serial=False)):
            pass
    lines = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert [(r["worker"], r["test"]) for r in lines] == [("gw0", "tests/a.py::t1"),
                                                         ("gw1", "tests/b.py::t1")]  # fmt: skip
    assert all(r["queued"] <= r["started"] <= r["ended"] for r in lines)
    rows = [  # gw1 waited 3 s for gw0's serial test, then idled 4 s at the end
        {"test": "tests/a.py::t1", "worker": "gw0", "queued": 0, "started": 0, "ended": 10,
         "serial": True},
        {"test": "tests/b.py::t1", "worker": "gw1", "queued": 0, "started": 3, "ended": 6,
         "serial": False},
    ]  # fmt: skip
    text = summary(rows)
    assert "run: 10.0 s" in text
    assert "gw1: 1 tests, busy 3.0 s, waited for the lock 3.0 s, done 6.0 s in (idle 4.0 s" in text
    assert "serial tests: 1, 10.0 s" in text


def test_modules_are_handed_out_longest_first_and_serial_ones_last() -> None:
    queue = {  # module: its count of tests
        "tests/foundation/test_codec.py": 60,  # 15 s estimated from its tests
        "tests/e2e/test_roundtrip.py": 1,  # a stack: 15.25 s
        "tests/native/test_build.py": 4,  # listed: 120 s
        "tests/e2e/test_crash.py": 5,  # serial tests
        "tests/native/test_compute.py": 14,  # serial tests
        "tests/foundation/test_small.py": 3,
    }
    order = sorted(queue, key=lambda module: module_order_key(module, queue[module]))
    assert order == ["tests/native/test_build.py", "tests/e2e/test_roundtrip.py",
                     "tests/foundation/test_codec.py", "tests/foundation/test_small.py",
                     "tests/e2e/test_crash.py", "tests/native/test_compute.py"]  # fmt: skip
