"""Out of memory around the tuner: the recovery when a plan it chose runs out of memory anyway (the in-loop tuner),
and after a step that raised on every rank in step (the tune job's round goes on: ``runtime.measuring.round``).

Prevent first: without a ``memory_budget``, the tuner's budget on a CUDA device is what the tightest rank can still
reach less a margin (:mod:`runtime.ranks.budget`, as ``tune``'s). Then recover: an out-of-memory error in the
tuner's own work (an isolated pass between steps) or in a user's step that ran a candidate is the tuner's doing;
FSDP2's iteration state is reset (``FSDPModule.reset_iter_state``: in-flight collectives waited on, every parameter
group resharded, the failed iteration's gradient reductions discarded), the partial gradients set to ``None`` and
the CUDA cache emptied, so the next step starts clean. An out-of-memory error under FSDP2's default is the job's
own and is never caught.
"""

from __future__ import annotations

import torch
from torch import nn

# The CPU allocator's words for an allocation it could not make (c10's DefaultCPUAllocator); on CUDA the error is
# torch.OutOfMemoryError.
_CPU_OUT_OF_MEMORY = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation the device could not make (``torch.OutOfMemoryError``, or the CPU
    allocator's ``RuntimeError``)."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and any(words in str(e) for words in _CPU_OUT_OF_MEMORY)


def recoverable(model: nn.Module, e: BaseException) -> bool:
    """Whether ``e`` is out of memory and this torch's FSDP2 can bring ``model`` back to a clean iteration
    (``FSDPModule.reset_iter_state``); where it cannot, the error propagates as any other."""
    return is_out_of_memory(e) and callable(getattr(model, "reset_iter_state", None))


def recover(model: nn.Module) -> None:
    """After an out-of-memory error inside a forward, a backward or the tuner's pass: FSDP2's iteration state reset
    on the root (``FSDPModule.reset_iter_state``), every gradient set to ``None`` (the failed step's partial
    sums), and the CUDA cache emptied. Call it only where :func:`recoverable` holds."""
    model.reset_iter_state()
    model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
