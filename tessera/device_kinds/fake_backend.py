"""What the simulated vendor backends share: a state file and a fault feed.

Vendor hardware cannot run here, so each vendor kind has a fake of its management library
(Ascend's DCMI, Cambricon's CNDev, Hygon's hy-smi) behaving as that library is documented to.
What a real driver keeps across a restart of the node agent (vNPU / sMLU / vDCU instances, what
processes hold) lives in a JSON **state file**; faults are injected by appending lines to a
**fault file** (one `<device index> <code>` per line), as the NVIDIA static source does with
XIDs. Writes are atomic (rename) under an exclusive lock, so a test or a simulated workload may
change the state while the agent reads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .node import HealthChange


class StateFile:
    """A JSON object on disk (or in memory when `path` is ''), changed under a lock."""

    def __init__(self, path: str) -> None:
        self._path = Path(path) if path else None
        self._memory: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        if self._path is None:
            return json.loads(json.dumps(self._memory))
        try:
            data = json.loads(self._path.read_text() or "{}")
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self._path}: not JSON: {exc}") from exc
        return data if isinstance(data, dict) else {}

    @contextlib.contextmanager
    def change(self) -> Iterator[dict[str, Any]]:
        """Yields the state to change in place; written back when the block ends cleanly."""
        if self._path is None:
            state = self.read()
            yield state
            self._memory = state
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self._path.with_name(self._path.name + ".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self.read()
            yield state
            fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=self._path.name)
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, sort_keys=True)
            os.replace(tmp, self._path)


class FaultFeed:
    """Lines appended to a file, read once each: `<device index> <code>` (-1 = every device)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._offset = 0

    def next(self) -> tuple[int, int] | None:
        if not self._path:
            return None
        try:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                line = f.readline()
        except FileNotFoundError:
            return None
        if not line.endswith(b"\n"):
            return None  # nothing new, or a line still being written
        self._offset += len(line)
        fields = line.split()
        try:
            return int(fields[0]), int(fields[1])
        except (IndexError, ValueError):
            return self.next()  # a malformed line is skipped, as a driver skips noise


class HealthPoller:
    """A simulated library's health changes, waited for: `poll` (the fake's own call, e.g.
    CNDev's fault poll, turned into HealthChanges) is asked every 50 ms until `timeout_s`; the
    changes one poll returns beyond the first are kept for the next waits (a fault feed hands
    each line once: none is lost)."""

    def __init__(self, poll: Callable[[], list[HealthChange]]) -> None:
        self._poll = poll
        self._pending: deque[HealthChange] = deque()

    def wait(self, timeout_s: float) -> HealthChange | None:
        deadline = time.monotonic() + timeout_s
        while not self._pending:
            self._pending.extend(self._poll())
            if self._pending or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._pending.popleft() if self._pending else None
