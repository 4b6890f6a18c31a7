"""Reference workloads: Hugging Face Llama, GPT-2 and Qwen2 from a config, and an MLP stack.

Random weights, no download. Each factory is ``factory(mesh, **kwargs)`` and
applies ``fully_shard`` per block, then to the root, as torchtitan's
``parallelize.py`` does. Sizes default to what makes FSDP2's all-gathers show
in the step time of 2 gloo CPU ranks with one compute thread each (docs/decisions/rule-evidence.md).
How each block is wrapped (the language models take these as ``**wrapping``, the MLP by name):
``activation_checkpointing``: ``"none"``, ``"full"`` or ``"selective"`` (every other block), inside the block
``fully_shard`` wraps, with torchtitan's meaning (:mod:`runtime.activation_checkpointing`);
``mixed_precision``: ``"none"`` or ``"bf16"``, FSDP2's ``MixedPrecisionPolicy`` on every ``fully_shard`` call
(:func:`mp_policy`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from planner.errors import WorkloadError
from runtime.activation_checkpointing import apply_activation_checkpointing
from runtime.tensor_parallel import LLAMA_BLOCK_PLAN, data_parallel_rank, parallelize_blocks, split_mesh
from runtime.workload import Workload


def _transformers(model: str) -> Any:
    """The ``transformers`` package, which the Hugging Face reference workloads build their models with.

    Raises:
        WorkloadError: ``transformers`` is not installed; the message names the extra that installs it.
    """
    try:
        import transformers
    except ImportError as e:
        raise WorkloadError(f"the reference {model} needs transformers: pip install 'prefetch-planner[hf]'") from e
    return transformers


def _batch_fn(vocab_size: int, batch_size: int, seq_len: int, rank: int, device: str = "cpu"):
    def make_batch(step: int) -> torch.Tensor:  # drawn on CPU: the same tokens on every device
        g = torch.Generator().manual_seed(10_000 * step + rank)
        return torch.randint(0, vocab_size, (batch_size, seq_len), generator=g).to(device)

    return make_batch


def _lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch, use_cache=False).loss


def llama(
    mesh: Any,
    hidden_size: int = 1024,
    intermediate_size: int = 2816,
    num_hidden_layers: int = 8,
    num_attention_heads: int = 16,
    vocab_size: int = 8192,
    batch_size: int = 1,
    seq_len: int = 64,
    lr: float = 1e-4,
    seed: int = 0,
    shard_embedding: bool = False,
    **wrapping: str,
) -> Workload:
    """Llama (``transformers.LlamaForCausalLM``) from a config, random weights.

    Each ``model.layers[i]`` is one FSDP module; the root holds embedding,
    final norm and LM head. ``shard_embedding``: the token embedding is an
    FSDP module of its own (as torchtitan wraps it): its backward reads no
    parameter, so ``set_unshard_in_backward(False)`` applies to it. With prefetch set by hand:
    :func:`llama_hand_set`. On a ``(dp, tp)`` mesh (``[launch] tensor_parallel``) each block's attention and MLP
    are tensor-parallel (:data:`runtime.tensor_parallel.LLAMA_BLOCK_PLAN`; ``num_attention_heads`` a multiple of
    the TP degree) and FSDP shards over the dp ranks; the embedding, final norm and LM head stay whole on every TP
    rank.
    """
    transformers = _transformers("Llama")
    config = transformers.LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max(seq_len, 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    first = [model.model.embed_tokens] if shard_embedding else []
    return _sharded_lm(mesh, model, first, model.model.layers, lr, vocab_size, batch_size, seq_len,
                       tp_plan=LLAMA_BLOCK_PLAN, **wrapping)


def llama_hand_set(mesh: Any, forward_prefetch_depth: int = 0, backward_prefetch_depth: int = 0,
                   keep_last_block: bool = False, **llama_kwargs: Any) -> Workload:
    """:func:`llama` (``llama_kwargs``) with prefetch and resharding set by hand after wrapping, as frameworks ship
    them (:func:`hand_set`): the model a user arrives with, for ``prefetch-planner check`` and ``bench.peers``."""
    workload = llama(mesh, **llama_kwargs)
    hand_set(workload.model.model.layers, forward_prefetch_depth, backward_prefetch_depth, keep_last_block)
    return workload


def hand_set(blocks: nn.ModuleList, forward_depth: int = 0, backward_depth: int = 0,
             keep_last_block: bool = False) -> None:
    """Prefetch and resharding set by hand on FSDP-wrapped ``blocks``, as frameworks ship them: block ``i``
    prefetches blocks ``i+1 .. i+forward_depth`` in forward and ``i-1 .. i-backward_depth`` in backward
    (NeMo-Automodel's ``fsdp2_forward_prefetch_depth`` and ``fsdp2_backward_prefetch_depth``; verl's forward depth
    1), and ``keep_last_block`` keeps the last block's parameters after forward, which backward needs first
    (torchtitan's policy). All zero and ``False``: nothing is set (FSDP2's default)."""
    n = len(blocks)
    for i, block in enumerate(blocks):
        if forward_depth:
            block.set_modules_to_forward_prefetch([blocks[j] for j in range(i + 1, min(n, i + 1 + forward_depth))])
        if backward_depth:
            block.set_modules_to_backward_prefetch([blocks[j] for j in range(i - 1, max(-1, i - 1 - backward_depth),
                                                                             -1)])
    if keep_last_block and n:
        blocks[-1].set_reshard_after_forward(False, recurse=False)


def gpt2(
    mesh: Any,
    n_embd: int = 1024,
    n_layer: int = 8,
    n_head: int = 16,
    vocab_size: int = 8192,
    batch_size: int = 1,
    seq_len: int = 64,
    lr: float = 1e-4,
    seed: int = 0,
    **wrapping: str,
) -> Workload:
    """GPT-2 (``transformers.GPT2LMHeadModel``) from a config, random weights.

    Each ``transformer.h[i]`` is one FSDP module; the root holds the
    embeddings, final layer norm and the (tied) LM head.
    """
    transformers = _transformers("GPT-2")
    config = transformers.GPT2Config(
        n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size,
        n_positions=max(seq_len, 128), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    return _sharded_lm(mesh, model, [], model.transformer.h, lr, vocab_size, batch_size, seq_len, **wrapping)


def qwen2(
    mesh: Any,
    hidden_size: int = 1024,
    intermediate_size: int = 2816,
    num_hidden_layers: int = 6,
    num_attention_heads: int = 16,
    num_key_value_heads: int = 4,
    vocab_size: int = 8192,
    batch_size: int = 1,
    seq_len: int = 128,
    lr: float = 1e-4,
    seed: int = 0,
    **wrapping: str,
) -> Workload:
    """Qwen2 (``transformers.Qwen2ForCausalLM``) from a config, random weights: grouped-query attention
    (``num_key_value_heads``) with biased q/k/v projections, so its blocks' parameter and compute shapes differ
    from Llama's. No study is tuned on it: the trace-profile bench's model not tuned on (``bench/qwen2-cpu.toml``).

    Each ``model.layers[i]`` is one FSDP module; the root holds embedding, final norm and LM head.
    """
    transformers = _transformers("Qwen2")
    config = transformers.Qwen2Config(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, vocab_size=vocab_size,
        max_position_embeddings=max(seq_len, 128), tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    return _sharded_lm(mesh, model, [], model.model.layers, lr, vocab_size, batch_size, seq_len, **wrapping)


def mp_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy by name: ``"none"`` (FSDP2's default: no cast) or ``"bf16"``, as nearly every
    FSDP2 job sets it (torchtitan's ``mixed_precision_param = "bfloat16"``): parameters all-gathered and computed in
    bf16, gradients reduced in fp32, the sharded state kept in fp32.

    Raises:
        WorkloadError: another name.
    """
    if mixed_precision == "none":
        return MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise WorkloadError(f"mixed_precision = {mixed_precision!r} is not known; write \"none\" or \"bf16\"")


