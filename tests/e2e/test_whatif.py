"""`tessera sim replay`: the trace format, the figures, and a replay through the real scheduler
where binpack and spread visibly differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tessera.hami import ANN_DEVICES_ALLOCATED
from tessera_cli.app import build_app
from tessera_cli.whatif import load_trace, snapshot


def placed_pod(name: str, slices: list[tuple[str, int, int]]) -> dict:
    text = "".join(f"{u},NVIDIA-A10,{m},{c}:" for u, m, c in slices) + ";"
    return {"metadata": {"name": name, "annotations": {ANN_DEVICES_ALLOCATED: text}},
            "spec": {"nodeName": "n1"}}


def test_trace_is_ordered_by_time_and_bad_lines_are_named(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 2, "name": "b", "gpumem": 100}\n# comment\n'
                     '{"t": 1, "name": "a", "gpus": 2}\n{"t": 3, "op": "delete", "name": "a"}\n')
    events = load_trace(trace)
    assert [(e.name, e.op) for e in events] == [("a", "create"), ("b", "create"), ("a", "delete")]
    limits = events[1].to_pod()["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 100}
    trace.write_text('{"t": 1, "name": "a"}\n{"t": 1, "name": "Bad Name"}\n')
    with pytest.raises(ValueError, match=":2:"):
        load_trace(trace)


def test_snapshot_figures() -> None:
    gpus = {"g0": 10000, "g1": 10000}
    pods = [placed_pod("a", [("g0", 4000, 50)]), {"metadata": {"name": "p"}, "spec": {}}]
    shot = snapshot(gpus, pods)
    assert (shot.placed, shot.pending, shot.idle_gpus) == (1, 1, 1)
    assert shot.memory_utilisation == pytest.approx(0.2)
    assert shot.compute_utilisation == pytest.approx(0.25)
    # 6000 MiB free on the shared card out of 16000 free in all.
    assert shot.fragmentation == pytest.approx(6000 / 16000)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_binpack_keeps_a_whole_card_free_where_spread_does_not(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(e) for e in [
        {"t": 0, "name": "small-1", "gpumem": 8000, "gpucores": 20},
        {"t": 1, "name": "small-2", "gpumem": 8000, "gpucores": 20},
        {"t": 2, "name": "whole", "gpus": 1},
    ]) + "\n")
    chart = tmp_path / "whatif.png"
    result = CliRunner().invoke(build_app(), [
        "sim", "replay", str(trace), "--nodes", "1", "--gpus-per-node", "2",
        "--chart", str(chart), "--json",
    ])
    assert result.exit_code == 0, result.output
    figures = {r["policy"]: r for r in json.loads(result.stdout)["results"]}
    assert figures["binpack"]["pods_placed"] == 3
    assert figures["spread"]["pods_placed"] == 2
    assert figures["spread"]["pending_at_end"] == 1
    assert chart.read_bytes().startswith(b"\x89PNG")
