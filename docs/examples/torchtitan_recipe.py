"""torchtitan's own ``Trainer`` with in-loop prefetch tuning (``runtime.adapters.torchtitan.TunedTrainer``).

    pip install 'prefetch-planner[torchtitan]'
    torchrun --nproc-per-node 8 docs/examples/torchtitan_recipe.py --module llama3 --config llama3_8b
    torchrun --nproc-per-node 2 docs/examples/torchtitan_recipe.py --debug-model --quick   # its debug model
    torchrun --nproc-per-node 2 docs/examples/torchtitan_recipe.py --cpu --quick           # no GPU: gloo
    torchrun --nproc-per-node 4 docs/examples/torchtitan_recipe.py --cpu --quick --tensor-parallel 2 --steps 60

Every argument but ``--cpu``, ``--debug-model``, ``--tensor-parallel``, ``--steps``, ``--study``, ``--storage`` and
``--quick`` is torchtitan's own
(``--module``, ``--config``, ``--training.steps``, ...). The configuration torchtitan parses becomes a
``TunedTrainer.Config`` (``runtime.adapters.torchtitan.tuned``), whose trainer builds the tuner on the FSDP2 root
once ``parallelize`` and the optimizer are done, and makes each ``train_step`` one ``tuner.step()``.

``--debug-model`` trains torchtitan's ``llama3_debugmodel`` (6 layers, dim 256), every rank a data-parallel shard (with
``--tensor-parallel N``, FSDP over the world divided by N and tensor parallelism within groups of N), on a
character tokenizer and text it writes to a temporary folder (the debug model's own assets ship only in torchtitan's
source checkout), at ``seq_len`` 64. ``--cpu`` does so on CPU ranks with gloo: torchtitan 0.3 assumes an
accelerator in five places, which :func:`cpu_shims` replaces before the trainer is built; none of them changes what
FSDP2 does:

- the device: ``tools.utils.device_type`` falls back to ``"cuda"``; it is ``"cpu"``, with a device module that
  reports no memory statistics (its metrics' memory monitor reads them);
- attention: FlexAttention has no CPU backward, so the compiled ``flex_attention`` becomes the same masked
  attention, dense (``create_mask`` of the block mask's ``mask_mod``, then ``scaled_dot_product_attention``), and
  the compiled ``create_block_mask`` the eager one (as torchtitan does where inductor is unavailable);
- the MoE expert-parallel kernels are Triton's, imported with the models' common code: stubs that raise if called
  (a dense Llama never calls them);
- gloo has no ``PREMUL_SUM``: FSDP2 reduces with a plain sum (``set_force_sum_reduction_for_comms``; torchtitan
  sets the divide factor to 1, so the gradients are the same);
- ``torch.distributed.set_timeout`` is newer than torch 2.13: torchtitan's post-first-step timeout change is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import types

import torch

# The tuner's stages shortened (--quick): what the plain-loop example's --quick uses.
QUICK = {"sim_trials": 40, "measured_trials": 2, "min_rounds": 2, "max_rounds": 4, "confirm_min_rounds": 6,
         "confirm_max_rounds": 6, "warmup_steps": 1, "steps": 2, "profile_repeats": 1}
# The MoE expert-parallel kernels torchtitan 0.3 imports from Triton with its models' common code.
TRITON_KERNELS = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                  "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                  "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def cpu_shims() -> None:
    """Let torchtitan 0.3 train on CPU ranks with gloo (the module docstring lists each shim). Call it before
    anything imports torchtitan."""
    import torch._utils
    cpu = types.SimpleNamespace(**{n: getattr(torch.cpu, n) for n in dir(torch.cpu) if not n.startswith("_")})
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.current_device = lambda: 0
    cpu.device_count = lambda: 1
    cpu.set_device = lambda device: None
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.memory_stats = lambda device=None: {}
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: cpu

    kernels = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
    for name in TRITON_KERNELS:
        def unavailable(*args, _name=name, **kwargs):
            raise RuntimeError(f"{_name} is a Triton kernel (MoE expert parallelism); it does not run on CPU")
        setattr(kernels, name, unavailable)
    sys.modules[kernels.__name__] = kernels

    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import AuxOutput, create_block_mask, create_mask
    from torchtitan.models.common import attention

    def dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                             return_aux=None, kernel_options=None):
        if score_mod is not None or (return_aux is not None and (return_aux.lse or return_aux.max_scores)):
            raise NotImplementedError("the CPU shim of flex_attention takes a block mask only")
        mask = None if block_mask is None else create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2],
                                                           k.shape[-2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), AuxOutput()

    attention.FlexAttention._compiled_flex_attn = staticmethod(dense_flex_attention)
    attention._compiled_create_block_mask = create_block_mask

    import torchtitan.distributed.utils as dist_utils
    if not hasattr(torch.distributed, "set_timeout"):
        dist_utils.set_pg_timeouts = lambda *args, **kwargs: None


def write_debug_assets(folder: str) -> None:
    """A character tokenizer (``tokenizer.json``, ``tokenizer_config.json``) and 2,000 lines of seeded text
    (``data/train.json``) in ``folder``: what ``--debug-model`` trains on."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    for special in ("<unk>", "<s>", "</s>"):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True}, f)
    rng = random.Random(0)
    with open(os.path.join(folder, "data", "train.json"), "w") as f:
        for _ in range(2000):
            f.write(json.dumps({"text": "".join(rng.choice("abcdefghij klmnop") for _ in range(200))}) + "\n")