def _sharded_lm(mesh: Any, model: nn.Module, first: list[nn.Module], blocks: nn.ModuleList, lr: float,
                vocab_size: int, batch_size: int, seq_len: int, activation_checkpointing: str = "none",
                mixed_precision: str = "none", tp_plan: dict[str, str] | None = None) -> Workload:
    """``model`` checkpointed per ``activation_checkpointing``, ``fully_shard`` on each of ``first`` (e.g. the
    token embedding), each block, then the root, under ``mp_policy(mixed_precision)``; AdamW; random token batches
    (one per dp rank) and the LM loss. The language models' factories pass their ``**wrapping`` keys here: these
    two. On a ``(dp, tp)`` mesh the blocks are first made tensor-parallel per ``tp_plan``
    (:func:`runtime.tensor_parallel.parallelize_blocks`) and ``fully_shard`` runs over the dp mesh.

    Raises:
        TypeError: another wrapping key.
        WorkloadError: a ``(dp, tp)`` mesh for a model with no ``tp_plan``.
    """
    policy = mp_policy(mixed_precision)
    dp_mesh, tp_mesh = split_mesh(mesh)
    if tp_mesh is not None:
        if tp_plan is None:
            raise WorkloadError(f"{type(model).__name__} has no tensor-parallel plan here; set [launch] "
                                "tensor_parallel = 1, or use the llama workload")
        parallelize_blocks(blocks, tp_mesh, tp_plan)
    apply_activation_checkpointing(blocks, activation_checkpointing)
    for module in [*first, *blocks]:
        fully_shard(module, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = _batch_fn(vocab_size, batch_size, seq_len, data_parallel_rank(mesh), mesh.device_type)
    return Workload(model, optimizer, batches, _lm_loss)


class _MLPBlock(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))))


class MLPStack(nn.Module):
    """``layers`` pre-norm residual MLP blocks between an input and output projection (``dropout`` after each
    block's second linear layer: a model that draws random numbers in its forward)."""

    def __init__(self, dim: int, layers: int, dropout: float = 0.0):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_MLPBlock(dim, dropout) for _ in range(layers))
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


def mlp(mesh: Any, dim: int = 256, layers: int = 4, batch_size: int = 8, lr: float = 1e-3, seed: int = 0,
        dropout: float = 0.0, activation_checkpointing: str = "none", forward_prefetch_depth: int = 0,
        keep_last_block: bool = False, mixed_precision: str = "none") -> Workload:
    """A small MLP stack (fast; used by the tests); ``dropout`` > 0 draws random numbers in every forward;
    ``forward_prefetch_depth`` and ``keep_last_block`` set by hand after wrapping (:func:`hand_set`)."""
    torch.manual_seed(seed)
    model = MLPStack(dim, layers, dropout)
    apply_activation_checkpointing(model.blocks, activation_checkpointing)
    policy = mp_policy(mixed_precision)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    hand_set(model.blocks, forward_prefetch_depth, keep_last_block=keep_last_block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rank = mesh.get_rank()

    def make_batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10_000 * step + rank)
        return torch.randn(batch_size, dim, generator=g).to(mesh.device_type)

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).pow(2).mean()

    return Workload(model, optimizer, make_batch, loss_fn)
