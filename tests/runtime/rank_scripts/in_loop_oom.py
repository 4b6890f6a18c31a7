"""Rank script: out-of-memory errors injected around ``runtime.AutoTuner`` in a user's own loop, on every rank.

argv: storage folder, output JSON, AutoTuner keys JSON. A forward pre-hook on ``blocks.0`` (before any dropout
draws) raises ``torch.OutOfMemoryError`` once, at one place per case (each case a fresh model and study):

- ``race``: the first user's step that runs a candidate; the loop goes on (``on_oom="skip"``). Then the same loop
  without the tuner, skipping that step, for its losses;
- ``race_raise``: the same with ``on_oom="raise"``;
- ``default``: the first user's step (FSDP2's default, recording);
- ``isolated_pass``: the tuner's isolated pass between two steps;

and, first, ``on_oom="ignore"`` refused.

Rank 0 writes {case: {"raised": [type, message] or null, "phases", "final_phase", "plan_is_default", "skipped":
the step index skipped or null, "losses" (race: the loop's, and "reference": the loop's without the tuner)}}.
"""

import contextlib
import json
import logging
import sys

import optuna
import torch
import torch.distributed as dist

from runtime import AutoTuner
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.workload import build_workload

folder, out, keys = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
logging.basicConfig(level=logging.INFO, format="%(message)s")
mesh = init_rank("gloo")
FACTORY, KWARGS, STEPS = "runtime.reference_workloads:mlp", {"dim": 64, "layers": 4, "dropout": 0.1}, 14


def loop(workload, tuner=None, skip=-1, where=None):
    """The user's loop; ``where`` decides, before each forward of ``blocks.1``, whether to run out of memory."""
    model, optimizer = workload.model, workload.optimizer
    losses, phases, state = [], [], {"in_step": False, "fired": None, "step": 0}

    def inject(module, args):
        if state["fired"] is None and where is not None and where(tuner, state):
            state["fired"], state["fired_in_step"] = state["step"], state["in_step"]
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    handle = model.blocks[0].register_forward_pre_hook(inject)
    try:
        for step in range(STEPS):
            state["step"] = step
            phases.append(str(tuner.phase) if tuner else "none")
            if step == skip:
                losses.append(None)
                continue
            with tuner.step() if tuner else contextlib.nullcontext():
                state["in_step"] = True
                optimizer.zero_grad()
                loss = workload.loss_fn(model, workload.make_batch(step))
                loss.backward()
                optimizer.step()
                state["in_step"] = False  # the tuner's work after the step (an isolated pass) is not the user's
            state["in_step"] = False
            skipped = state["fired"] == step and state.get("fired_in_step")
            losses.append(None if skipped else loss.detach().double().item().hex())
    finally:
        handle.remove()
    return losses, phases, state["fired"]


def candidate_step(tuner, state):
    return state["in_step"] and str(tuner.phase) == "racing" and tuner._steps.applied != 0


def first_step(tuner, state):
    return state["in_step"]


def isolated_pass(tuner, state):
    return not state["in_step"] and str(tuner.phase) == "recording"


def case(name, where, **tuner_keys):
    workload = build_workload(FACTORY, mesh, KWARGS)
    tuner = AutoTuner(workload.model, study=name, storage=f"sqlite:///{folder}/{name}.db", **keys, **tuner_keys)
    result = {"raised": None}
    try:
        losses, phases, fired = loop(workload, tuner, where=where)
        result.update(losses=losses, phases=phases, skipped=fired)
    except torch.OutOfMemoryError as e:
        result["raised"] = [type(e).__name__, str(e)]
    result.update(final_phase=str(tuner.phase), plan_is_default=tuner.plan.behaviour_key()
                  == tuner.default.behaviour_key())
    if dist.get_rank() == 0:
        try:
            trials = optuna.load_study(study_name=name, storage=f"sqlite:///{folder}/{name}.db").trials
        except KeyError:  # no study: nothing was measured
            trials = []
        result["failed"] = [t.user_attrs.get("fail_reason", "") for t in trials if t.state.name == "FAIL"]
    return result


result = {}
try:
    AutoTuner(build_workload(FACTORY, mesh, KWARGS).model, study="bad", storage=f"sqlite:///{folder}/bad.db",
              on_oom="ignore")
except Exception as e:  # noqa: BLE001 - the test asserts which
    result["bad_on_oom"] = [type(e).__name__, str(e)]
result["race"] = case("race", candidate_step)
if result["race"]["skipped"] is not None:
    result["race"]["reference"] = loop(build_workload(FACTORY, mesh, KWARGS), skip=result["race"]["skipped"])[0]
result["race_raise"] = case("race_raise", candidate_step, on_oom="raise")
result["default"] = case("default", first_step)
result["isolated_pass"] = case("isolated_pass", isolated_pass)
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
shutdown_rank()
