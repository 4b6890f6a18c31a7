"""Gradient accumulation: the FSDP2 settings of each microbatch of a step.

With ``[workload] microbatches = N`` a training step runs N forward and
backward passes before ``optimizer.step()``. Only the last microbatch reduces
gradients (``set_requires_gradient_sync``: the others accumulate unsharded
gradients without communication, FSDP1's ``no_sync``). Whether the
microbatches before the last reshard their parameters after backward is the
plan's ``reshard_after_backward`` (``set_reshard_after_backward``: ``False``
keeps them unsharded until the next forward, saving its all-gathers at the
cost of memory); the last always reshards, so the optimizer steps on sharded
parameters and the next step starts as FSDP2's default does.

:func:`runtime.apply.apply_plan` records the plan's choice per root module;
:func:`prepare_microbatch` reads it. A training loop of one's own calls
``prepare_microbatch(model, i, n)`` before each microbatch's forward.
"""

from __future__ import annotations

import weakref

from torch import nn

from planner.artifacts.plan import Plan

_RESHARD_AFTER_BACKWARD: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def set_accumulation(model: nn.Module, reshard_after_backward: bool) -> None:
    """Record the plan's ``reshard_after_backward`` for the microbatches before the last (``apply_plan`` calls it)."""
    _RESHARD_AFTER_BACKWARD[model] = bool(reshard_after_backward)


def reshard_after_backward(model: nn.Module) -> bool:
    """What :func:`set_accumulation` recorded for ``model``; ``True`` (FSDP2's default) if nothing was."""
    return _RESHARD_AFTER_BACKWARD.get(model, True)


def prepare_microbatch(model: nn.Module, index: int, microbatches: int) -> None:
    """Set gradient sync and resharding on the root FSDP ``model`` (recursively) for microbatch ``index``.

    Args:
        model: the root FSDP module.
        index: ``0 <= index < microbatches``.
        microbatches: forward/backward passes per optimizer step (1: an
            ordinary step, nothing is set).

    Raises:
        ValueError: ``index`` out of range.
    """
    if not 0 <= index < microbatches:
        raise ValueError(f"microbatch index {index} is outside 0..{microbatches - 1}")
    if microbatches == 1:
        return
    last = index == microbatches - 1
    model.set_requires_gradient_sync(last)
    set_microbatch_resharding(model, last)


def set_microbatch_resharding(model: nn.Module, last: bool) -> None:
    """Reshard after this microbatch's backward as the plan says, and always after the step's last one."""
    model.set_reshard_after_backward(last or reshard_after_backward(model))


def holds_between_microbatches(plan: Plan) -> bool:
    """Whether ``plan`` keeps parameters unsharded between microbatches (``prepare_microbatch`` then applies it)."""
    return plan.reshard_after_backward is False
