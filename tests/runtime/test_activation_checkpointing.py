"""Activation checkpointing in the reference workloads: torchtitan's modes, the loss unchanged, the recorder's
recompute figures."""

from __future__ import annotations

import json

import pytest

from planner.errors import WorkloadError
from runtime.activation_checkpointing import checkpointed_indices
from runtime.reference_workloads import mlp
from runtime.workload import train_step


def test_modes_name_torchtitans_blocks():
    assert checkpointed_indices(4, "none") == []
    assert checkpointed_indices(4, "full") == [0, 1, 2, 3]
    assert checkpointed_indices(8, "selective") == [1, 3, 5, 7]  # torchtitan counts from 1, wraps every 2nd
    with pytest.raises(WorkloadError, match="'full' checkpoints every block"):
        checkpointed_indices(4, "every")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_leaves_the_loss_bitwise(mesh, mode):
    """Dropout draws random numbers in every block: the recompute draws the same (``preserve_rng_state``)."""
    plain = mlp(mesh, dim=32, layers=4, dropout=0.1)  # each factory seeds the global generator
    expected = [train_step(plain, s).item() for s in range(3)]
    checkpointed = mlp(mesh, dim=32, layers=4, dropout=0.1, activation_checkpointing=mode)
    got = [train_step(checkpointed, s).item() for s in range(3)]
    assert got == expected and len(set(got)) == 3


def test_the_recorder_notes_the_modules_that_recompute(mesh):
    from runtime.recording.recorder import record_profile

    profile = record_profile(mlp(mesh, dim=64, layers=4, activation_checkpointing="selective"),
                             warmup_steps=1, steps=1, repeats=2)
    recomputes = {fqn for fqn, m in profile.modules.items() if m.recompute_ms > 0}
    assert recomputes == {"blocks.1", "blocks.3"}
    for fqn in recomputes:
        m = profile.modules[fqn]
        assert m.needs_parameters_in_backward and m.recompute_ms < m.bwd_ms
        # recomputed: the outputs of norm and fc1 (batch 8, fp32). Not fc2's: torch.utils.checkpoint stops once
        # every tensor backward needs is back (early stop, on by default, as in the user's step), inside fc2,
        # which saves its input and whose output no backward formula reads ([Note: The recompute stops early])
        assert m.recompute_activation_bytes == 8 * (64 + 4 * 64) * 4
        # kept from forward: only the block's input, where a plain block keeps its saved tensors
        assert m.activation_bytes == 8 * 64 * 4 < profile.modules["blocks.0"].activation_bytes
    plain = record_profile(mlp(mesh, dim=64, layers=4), warmup_steps=1, steps=1, repeats=2)
    assert all(m.recompute_ms == 0 == m.recompute_activation_bytes for m in plain.modules.values())
    written = {name: json.loads(p.to_json())["modules"] for name, p in (("plain", plain), ("ac", profile))}
    assert not any("recompute_ms" in m for m in written["plain"])  # the file release 0.1.0 wrote
    assert {m["fqn"] for m in written["ac"] if "recompute_ms" in m and "recompute_activation_bytes" in m} == recomputes


def test_the_recorder_runs_under_op_level_selective_checkpointing(mesh):
    """torchtitan's op-level selective checkpointing (``torch.utils.checkpoint`` with
    ``create_selective_checkpoint_contexts``: its debug model's default) replays the ops it saved in the
    recomputation and raises on any op it did not see in the forward; the recorder's memory marks, made during the
    recomputation, enter outside the dispatcher (``torch_private.profiler_mark``) and so are no such op."""
    import functools

    import torch
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from runtime.recording.recorder import record_profile

    def policy(ctx, op, *args, **kwargs):  # torchtitan's shape: keep the matmuls' outputs, recompute the rest
        return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) \
            else CheckpointPolicy.PREFER_RECOMPUTE

    workload = mlp(mesh, dim=64, layers=4)
    for block in workload.model.blocks:  # after fully_shard, inside the FSDP module: as apply_activation_checkpointing
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False,
                                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    profile = record_profile(workload, warmup_steps=1, steps=1, repeats=2)
    assert {fqn for fqn, m in profile.modules.items() if m.recompute_ms > 0} == {f"blocks.{i}" for i in range(4)}
