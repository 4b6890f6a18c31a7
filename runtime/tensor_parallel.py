"""FSDP + TP for the reference workloads: tensor parallelism inside each block over ``mesh["tp"]``, then
``fully_shard`` over ``mesh["dp"]``, the 2-D layout torchtitan's ``parallelize_llama`` builds (``[launch]
tensor_parallel``, :func:`runtime.ranks.rank.init_rank`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

# Which linear layers of a Llama block are split by output features (column-wise: q, k, v and the MLP's gate and up
# projections) and which by input features (row-wise: the attention's and the MLP's output projections, each
# followed by TP's all-reduce): Megatron-LM's split, as torchtitan's ``apply_tp`` and transformers'
# ``LlamaConfig.base_model_tp_plan`` write it.
LLAMA_BLOCK_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def split_mesh(mesh: Any) -> tuple[Any, Any]:
    """``(dp mesh, tp mesh)`` of a ``(dp, tp)`` mesh (dims named ``"dp"`` and ``"tp"``); ``(mesh, None)`` for any
    other mesh (FSDP's 1-D, HSDP's ``(replicate, shard)``)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return mesh["dp"], mesh["tp"]
    return mesh, None


def data_parallel_rank(mesh: Any) -> int:
    """The rank whose batch this rank trains: its global rank, or under FSDP + TP its dp rank (the TP ranks of one
    dp rank see the same batch)."""
    dp, tp = split_mesh(mesh)
    return mesh.get_rank() if tp is None else dp.get_local_rank()


def parallelize_blocks(blocks: Iterable[nn.Module], tp_mesh: Any, plan: dict[str, str]) -> None:
    """Tensor parallelism on each of ``blocks`` over ``tp_mesh``: ``plan`` maps a submodule's FQN within the block
    to ``"colwise"`` or ``"rowwise"`` (``ColwiseParallel`` / ``RowwiseParallel``, local outputs: attention sees its
    own heads, the MLP its own slice of the hidden features). The parameters become DTensors on ``tp_mesh``,
    which ``fully_shard`` then shards over the dp mesh."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in blocks:
        parallelize_module(block, tp_mesh, {fqn: styles[style]() for fqn, style in plan.items()})
