"""Benchmark: the change of FSDP2's peak between two world sizes, predicted, against a published table.

    python -m bench.published_memory [--json out.json]

The source: torchtitan's H100 benchmarks (``benchmarks/llama3_h100_202412_torchtitan.md``, torchtitan 9dec370,
torch 1963fc8, December 2024): Llama 3.1 8B, 1-D FSDP (FSDP2), local batch size 2, selective activation
checkpointing, bf16 parameters with fp32 reduction (torchtitan's default ``mixed_precision_param = "bfloat16"``),
AdamW; peak memory 82.4 GiB on 8 GPUs (Table 1) and 67.0 GiB on 128 GPUs (Table 3), "FSDP" rows. torchtitan logs
the allocator's peak *reserved* memory (``torch.cuda.max_memory_reserved``).

The model is built on the meta device (``transformers``' ``LlamaForCausalLM`` at Llama 3.1 8B's shape: no memory
is allocated) and turned into a profile of FSDP2's default at 8 ranks: per FSDP module (each decoder layer, the
root with the embedding, the final norm and the output), its parameters' rows sharded in fp32 (the shard and its
gradient), all-gathered in bf16, AdamW's two fp32 states per sharded element. The activations are left at zero:
at the same local batch they are the same at every world size, so they cancel in the change of peak (and the
8-rank peak itself is not predicted). That profile is re-sharded for 128 ranks (``planner.simulation.resharding``)
and FSDP2's default simulated on both; the predicted change of peak is compared with the published change. The
source reports reserved memory; the simulator predicts allocated bytes. Like with like: the caching allocator
keeps the sharded gradients' blocks reserved across steps, so the reserved peak holds every sharded byte (16 per
parameter: fp32 shard and gradient, AdamW's two states); that reading is printed beside the allocated one.
Target: within 10% of the published change.
"""

from __future__ import annotations

import json

import click

SOURCE = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3 (FSDP rows): Llama 3.1 8B, "
          "local batch 2, selective AC, bf16/fp32 mixed precision, AdamW; peak reserved memory")
PUBLISHED_GIB = {8: 82.4, 128: 67.0}
LLAMA_3_1_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


def meta_profile(world_size: int):
    """FSDP2's default on Llama 3.1 8B at ``world_size`` ranks as a profile, built from the meta-device model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from planner.artifacts.fingerprint import Fingerprint
    from planner.artifacts.profile import ModuleProfile, Profile
    from planner.simulation.resharding import shard_bytes

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_1_8B))
    layers = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    owned = {fqn: list(model.get_submodule(fqn).parameters()) for fqn in layers}
    inside = {id(p) for params in owned.values() for p in params}
    owned[""] = [p for p in model.parameters() if id(p) not in inside]
    modules, numels = {}, {}
    for fqn in ["", *layers]:
        rows = tuple((p.shape[0], p[0].numel() * 4) for p in owned[fqn])  # fp32 shard rows
        numel = sum(p.numel() for p in owned[fqn])
        m = ModuleProfile(fqn, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, unsharded_bytes=2 * numel, sharded_bytes=0,
                          grad_bytes=2 * numel, activation_bytes=0, reshard_after_forward=bool(fqn),
                          parameter_rows=rows)
        modules[fqn] = ModuleProfile(**{**m.__dict__, "sharded_bytes": shard_bytes(m, world_size)})
        numels[fqn] = numel
    fqns = ("", *layers)
    shard = sum(m.sharded_bytes for m in modules.values())
    fingerprint = Fingerprint(fqns, tuple(numels[f] for f in fqns), tuple(4 * numels[f] for f in fqns), world_size,
                              "cuda", ("torch.float32",), torch.__version__)
    return Profile(fingerprint, fqns, (*layers, ""), {f: modules[f] for f in fqns}, optimizer_ms=0.0,
                   optimizer_state_bytes=2 * shard), sum(numels.values())


def compare() -> dict:
    """The predicted and published peaks and their changes from 8 to 128 ranks."""
    from planner.artifacts.plan import Plan
    from planner.simulation.resharding import reshard
    from planner.simulation.simulator import SimParams, Simulator

    at8, parameters = meta_profile(8)
    at128 = reshard(at8, 128, 128)
    peak = {n: Simulator(p, SimParams()).run(Plan.default(p)).peak_bytes / 2**30 for n, p in ((8, at8), (128, at128))}
    # The caching allocator keeps the blocks of the sharded gradients reserved after zero_grad frees them: a
    # reserved peak holds every sharded byte (the fp32 shard, its gradient, AdamW's two states) whether or not the
    # allocated peak comes before the gradients exist.
    held = {n: (2 * sum(m.sharded_bytes for m in p.modules.values()) + p.optimizer_state_bytes) / 2**30
            for n, p in ((8, at8), (128, at128))}
    predicted, published = peak[128] - peak[8], PUBLISHED_GIB[128] - PUBLISHED_GIB[8]
    reserved = held[128] - held[8]
    return {"source": SOURCE, "parameters": parameters, "predicted_gib": peak, "published_gib": PUBLISHED_GIB,
            "predicted_change_gib": predicted, "published_change_gib": published,
            "error_of_change_pct": 100 * (predicted - published) / abs(published),
            "reserved_change_gib": reserved, "reserved_error_pct": 100 * (reserved - published) / abs(published)}


@click.command()
@click.option("--json", "json_out", help="Also write the figures to this JSON file.")
def main(json_out) -> None:
    """Print the predicted and published change of FSDP2's peak, 8 to 128 ranks."""
    r = compare()
    click.echo(f"source     {r['source']}")
    click.echo(f"model      Llama 3.1 8B on the meta device: {r['parameters'] / 1e9:.3f} B parameters")
    click.echo(f"published  {r['published_gib'][8]:.1f} GiB at 8 ranks, {r['published_gib'][128]:.1f} GiB at 128: "
               f"change {r['published_change_gib']:+.2f} GiB (reserved)")
    click.echo(f"predicted  allocated peak: change {r['predicted_change_gib']:+.2f} GiB (activations cancel): "
               f"{r['error_of_change_pct']:+.1f}% of the published change")
    click.echo(f"           reserved (every sharded byte held across the step): change {r['reserved_change_gib']:+.2f} "
               f"GiB: {r['reserved_error_pct']:+.1f}% of the published change")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
