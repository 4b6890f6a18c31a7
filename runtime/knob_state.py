"""Each knob's value as FSDP2 acts on it, read on a live model, and what blocks a knob from applying.

``runtime.apply_plan`` reads a knob before calling its setter and skips a setter whose value is already what FSDP2
acts on; ``runtime.current_plan`` reads a plan back from the same readers. The readers are the functions of
``runtime.ranks.torch_private`` named by ``Knob.getter`` (``planner.artifacts.knobs``), or, for the knobs whose
value lives in ``runtime``'s own wrapper of the setter, :data:`WRAPPER_GETTERS`. A reader raises an
``AttributeError`` where the state cannot be read (a torch without it, parameter groups that disagree, a custom
comm): the knob is then *unknown*.

[Note: What blocks a knob]
Two knobs cannot apply where the user replaced FSDP2's comms (:data:`BLOCKERS`):
- ``allocate_memory_from_process_group_for_comm`` replaces both comms, and FSDP2 asserts when either is custom
  (``set_custom_all_gather``, ``set_custom_reduce_scatter``) or symmetric memory (``set_symm_mem_for_comm``):
  ``FSDPParamGroup.set_allocate_memory_from_process_group``, torch 2.13 and 2.14.
- ``reduce_scatter_max_input_buffers`` above 1 with the symmetric-memory reduce-scatter, which FSDP2 refuses at its
  lazy init (``FSDPParamGroup._validate_reduce_scatter_max_input_buffers``: the pool reuses one buffer).
Such a knob is left as the model has it, with one log line per model and knob, and the plan goes on applying.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from planner.artifacts.knobs import Knob
from runtime.accumulation import reshard_after_backward
from runtime.post_optim import hands_events
from runtime.ranks import torch_private

WRAPPER_GETTERS: dict[str, Callable[[nn.Module], Any]] = {
    "reshard_after_backward": reshard_after_backward,
    "post_optim_event": hands_events,
}
"""The readers of the knobs whose value lives in ``runtime``'s own wrapper of the setter (``Knob.getter`` is
``None``; ``runtime.apply.ROOT_SETTERS`` writes them): called on the root."""


def module_value(k: Knob, module: nn.Module) -> Any:
    """Knob ``k`` on one FSDP module as FSDP2 acts on it; ``None`` for a module without parameters of its own.

    Raises:
        AttributeError: the state cannot be read (``torch_private.UnknownState``, or a torch without it).
    """
    return getattr(torch_private, k.getter)(module)


def module_values(k: Knob, modules: list[tuple[str, nn.Module]]) -> dict[str, Any] | None:
    """:func:`module_value` on every FSDP module by FQN; ``None`` where it cannot be read on one of them."""
    try:
        return {fqn: module_value(k, m) for fqn, m in modules}
    except AttributeError:
        return None


def plan_value(k: Knob, model: nn.Module, modules: list[tuple[str, nn.Module]]) -> Any:
    """A plan knob's one value: its wrapper's on the root, else the value every module with parameters agrees on
    (FSDP2's default where none has parameters); ``None``: unknown (no state, or modules that disagree)."""
    if k.getter is None:
        return WRAPPER_GETTERS[k.name](model)
    values = module_values(k, modules)
    if values is None:
        return None
    seen = {v for v in values.values() if v is not None}
    if len(seen) > 1:
        return None
    return k.check(seen.pop() if seen else k.default)


def _custom_comm(module: nn.Module, value: Any) -> str | None:
    custom = torch_private.custom_comms(module)
    return f"its comms are not FSDP2's own ({', '.join(custom)})" if custom else None


def _symmetric_memory(module: nn.Module, value: Any) -> str | None:
    if value > 1 and "SymmMemReduceScatter" in torch_private.custom_comms(module):
        return "the symmetric-memory reduce-scatter keeps one input buffer"
    return None


BLOCKERS: dict[str, Callable[[nn.Module, Any], str | None]] = {
    "allocate_memory_from_process_group_for_comm": _custom_comm,
    "reduce_scatter_max_input_buffers": _symmetric_memory,
}
"""Per knob, what on one FSDP module keeps a value from applying, in words; ``None`` where nothing does
([Note: What blocks a knob])."""


def blocked(k: Knob, modules: list[nn.Module], value: Any) -> str | None:
    """Why knob ``k`` cannot take ``value`` on ``modules`` (a root knob: every FSDP module under the root); ``None``
    where it can."""
    blocker = BLOCKERS.get(k.name)
    if blocker is None:
        return None
    return next((why for m in modules if (why := blocker(m, value)) is not None), None)


def unchanged(k: Knob, module: nn.Module, value: Any) -> bool:
    """Whether FSDP2 already acts on ``value`` for knob ``k`` on ``module`` (a module without parameters of its own:
    the setter would change nothing either); ``False`` where the state cannot be read."""
    try:
        current = module_value(k, module)
    except AttributeError:
        return False
    return current is None or current == value
