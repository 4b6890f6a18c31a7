"""PREFETCH_PLANNER=off on a real one-rank FSDP2 model: every entry point of a training job leaves the model's plan as
the user made it and says so in one line a user sees without configuring logging; the ranks agree on it."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import runtime.switch as switch_module
from planner.errors import SwitchError
from planner.study.in_loop import TunerPhase
from runtime import AutoTuner
from runtime.apply import apply_plan, load_best_plan
from runtime.current import current_plan, fsdp2_default
from runtime.ranks.torch_private import prefetch_counts, unshard_async_op
from tests.runtime.models import sharded_mlp

ROOT = Path(__file__).parents[3]


def _hand_set(mesh):
    """A model whose user set a forward prefetch by hand: the plan the switch must leave alone."""
    m = sharded_mlp(mesh)
    m.blocks[0].set_modules_to_forward_prefetch([m.blocks[1]])
    return m


def _step(model):
    model(torch.randn(4, 16)).sum().backward()


def test_off_apply_plan_and_load_best_plan_leave_the_users_plan_and_open_nothing(mesh, tmp_path, monkeypatch, caplog):
    model = _hand_set(mesh)
    mine = current_plan(model)
    monkeypatch.setenv("PREFETCH_PLANNER", "off")
    missing = f"sqlite:///{tmp_path}/no-such.db"
    with caplog.at_level(logging.WARNING):
        plan = load_best_plan(missing, "s", model)  # on: StudyNotFoundError (no database)
        apply_plan(model, fsdp2_default(model).with_knobs(unshard_async_op=True))
    assert plan.modules == {} and not (tmp_path / "no-such.db").exists()
    assert current_plan(model) == mine and prefetch_counts(model.blocks[0]) == (1, 0)
    assert unshard_async_op(model) is False
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[0] for line in lines] == ["load_best_plan", "apply_plan"]
    assert all("PREFETCH_PLANNER=off: the model keeps the plan it has" in line for line in lines)

    monkeypatch.setenv("PREFETCH_PLANNER", "on")  # the same call, switched on, applies
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        apply_plan(model, fsdp2_default(model).with_knobs(unshard_async_op=True))
    assert unshard_async_op(model) is True and prefetch_counts(model.blocks[0]) == (0, 0)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert caplog.records[0].getMessage().startswith("apply_plan: ")


def test_off_the_tuner_tunes_records_and_applies_nothing(mesh, tmp_path, monkeypatch, caplog):
    model = _hand_set(mesh)
    mine = current_plan(model)
    monkeypatch.setenv("PREFETCH_PLANNER", "off")
    with caplog.at_level(logging.WARNING, logger="runtime.in_loop.autotuner"):
        tuner = AutoTuner(model, study="s", storage=f"sqlite:///{tmp_path}/s.db")
    assert tuner.phase == TunerPhase.DONE and tuner.plan == mine
    for _ in range(3):
        with tuner.step():
            _step(model)
    tuner.close()
    assert tuner.steps_tuning == 0 and current_plan(model) == mine
    assert not (tmp_path / "s.db").exists()  # no study opened
    assert [r.getMessage() for r in caplog.records] == [
        "AutoTuner: PREFETCH_PLANNER=off: the model keeps the plan it has (nothing tuned, recorded or applied); "
        "unset PREFETCH_PLANNER to tune"]


def test_one_rank_off_turns_every_rank_off_and_a_bad_value_anywhere_raises_everywhere(mesh, tmp_path, monkeypatch,
                                                                                     caplog):
    """[Note: The ranks agree on the switch]: this rank on, another off (the gather answers as two ranks would)."""
    model = _hand_set(mesh)
    monkeypatch.setattr(switch_module, "gather_objects", lambda local, group=None: [local, True])
    with caplog.at_level(logging.WARNING, logger="runtime.in_loop.autotuner"):
        tuner = AutoTuner(model, study="s", storage=f"sqlite:///{tmp_path}/s.db")
    assert tuner.phase == TunerPhase.DONE
    assert "PREFETCH_PLANNER=off on rank(s) 1, so on every rank" in caplog.text

    monkeypatch.setattr(switch_module, "gather_objects",
                        lambda local, group=None: [local, "PREFETCH_PLANNER='of' is neither on nor off; ..."])
    with pytest.raises(SwitchError, match=r"^rank 1: PREFETCH_PLANNER='of' is neither on nor off"):
        AutoTuner(model, study="s", storage=f"sqlite:///{tmp_path}/s.db")


def test_a_plan_applied_is_one_line_on_stderr_without_any_logging_set_up(tmp_path):
    """Python's default (no handler, WARNING) shows the line: a user sees each plan applied without configuring
    logging; the INFO lines stay hidden."""
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from runtime import apply_plan
        from runtime.current import fsdp2_default
        from runtime.reference_workloads import MLPStack
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        m = MLPStack(dim=16, layers=2)
        for b in m.blocks:
            fully_shard(b)
        fully_shard(m)
        apply_plan(m, fsdp2_default(m).with_knobs(unshard_async_op=True))
        dist.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "apply_plan" in line] == [
        "apply_plan: FSDP2's default applied"]
