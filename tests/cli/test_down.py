"""`tessera down` stops the process a stack file names, and says when there is nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from tessera_cli.app import build_app

# Stands in for `tessera up`: records itself in the stack file, leaves on SIGTERM with a mark.
UP = """
import json, signal, sys, time, pathlib
state = pathlib.Path(sys.argv[1])
def leave(*_):
    (state / "left").write_text("SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, leave)
# written as `tessera up` writes it (a scratch file renamed): a reader never sees half of it
(state / "stack.tmp").write_text(json.dumps({"pid": __import__("os").getpid(), "ready": True}))
(state / "stack.tmp").replace(state / "stack.json")
while True:
    time.sleep(0.1)
"""


def test_down_stops_the_stack_and_then_has_nothing_to_stop(tmp_path: Path) -> None:
    up = subprocess.Popen([sys.executable, "-c", UP, str(tmp_path)])
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "stack.json").exists():
            assert time.monotonic() < deadline and up.poll() is None
            time.sleep(0.05)
        result = CliRunner().invoke(build_app(), ["down", "--state-dir", str(tmp_path)])
        assert result.exit_code == 0, result.output
        assert f"stopped the stack of {tmp_path} (pid {up.pid})" in result.output
        assert (tmp_path / "left").read_text() == "SIGTERM"
        assert up.wait(10) == 0
    finally:
        if up.poll() is None:
            up.kill()
    # The stack file of a process that is gone: nothing to stop, and the file goes.
    (tmp_path / "stack.json").write_text(json.dumps({"pid": up.pid}))
    result = CliRunner().invoke(build_app(), ["down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0 and "had already ended: nothing to stop" in result.output
    assert not (tmp_path / "stack.json").exists()
    result = CliRunner().invoke(build_app(), ["down", "--state-dir", str(tmp_path)])
    assert "nothing to stop" in result.output
