"""Rank script: a user's own training loop with ``runtime.AutoTuner`` (and without it, to compare losses).

argv: factory, kwargs JSON, steps, microbatches, storage URL (or "none"), output JSON, AutoTuner keys JSON, mode.
The loop is written as a user writes it (no runtime.workload step helpers): zero_grad, forward and backward per
microbatch (loss / n), optimizer step. Modes:

- ``compare``: the loop without the tuner, then with it, each on a fresh model;
- ``compare:slow-others``: as ``compare``, and with the tuner every step that runs a plan other than the one the
  model arrived with sleeps 30 ms more (inside the step): no plan can be faster than the model's own;
- ``tune``: with the tuner only;
- ``raise:N``: with the tuner, step N raises ``ValueError`` on every rank; then a second tuner on the same study
  runs the loop on a fresh model;
- ``leave:N``: with the tuner; in torchrun's first attempt rank 1 leaves mid-step N (SIGKILL), so torchrun
  stops rank 0 and restarts both (``--max-restarts``); the restarted attempt runs the whole loop.
- ``stuck:R``: with the tuner; in the first step that runs a candidate, rank R raises ``torch.OutOfMemoryError``
  before ``blocks.1``'s forward (writing the time to ``raised`` beside the output) and every other rank waits there
  in a fake collective that never returns: the failure board's bound must end the job. Nothing is written.

Rank 0 writes {"without"/"with": [[loss hex per step] per rank], "phases": [phase at each step],
"steps_tuning", "final_phase", "confirmation": [ratio, ci, rounds, verdict, launches] or null, "plan": Plan dict,
"watch": [checks, steps, ratio, reverted] or null, "own_plan": the plan the model arrived with or null, "model_plan":
the plan the model has at the end (``current_plan``), "check_lines": the check_only report,
"raised": [type, message] (raise mode), "second": the same figures of the second tuner (raise mode)}.
"""

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from runtime import AutoTuner, current_plan
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.workload import build_workload

factory, kwargs, steps, microbatches = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
storage, out, keys, mode = sys.argv[5], sys.argv[6], json.loads(sys.argv[7]), sys.argv[8]
storage = None if storage == "none" else storage
if storage is None:  # the AutoTuner's default storage, studies/NAME.db in the working directory: the test's folder
    os.chdir(os.path.dirname(os.path.abspath(out)))
logging.basicConfig(level=logging.INFO, format="%(message)s")
mesh = init_rank("gloo")


def loop(tuner: AutoTuner | None, workload, raise_at: int = -1, leave_at: int = -1,
         slow_others: bool = False) -> tuple[list[str], list[str]]:
    model, optimizer = workload.model, workload.optimizer
    own = tuner.own_plan.behaviour_key() if slow_others else None  # read before the tuner applied FSDP2's default
    losses, phases = [], []
    for step in range(steps):
        phases.append(str(tuner.phase) if tuner else "none")
        with tuner.step() if tuner else contextlib.nullcontext():
            optimizer.zero_grad()
            total = 0.0
            for i in range(microbatches):
                loss = workload.loss_fn(model, workload.make_batch(step * microbatches + i)) / microbatches
                loss.backward()
                total += loss.detach().double().item()
            if step == leave_at and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # the rank is gone: no exception, no cleanup
            if step == raise_at:
                raise ValueError(f"boom at step {step}")
            if own is not None and current_plan(model).behaviour_key() != own:
                time.sleep(0.03)
            optimizer.step()
        losses.append(float(total).hex())
    return losses, phases


def gathered(local):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone


def figures(tuner: AutoTuner, phases: list[str]) -> dict:
    c = tuner.confirmation
    w = tuner.watch
    return {"phases": phases, "steps_tuning": tuner.steps_tuning, "final_phase": str(tuner.phase),
            "plan": tuner.plan.to_dict(), "watch": None if w is None else [w.blocks, w.steps, w.ratio, w.reverted],
            "own_plan": None if tuner.own_plan is None else tuner.own_plan.to_dict(),
            "model_plan": current_plan(tuner.model).to_dict(), "check_lines": tuner.check_lines,
            "confirmation": None if c is None else [c.ratio, list(c.ci95), c.rounds, str(c.verdict), c.launches]}


def stuck_at_a_candidate(tuner: AutoTuner, model, failing: int) -> None:
    """``stuck:R``: the first step that runs a candidate raises on rank R and never returns on the others."""
    fired = []

    def hook(module, args):
        if fired or str(tuner.phase) != "racing" or tuner._steps.applied in (0, None):
            return
        fired.append(1)
        if dist.get_rank() == failing:
            with open(os.path.join(os.path.dirname(os.path.abspath(out)), "raised"), "w") as f:
                f.write(repr(time.time()))
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {failing})")
        threading.Event().wait()

    model.blocks[1].register_forward_pre_hook(hook)


result = {}
if mode.startswith("compare"):
    result["without"] = gathered(loop(None, build_workload(factory, mesh, kwargs))[0])
workload = build_workload(factory, mesh, kwargs)
tuner = AutoTuner(workload.model, study="in-loop", storage=storage, **keys)
if mode.startswith("stuck:"):
    stuck_at_a_candidate(tuner, workload.model, int(mode.split(":")[1]))
    loop(tuner, workload)
    raise SystemExit("the failure board's bound did not end the job")
if mode.startswith("raise:"):
    try:
        loop(tuner, workload, raise_at=int(mode.split(":")[1]))
    except ValueError as e:
        result["raised"] = [type(e).__name__, str(e)]
    result.update(figures(tuner, []))
    workload = build_workload(factory, mesh, kwargs)
    second = AutoTuner(workload.model, study="in-loop", storage=storage, **keys)
    result["second"] = figures(second, loop(second, workload)[1])
else:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    leave = int(mode.split(":")[1]) if mode.startswith("leave:") and first_attempt else -1
    losses, phases = loop(tuner, workload, leave_at=leave, slow_others=mode == "compare:slow-others")
    result["with"] = gathered(losses)
    result.update(figures(tuner, phases))
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump(result, f)
shutdown_rank()
