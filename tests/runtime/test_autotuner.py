"""``runtime.AutoTuner`` in a user's own loop, on 2 gloo ranks: the loss is untouched, the study is reused at the
next start, a failing step is recorded and the next tuner goes on, and bad models are refused before any step."""

from __future__ import annotations

import json

import optuna
import pytest

from planner.study.in_loop import SOURCE
from planner.study.records import MeasuredTrialRecord
from search_spaces import SPACES
from tests.multirank import run_ranks

# Small settings: every phase within a 40-step loop on the MLP.
KEYS = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
        "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}
MLP = ("runtime.reference_workloads:mlp", {"dim": 64, "layers": 4, "dropout": 0.1})
LLAMA = ("runtime.reference_workloads:llama", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                                               "num_attention_heads": 4, "vocab_size": 256, "seq_len": 16})


def run_loop(tmp_path, workload, steps: int, mode: str, storage: str = "none", microbatches: int = 1,
             **keys) -> dict:
    out = tmp_path / f"{mode.replace(':', '_')}-{steps}.json"
    factory, kwargs = workload
    run_ranks("in_loop.py", factory, json.dumps(kwargs), str(steps), str(microbatches), storage, str(out),
              json.dumps({**KEYS, **keys}), mode)
    return json.loads(out.read_text())


def _measured(storage: str) -> list[MeasuredTrialRecord]:
    study = optuna.load_study(study_name="in-loop", storage=storage)
    return [MeasuredTrialRecord.from_trial(t) for t in study.trials]


@pytest.mark.slow
@pytest.mark.parametrize(("workload", "space"), [(MLP, s) for s in SPACES] + [(LLAMA, "per_module")],
                         ids=[f"mlp-{s}" for s in SPACES] + ["llama-per_module"])
def test_loss_bitwise_identical_with_the_tuner(tmp_path, workload, space):
    """40 steps of a user's loop with gradient accumulation (2 microbatches), with and without the tuner:
    the same loss at every step on every rank, through recording (isolated passes between steps, dropout drawing
    random numbers), the race's plan switches and the confirmation."""
    result = run_loop(tmp_path, workload, 40, "compare", microbatches=2, space=space)
    assert result["with"] == result["without"]
    assert result["phases"][0] == "recording" and "racing" in result["phases"]
    assert len(set(result["with"][0])) == 40  # the loss moves: a loop that trains


@pytest.mark.slow
def test_the_next_start_reuses_the_study(tmp_path):
    storage = f"sqlite:///{tmp_path}/tuning.db"
    first = run_loop(tmp_path, MLP, 70, "tune", storage)
    assert first["final_phase"] == "done" and 0 < first["steps_tuning"] < 70
    i = first["phases"].index("done")
    assert first["phases"][i:] == ["done"] * (70 - i) and first["steps_tuning"] == i
    measured = _measured(storage)
    assert measured and all(r.source == SOURCE for r in measured)
    assert sum(r.confirmation is not None for r in measured) == (first["confirmation"] is not None)

    second = run_loop(tmp_path, MLP, 5, "tune", storage)
    assert second["steps_tuning"] == 0 and second["phases"] == ["done"] * 5
    faster = first["confirmation"] is not None and first["confirmation"][3] == "faster"
    # the study's recommendation: the confirmed plan, else FSDP2's default (as a plan that changes nothing)
    assert second["plan"]["modules"] == (first["plan"]["modules"] if faster else {})
    assert len(_measured(storage)) == len(measured)  # nothing measured again

    out = tmp_path / "errors.json"
    run_ranks("in_loop_errors.py", storage, str(out))
    errors = json.loads(out.read_text())
    assert errors["plain"][0] == "NotShardedError" and "not wrapped with fully_shard" in errors["plain"][1]
    assert errors["root_only"][0] == "NotShardedError" and "no FSDP module beyond the root" in errors["root_only"][1]
    assert errors["another_model"][0] == "StudyModelMismatchError"
    assert "tuned for another model" in errors["another_model"][1]


@pytest.mark.slow
def test_a_failing_step_propagates_and_the_next_tuner_goes_on(tmp_path):
    storage = f"sqlite:///{tmp_path}/tuning.db"
    result = run_loop(tmp_path, MLP, 70, "raise:8", storage)  # step 8: a candidate's warm-up
    assert result["raised"] == ["ValueError", "boom at step 8"]
    assert result["final_phase"] == "done" and result["plan"]["modules"] == {}
    failed = [r for r in _measured(storage)[:3] if r.state == optuna.trial.TrialState.FAIL]
    assert any("ValueError: boom at step 8" in r.failure.reason for r in failed)
    assert not any(r.state == optuna.trial.TrialState.RUNNING for r in _measured(storage))
    assert result["second"]["final_phase"] == "done" and result["second"]["steps_tuning"] > 0


@pytest.mark.slow
def test_trainer_adapters_leave_the_loss_identical(tmp_path):
    """The Hugging Face and Lightning adapters, their hooks called where the trainers call them, with the
    frameworks' real state classes: the same loss at every step as the bare loop, and the tuner done at the end
    (or closed by on_train_end)."""
    pytest.importorskip("lightning")
    out = tmp_path / "adapters.json"
    run_ranks("adapters.py", str(out), json.dumps(KEYS))
    result = json.loads(out.read_text())
    assert result["hf"] == result["bare"] and result["lightning"] == result["bare"]
    assert result["phases"] == {"hf": "done", "lightning": "done"}


@pytest.mark.slow
def test_isolation_over_the_budget_keeps_the_default(tmp_path):
    """A budget the recorder's isolated passes would exceed: no pass runs, FSDP2's default stays, nothing raced."""
    result = run_loop(tmp_path, MLP, 12, "tune", memory_budget="+1%")
    assert result["final_phase"] == "done" and result["plan"]["modules"] == {}
    assert result["confirmation"] is None and "racing" not in result["phases"]
    assert result["steps_tuning"] == result["phases"].count("recording") < 12


@pytest.mark.slow
def test_lightning_end_to_end(tmp_path):
    """Lightning's own fit loop (ModelParallelStrategy on CPU with gloo, accumulate_grad_batches=2) with the
    adapter: every batch's loss bitwise identical to the same fit without it, and the tuner done in 40 steps."""
    pytest.importorskip("lightning")
    for mode in ("bare", "tune"):
        run_ranks("lightning_e2e.py", mode, str(tmp_path))
    for rank in (0, 1):
        bare = json.loads((tmp_path / f"bare-{rank}.json").read_text())
        tuned = json.loads((tmp_path / f"tune-{rank}.json").read_text())
        assert len(bare["losses"]) == 80 and tuned["losses"] == bare["losses"]
        assert tuned["phase"] == "done"
