"""A training job asks the study for its plan (runtime.load_best_plan), read-only, on a real one-rank FSDP2 model."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3

import torch
from torch.distributed.fsdp import fully_shard

from planner.testing import make_study_db, synthetic_profile
from runtime import apply_plan, load_best_plan, model_fingerprint
from runtime.ranks.torch_private import prefetch_counts, unshard_async_op
from runtime.reference_workloads import MLPStack
from search_spaces import get_space


def _model(mesh, layers):
    torch.manual_seed(0)
    m = MLPStack(dim=16, layers=layers)
    for block in m.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def test_the_best_faster_plan_for_this_model_then_the_default_for_another(mesh, tmp_path, caplog):
    model = _model(mesh, 3)
    fingerprint = model_fingerprint(model)
    profile = dataclasses.replace(synthetic_profile(blocks=list(fingerprint.module_fqns[1:])), fingerprint=fingerprint)
    url = make_study_db(
        tmp_path, profile, sim_trials=20, space=get_space("uniform")
    )  # trial 1 (80 ms) is confirmed faster than 100 ms
    db = tmp_path / "s.db"
    before = "\n".join(sqlite3.connect(db).iterdump())
    with caplog.at_level(logging.INFO, logger="runtime.apply"):
        plan = load_best_plan(url, "s", model)
    assert plan.provenance.verdict == "faster" and plan.provenance.measured_ratio == 0.8
    assert "confirmed faster than FSDP2's default by job test: total-time ratio 0.800" in caplog.text
    apply_plan(model, plan)
    assert unshard_async_op(model) == plan.unshard_async_op
    assert prefetch_counts(model.blocks[0])[0] == len(plan.modules["blocks.0"].forward_prefetch)
    assert "\n".join(sqlite3.connect(db).iterdump()) == before  # read-only: nothing written

    other = _model(mesh, 2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runtime.apply"):
        default = load_best_plan(url, "s", other)
    assert default.modules == {} and default.unshard_async_op is False  # every module as wrapped
    assert "FSDP2's default: study 's' has no concluded tuning job for this model and world size" in caplog.text
    apply_plan(other, default)
    assert unshard_async_op(other) is False
