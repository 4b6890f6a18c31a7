"""The compute timer's backward temporaries ([Note: Backward temporaries] in ``runtime/recording/compute_timer.py``).

A small FSDP2 model on a one-rank gloo group whose loss projects onto a wide, fixed vocabulary: the loss's
backward then allocates the gradient of the logits (batch x vocabulary x 4 bytes) in the root's backward before its
blocks', while the model's own gradients are a few KiB.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from runtime.recording.compute_timer import ComputeTimer
from runtime.recording.mark_memory import memory_at_marks
from runtime.recording.recorder import fsdp_modules
from runtime.reference_workloads import MLPStack
from runtime.workload import Workload

DIM, VOCAB, TOKENS = 16, 8192, 256
LOGITS_BYTES = TOKENS * VOCAB * 4  # 8 MiB


def _workload(mesh) -> Workload:
    torch.manual_seed(0)
    model = MLPStack(DIM, layers=2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    head = torch.randn(DIM, VOCAB)  # not a parameter: its gradient is never allocated

    def loss_fn(m, batch):
        x, labels = batch
        return F.cross_entropy(m(x) @ head, labels)

    def make_batch(step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(TOKENS, DIM, generator=g), torch.randint(0, VOCAB, (TOKENS,), generator=g)

    return Workload(model, torch.optim.SGD(model.parameters(), lr=0.1), make_batch, loss_fn)


def test_the_losss_gradient_of_the_logits_is_the_roots_backward_temporary(mesh):
    workload = _workload(mesh)
    modules = fsdp_modules(workload.model)
    timer = ComputeTimer(modules, modules[0][0], "cpu")
    try:
        timer.run(workload, 0)
        assert timer.backward_peak == {}  # read only when asked: a profiled run is not one to time
        timer.run(workload, 1, memory=True)
    finally:
        timer.remove()
    peak = timer.backward_peak
    assert set(peak) == {fqn for fqn, _ in modules}
    # before the blocks' backward the root holds its output projection's gradient, not yet its input projection's
    assert timer.root_grad_pre_bytes == (DIM * DIM + DIM) * 4
    # the gradient of the logits, and of the log-softmax inside cross_entropy: one or two logits-sized tensors
    assert LOGITS_BYTES <= peak[""] <= 3 * LOGITS_BYTES
    block_params = sum(p.numel() * 4 for p in modules[1][1].parameters())
    for fqn, _ in modules[1:]:  # a block's: its gradients and a few activation-sized tensors (256 x 64 floats)
        assert peak[fqn] <= block_params + 4 * TOKENS * 4 * DIM * 4


def test_no_memory_is_read_under_a_profiler_already_running(mesh):
    workload = _workload(mesh)
    modules = fsdp_modules(workload.model)
    timer = ComputeTimer(modules, modules[0][0], "cpu")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            timer.run(workload, 0, memory=True)
    finally:
        timer.remove()
    assert timer.backward_peak == {}
    assert timer.marks  # the run itself went on


def test_memory_at_marks_reads_the_level_and_the_peak_between_marks():
    # (time, size, total after): +100 at 1, +50 at 2, -120 at 4, +10 at 6; marks at 0, 3, 5, 7
    allocations = [(1, 100, 1100), (2, 50, 1150), (4, -120, 1030), (6, 10, 1040)]
    assert memory_at_marks(allocations, [0, 3, 5, 7]) == [(1000, 1000), (1150, 1150), (1030, 1150), (1040, 1040)]
    assert memory_at_marks([], [0, 1]) == [(0, 0), (0, 0)]


@pytest.mark.parametrize(("peak", "grad_pre", "temp", "post"), [
    (10_000, None, 10_000 - 300 - 50, 0), (200, None, 0, 0), (10_000, 100, 10_000 - 100 - 50, 200)])
def test_the_recorder_takes_the_gradient_and_the_recompute_off_the_backward_peak(peak, grad_pre, temp, post):
    """The simulator allocates a module's gradient (its parameter bytes, 300; or the part measured before its
    children's backward, the rest after) and recomputed activations (50) apart from its temporaries; a peak below
    the two is no temporary."""
    from planner.artifacts.fingerprint import Fingerprint
    from planner.artifacts.rank_measurements import (
        CollectiveMeasurements,
        ComputeMeasurements,
        IsolatedMeasurements,
        ModuleMeasurements,
        RankMeasurements,
        StepMeasurements,
    )
    from runtime.recording.consolidation import consolidate

    compute = ComputeMeasurements(fwd_ms=1.0, bwd_ms=2.0, fwd_pre_ms=1.0, bwd_pre_ms=2.0, activation_bytes=10,
                                  recompute_activation_bytes=50, backward_peak_bytes=peak, grad_pre_bytes=grad_pre)
    module = ModuleMeasurements(compute, CollectiveMeasurements(0.5, 0.5, 150))
    isolated = IsolatedMeasurements(None, (), (), {}, {"": module})
    rank = RankMeasurements(0, StepMeasurements(10.0, 1.0, (1000,)), isolated)
    fp = Fingerprint(("",), (75,), (300,), 2, "cpu", ("torch.float32",), "test")  # 300 gradient bytes
    profile = consolidate([rank], fp, {"": False}, {"": 1})
    assert (profile.modules[""].backward_temp_bytes, profile.modules[""].backward_post_grad_bytes) == (temp, post)
    assert ("backward_temp_bytes" in profile.to_dict()["modules"][0]) == (temp > 0)  # written only where not 0


def test_the_roots_saved_tensors_after_its_blocks_are_the_losss_and_the_heads(mesh):
    """A tiny Llama (transformers) whose loss is computed in the root's forward ([Note: The root's saved tensors in
    two parts]): of the root's saved bytes, the embedding's (its token indices) come before the blocks, and the
    final norm's, the LM head's and the loss's (the log-softmax, tokens x vocabulary x 4 bytes) after them."""
    from runtime.reference_workloads import llama

    tokens, vocab, hidden = 2 * 32, 4096, 64
    workload = llama(mesh, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=vocab, batch_size=2, seq_len=32)
    modules = fsdp_modules(workload.model)
    timer = ComputeTimer(modules, modules[0][0], "cpu")
    try:
        timer.run(workload, 0)
    finally:
        timer.remove()
    saved, after = timer.act_bytes[""], timer.root_activation_post_bytes
    assert after >= tokens * vocab * 4  # the log-softmax, at least
    # before the blocks: the token indices (int64) and what the rotary embedding saves, a few KiB
    assert saved - after <= tokens * 8 + 4 * tokens * hidden * 4
