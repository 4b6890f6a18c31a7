"""Rank script: the recorder's isolated passes, every module held unsharded at once against one module at a time.

argv: factory, kwargs JSON, output JSON.

Every real all-gather (``FSDPParamGroup.unshard`` of a sharded group) is made ``SLOW_MS`` slower, so a module's
window that held another module's all-gather would show it. After two training steps of FSDP2's default (the
second leaves its gradients in place: no ``zero_grad`` after it), rank 0 writes {"fqns": [...], "full":
figures, "grouped": figures merged from one pass per module, "full_peak"/"grouped_peaks"/"default_peak": bytes,
"module_bytes": {fqn: unsharded bytes}, "grads_kept": whether the sharded gradients are bitwise what they were,
"full_all_gathers": the real all-gathers while every module was held at once}.
Figures are ``runtime.recording.isolated.isolated_measurements``'s, the overlap microbenchmark left out; the collectives
are timed
in one grouped pass (``Recorder.isolate_next`` times them in the first; here the last, so that the other passes'
peaks are the compute's alone).
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from planner.artifacts.rank_measurements import RankMeasurements, StepMeasurements
from runtime.apply import model_fingerprint
from runtime.ranks.rank import init_rank, shutdown_rank
from runtime.ranks.torch_private import is_sharded, reshard_after_forward, watching_unshard_and_reshard
from runtime.recording.consolidation import merge_isolated
from runtime.recording.isolated import isolated_measurements
from runtime.recording.peak_memory import PeakMeter
from runtime.workload import build_workload, fsdp_modules

SLOW_MS = 60.0
factory, kwargs, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
mesh = init_rank("gloo")
torch.manual_seed(0)
workload = build_workload(factory, mesh, kwargs)
model, optimizer = workload.model, workload.optimizer
meter = PeakMeter(model, [optimizer])
for step in range(2):
    optimizer.zero_grad(set_to_none=True)
    if step == 1:
        meter.begin()
    workload.loss_fn(model, workload.make_batch(step)).backward()
    if step == 0:
        optimizer.step()
default_peak = meter.end().peak_bytes
grads = [p.grad.to_local().clone() for p in model.parameters()]  # the user's, which the passes must leave alone

unsharded: set[int] = set()
all_gathers = [0]  # the real all-gathers so far


def slow_all_gather(group) -> None:
    if id(group) not in unsharded:  # a real all-gather (a no-op unshard of an unsharded group returns at once)
        time.sleep(SLOW_MS / 1e3)
        unsharded.add(id(group))
        all_gathers[0] += 1


fingerprint = model_fingerprint(model)
modules = fsdp_modules(model)
resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}


def figures(only, collectives):
    meter.begin()
    result = isolated_measurements(workload, fingerprint, 2, "cpu", resharding, zero_grad=False, only=only,
                                   collectives=collectives)
    return result, meter.end().peak_bytes


def resharded(group) -> None:
    if is_sharded(group):  # FSDP2 calls reshard where it may not reshard (post-forward, reshard_after_forward False)
        unsharded.discard(id(group))


with watching_unshard_and_reshard(slow_all_gather, resharded):
    full, full_peak = figures(None, False)
    full_all_gathers = all_gathers[0]  # every module held at once: the hold's own, one per module
    parts, peaks = [], []
    for i, (fqn, _) in enumerate(modules):
        part, peak = figures((fqn,), i == len(modules) - 1)
        parts.append(part)
        peaks.append(peak)
grouped = merge_isolated(parts)
# as a Profile file writes them (planner.artifacts.rank_measurements.RankMeasurements.to_json), the overlap left out
full, grouped = ({k: v for k, v in RankMeasurements(0, StepMeasurements(0.0, 0.0, ()), p).to_json().items()
                  if k != "overlap"} for p in (full, grouped))
kept = all(torch.equal(g, p.grad.to_local()) for g, p in zip(grads, model.parameters(), strict=True))
peaks_everywhere = [None] * dist.get_world_size()
dist.all_gather_object(peaks_everywhere, [default_peak, full_peak, peaks])
if dist.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({"fqns": [fqn for fqn, _ in modules], "full": full, "grouped": grouped,
                   "default_peak": max(p[0] for p in peaks_everywhere),
                   "full_peak": max(p[1] for p in peaks_everywhere),
                   "grouped_peaks": [max(p[2][i] for p in peaks_everywhere) for i in range(len(modules))],
                   "module_bytes": dict(zip(fingerprint.module_fqns, fingerprint.param_bytes, strict=True)),
                   "grads_kept": kept, "slow_ms": SLOW_MS, "full_all_gathers": full_all_gathers}, f)
shutdown_rank()
