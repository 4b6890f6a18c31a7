"""bench.anchor_guard: the recorder's steps split as the recorder runs them, the guard's anchors, the registered
decision, and one line for a file that is not a step_history run."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.anchor_guard import ASYNC_PAIRS, GUARD, GuardRun, decision, guard_run, main, summary, sync_steps


def _write(tmp_path, name, recorder_ms, logged_ms, blocks):
    path = tmp_path / name
    path.write_text(json.dumps({
        "study": "s", "recorder_default_ms": recorder_ms,
        "recorder_steps": [[float(i), ms, 0.0, 0.0, 0] for i, ms in enumerate(logged_ms)],
        "blocks": [{"block": b, "start_s": 0.0, "default_ms": ms} for b, ms in blocks]}))
    return path


def _run(e0, after, target, ratio=1.0):
    return GuardRun("r", e0, (100.0,) * 5, (100.0 * ratio,) * 5, (after,) * 5, target)


def test_the_async_pairs_agree_with_the_recorder():
    from runtime.recorder import ASYNC_PAIRS as recorders

    assert ASYNC_PAIRS == recorders


def test_the_synchronous_steps_are_first_in_even_pairs_and_second_in_odd_ones():
    # the recorder: pair 0 (sync, async), pair 1 (async, sync), ... then the timed steps
    logged = []
    for s in range(ASYNC_PAIRS):
        pair = [f"sync{s}", f"async{s}"]
        logged += pair if s % 2 == 0 else pair[::-1]
    logged += ["t0", "t1", "t2"]
    sync, timed = sync_steps(logged)
    assert sync == [f"sync{s}" for s in range(ASYNC_PAIRS)]
    assert timed == ["t0", "t1", "t2"]
    with pytest.raises(ValueError, match="pair steps"):
        sync_steps(logged[: 2 * ASYNC_PAIRS])


def test_a_saved_run_reads_its_anchors_against_the_blocks_after_the_first(tmp_path):
    pairs = [ms for s in range(ASYNC_PAIRS) for ms in ((1000.0, 950.0) if s % 2 == 0 else (950.0, 1000.0))]
    timed = [1250.0, 1300.0, 1200.0, 1240.0, 1260.0]
    path = _write(tmp_path, "a.json", 1270.0, pairs + timed,
                  [("alone", [1010.0, 990.0, 1000.0, 1020.0, 980.0]), ("all", [1100.0, 1080.0, 1120.0]),
                   ("alone", [900.0, 920.0, 880.0])])
    run = guard_run(path)
    assert run.sync_ms == (1000.0,) * ASYNC_PAIRS
    assert run.guard_ratio == pytest.approx(1250.0 / 1000.0) and run.fired
    assert run.target_ms == pytest.approx((1100.0 + 900.0) / 2)  # the first block is not the target
    errors = run.errors()
    assert errors["E0"] == pytest.approx(0.27)
    assert errors["E1"] == errors["E3"] == pytest.approx(0.0)
    assert errors["E2"] == pytest.approx((1270.0 + 1000.0) / 2 / 1000.0 - 1)


def test_the_guard_keeps_the_anchor_inside_its_band():
    inside, outside = _run(1000.0, 800.0, 1000.0, ratio=GUARD - 0.01), _run(1000.0, 800.0, 1000.0, ratio=GUARD + 0.01)
    assert not inside.fired and inside.errors()["E1"] == 0.0
    assert outside.fired and outside.errors()["E1"] == pytest.approx(-0.2)
    assert _run(1000.0, 800.0, 1000.0, ratio=1 / GUARD - 0.01).fired  # both ways


def test_the_registered_decision():
    calm = [_run(1000.0 + d, 1000.0 + d, 1000.0) for d in (20.0, -30.0, 10.0, 40.0, -20.0)]  # re-timing changes nothing
    stretch = _run(1250.0, 1010.0, 1000.0, ratio=1.2)
    chosen, rms, _ = decision(calm + [stretch])
    assert chosen == "E1" and rms["E1"] < rms["E0"]
    # the guard makes a run no worse (E0 -4.8%, re-timed +4.8%): taken; 10.8 points worse (-2.0%, +12.7%): not
    bad = _run(1000.0, 1100.0, 1050.0, ratio=1.2)
    worse = _run(1000.0, 1150.0, 1020.0, ratio=1.2)
    assert decision(calm + [stretch, bad])[0] == "E1"
    assert decision(calm + [stretch, worse])[0] == "E0"
    # E2 better in every run, enough runs for the test: taken
    halfway = [_run(1100.0, 1000.0 - 20.0 * k, 1000.0 - 10.0 * k) for k in range(8)]
    chosen, rms, p = decision(halfway)
    assert p < 0.05 and chosen == "E2"
    with pytest.raises(ValueError, match="no runs"):
        decision([])


def test_the_summary_names_the_decision(tmp_path):
    lines = summary([_run(1000.0, 990.0, 1000.0), _run(1300.0, 1000.0, 1000.0, ratio=1.3)])
    assert lines[-1].startswith("the guard fired in 1 of 2") and lines[-1].endswith("the registered decision: E1")
    assert any(x.startswith("E0: RMS error") and "within 5% in 1 of 2" in x for x in lines)


def test_a_file_that_is_not_a_step_history_run_is_one_line_and_exit_2(tmp_path):
    fidelity = tmp_path / "fidelity.json"
    fidelity.write_text(json.dumps({"study": "s", "profile": {}, "rows": []}))
    result = CliRunner().invoke(main, [str(fidelity)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "not a saved `bench.step_history --json` run" in result.output
    beside_first = _write(tmp_path, "beside.json", 1.0, [1.0] * 15, [("beside", [1.0] * 5), ("alone", [1.0])])
    result = CliRunner().invoke(main, [str(beside_first)])
    assert result.exit_code == 2 and "first block must be `alone`" in result.output
