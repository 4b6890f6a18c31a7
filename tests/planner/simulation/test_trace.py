"""The predicted timeline as Chrome trace JSON and PNG."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
from click.testing import CliRunner

from jobs.cli import main
from planner.artifacts.plan import Plan
from planner.simulation.parameters import simulate
from planner.simulation.trace import TRACKS, chrome_trace
from search_spaces import uniform


def test_chrome_trace_has_one_slice_per_event_and_tracks(make_profile):
    p = make_profile(n_blocks=3, optimizer_ms=5.0)
    r = simulate(p, uniform.build(p, 1, 2).with_knobs(unshard_async_op=True), trace=True)
    doc = json.loads(json.dumps(chrome_trace(r)))  # valid JSON
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(r.events)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == set(TRACKS)
    by_name = {e["name"]: e for e in slices}
    assert by_name["forward b0"]["tid"] == 1 and by_name["reduce-scatter b0"]["tid"] == 3
    assert by_name["optimizer <root>"]["ts"] + by_name["optimizer <root>"]["dur"] == pytest.approx(r.step_ms * 1e3)
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert max(c["args"]["MiB alive"] for c in counters) == pytest.approx(r.peak_bytes / 2**20)
    # compute slices never overlap on a CPU device
    compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in slices if e["tid"] == 1)
    assert all(a_end <= b_start + 1e-6 for (_, a_end), (b_start, _) in pairwise(compute))


def test_untraced_result_refuses(make_profile):
    p = make_profile()
    with pytest.raises(ValueError, match="trace=True"):
        chrome_trace(simulate(p, Plan.default(p)))


def test_cli_writes_trace_and_png(make_profile, tmp_path):
    pytest.importorskip("matplotlib")
    profile = tmp_path / "p.json"
    make_profile(n_blocks=4).to_json(profile)
    result = CliRunner().invoke(main, ["simulate", str(profile), "--trace", str(tmp_path / "t.json"),
                                       "--png", str(tmp_path / "t.png")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "t.json").read_text())["otherData"]["step_ms"] > 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
