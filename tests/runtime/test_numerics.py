"""Any plan leaves the training loss bitwise identical to FSDP2's default."""

from __future__ import annotations

import json

import pytest

from search_spaces import SPACES

WORKLOADS = {
    "mlp": ("runtime.reference_workloads:mlp", {"dim": 64, "layers": 4}),
    "llama": ("runtime.reference_workloads:llama", {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                                          "num_attention_heads": 4, "vocab_size": 128, "seq_len": 16}),
    "gpt2": ("runtime.reference_workloads:gpt2", {"n_embd": 64, "n_layer": 3, "n_head": 4, "vocab_size": 128, "seq_len": 16}),
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
@pytest.mark.parametrize("workload, examples", [("mlp", 60), ("llama", 15)])
def test_random_plans_keep_the_loss_bitwise(ranks, tmp_path, workload, examples):
    """Hypothesis: plans drawn from every search space (and the other knobs) leave 3 steps' losses bitwise equal."""
    factory, kwargs = WORKLOADS[workload]
    out = tmp_path / "property.json"
    ranks("property.py", factory, json.dumps(kwargs), "3", str(examples), str(out))
    result = json.loads(out.read_text())
    assert result["failure"] is None, result["failure"]
    assert result["examples"] >= examples
    assert set(result["spaces"]) == set(SPACES)  # every search space, assign included
