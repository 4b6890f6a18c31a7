"""Any plan leaves the training loss bitwise identical to FSDP2's default."""

from __future__ import annotations

import json

import pytest

from search_spaces import SPACES

LLAMA = "runtime.reference_workloads:llama"
SMALL_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
               "vocab_size": 128, "seq_len": 16}
WORKLOADS = {
    "mlp": ("runtime.reference_workloads:mlp", {"dim": 64, "layers": 4}),
    "llama": (LLAMA, SMALL_LLAMA),
    # an FSDP module backward reads nothing of
    "llama-embedding": (LLAMA, {**SMALL_LLAMA, "num_hidden_layers": 2, "shard_embedding": True}),
    # every block recomputes its forward in backward
    "llama-ac-full": (LLAMA, {**SMALL_LLAMA, "activation_checkpointing": "full"}),
    # every other block recomputes, drawing its dropout mask again
    "mlp-ac-selective": (
        "runtime.reference_workloads:mlp",
        {"dim": 64, "layers": 4, "dropout": 0.1, "activation_checkpointing": "selective"},
    ),
    "gpt2": (
        "runtime.reference_workloads:gpt2",
        {"n_embd": 64, "n_layer": 3, "n_head": 4, "vocab_size": 128, "seq_len": 16},
    ),
    # bf16 all-gathers and compute, fp32 reduce-scatters (MixedPrecisionPolicy), as nearly every FSDP2 job runs
    "llama-bf16": (LLAMA, {**SMALL_LLAMA, "mixed_precision": "bf16"}),
    "mlp-bf16": ("runtime.reference_workloads:mlp", {"dim": 64, "layers": 4, "mixed_precision": "bf16"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_losses_bitwise_identical_across_plans(ranks, tmp_path, workload):
    factory, kwargs = WORKLOADS[workload]
    out = tmp_path / "losses.json"
    ranks("losses.py", factory, json.dumps(kwargs), "3", str(out))
    losses = json.loads(out.read_text())
    default = losses.pop("default")
    assert len(default) == 2 and all(len(r) == 3 for r in default)
    assert len(set(default[0])) == 3  # the loss changes from step to step: training happened
    for name, got in losses.items():
        assert got == default, f"plan {name!r} changed the loss: {got} vs {default}"


@pytest.mark.slow
@pytest.mark.parametrize("workload, examples, microbatches", [("mlp", 60, 1), ("llama", 15, 1), ("mlp", 30, 3),
                                                               ("mlp-bf16", 30, 2), ("llama-bf16", 10, 1),
                                                               ("llama-embedding", 10, 2), ("llama-ac-full", 10, 1),
                                                               ("mlp-ac-selective", 20, 2)])
def test_random_plans_keep_the_loss_bitwise(ranks, tmp_path, workload, examples, microbatches):
    """Hypothesis: plans drawn from every search space (and the other knobs) leave 3 steps' losses bitwise equal.

    With gradient accumulation (microbatches > 1) the plans also draw
    ``reshard_after_backward`` for the microbatches before the last.
    """
    factory, kwargs = WORKLOADS[workload]
    out = tmp_path / "property.json"
    ranks("property.py", factory, json.dumps(kwargs), "3", str(examples), str(out), str(microbatches))
    result = json.loads(out.read_text())
    assert result["failure"] is None, result["failure"]
    assert result["examples"] >= examples
    assert set(result["spaces"]) == set(SPACES)  # every search space, assign included
    assert result["post_optim_event"] > 0  # the post-optimizer event's hook, drawn (a CPU device hands no event)
    if microbatches > 1:
        assert result["no_reshard_after_backward"] > 0  # parameters kept unsharded between microbatches, drawn
    if workload == "llama-embedding":
        assert result["no_unshard_in_backward"] > 0  # the embedding's backward all-gather skipped, drawn


@pytest.mark.slow
@pytest.mark.parametrize("workload, layout", [("mlp", [2, 2]), ("mlp-bf16", [2, 2]),
                                              ("llama", {"tensor_parallel": 2})])
def test_random_plans_keep_the_loss_bitwise_on_4_ranks(tmp_path, workload, layout):
    """The same property on 4 ranks, 2 microbatches a step: sharded as HSDP ``[2, 2]`` (``[launch] mesh``: the
    reduce-scatter within a shard group, then the all-reduce across the replicas, in fp32 under the bf16 policy),
    and as FSDP + TP, dp 2 x tp 2 (``[launch] tensor_parallel``: each block's attention and MLP split over the TP
    ranks, FSDP over the dp ranks); the recorder records the layout."""
    from tests.multirank import run_ranks

    factory, kwargs = WORKLOADS[workload]
    out = tmp_path / "property.json"
    run_ranks("property.py", factory, json.dumps(kwargs), "3", "16", str(out), "2", json.dumps(layout), nproc=4,
              timeout=900)
    result = json.loads(out.read_text())
    assert result["failure"] is None, result["failure"]
    assert result["examples"] >= 16 and set(result["spaces"]) == set(SPACES)
    if isinstance(layout, list):
        assert result["mesh"] == layout and result["tensor_parallel"] is None
    else:
        assert result["mesh"] is None and result["tensor_parallel"] == 2