def debug_config(assets: str, steps: int, tensor_parallel: int = 1):
    """torchtitan's ``llama3_debugmodel`` configuration at a small size: every rank a data-parallel shard (with
    ``tensor_parallel`` > 1, FSDP over the world divided by it, each block's attention and MLP tensor-parallel over
    groups of ``tensor_parallel`` consecutive ranks, torchtitan's 2-D layout), ``seq_len`` 64, local batch 2,
    ``steps`` steps, seed 0, on :func:`write_debug_assets`'s ``assets``; no checkpoint, validation or metric logs."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    config = llama3_debugmodel()
    config.hf_assets_path = assets
    config.dump_folder = os.path.join(assets, "outputs")
    config.dataloader.dataset_path = os.path.join(assets, "data")
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 64, 2, steps
    config.training.disable_cuda_graphs = True
    config.parallelism.data_parallel_shard_degree = -1  # the world, or what tensor parallelism leaves of it
    config.parallelism.tensor_parallel_degree = tensor_parallel
    config.parallelism.spmd_backend = "partial_dtensor"  # plain FSDP2 parameters (no DTensor on the data axis)
    config.checkpoint.enable = False
    config.validator.enable = False
    config.metrics.log_freq = 10**6
    config.debug.seed = 0  # the same initial weights in every launch
    return config


def force_sum_reduction(trainer) -> None:
    """gloo has no ``PREMUL_SUM``: every FSDP module of ``trainer`` reduces with a plain sum."""
    from torch.distributed.fsdp import FSDPModule
    for module in trainer.model_parts[0].modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU ranks with gloo (implies --debug-model)")
    parser.add_argument("--debug-model", action="store_true", help="torchtitan's llama3 debug model, seq_len 64")
    parser.add_argument("--steps", type=int, default=200, help="training steps with --debug-model")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="with --debug-model: torchtitan's tensor_parallel_degree (FSDP over the other ranks)")
    parser.add_argument("--quick", action="store_true", help="the tuner's stages shortened")
    parser.add_argument("--study", default="torchtitan", help="the study's name")
    parser.add_argument("--storage", default="sqlite:///tuning.db", help="the study's database (SQLAlchemy URL)")
    options, torchtitan_args = parser.parse_known_args()
    keys = QUICK if options.quick else {}
    if options.cpu:
        cpu_shims()
    from runtime.adapters.torchtitan import tuned
    if options.cpu or options.debug_model:
        assets = tempfile.mkdtemp(prefix="torchtitan-debug-")
        write_debug_assets(assets)
        config = debug_config(assets, options.steps, options.tensor_parallel)
    else:
        from torchtitan.config import ConfigManager
        config = ConfigManager().parse_args(torchtitan_args)
    trainer = tuned(config, study=options.study, storage=options.storage, keys=keys).build()
    if options.cpu:
        force_sum_reduction(trainer)
    try:
        trainer.train()
    finally:
        trainer.close()
    print(f"rank {torch.distributed.get_rank()}: phase {trainer.tuner.phase}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
