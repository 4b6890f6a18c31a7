"""A plan's ``post_optim_event``: an event recorded after each optimizer step, handed to FSDP2 for the next step's
first all-gather to wait on.

[Note: Post-optimizer event at run time]
``FSDPModule.set_post_optim_event(event)`` makes the root's pre-forward wait its all-gather streams on ``event``
instead of on the current stream (``FSDPState._root_pre_forward``), once: FSDP2 drops the event after the wait, so
every step needs a new one. An optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``:
global, every optimizer's ``step`` runs it) records one on the current stream right after ``optimizer.step()`` and
hands it to the model. ``apply_plan`` registers or removes the hook, so a training script that applies the plan and
the in-loop tuner, which switches plans through ``apply_plan``, both get it. A CPU device records no event
(``torch.cpu.Stream.record_event`` returns ``None``): nothing is handed, and FSDP2 keeps its wait, a no-op there.
The simulator's rule is [Note: Post-optimizer event] in ``planner.simulation.simulator``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from planner.errors import UnsupportedPlanError
from runtime.ranks.device import device_of
from runtime.ranks.torch_private import TESTED_ADVICE

# model -> its optimizer step post-hook, while its plan sets post_optim_event.
_HOOKS: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()
# Every hook registered, with its model: a hook whose model is gone is removed when the next plan is applied (the
# setter is made for every plan, its call skipped where the value is unchanged), never from inside a hook (the
# optimizer iterates over the hooks while it runs them).
_REGISTERED: list[tuple[weakref.ref, RemovableHandle]] = []


def post_optim_event_setter(model: nn.Module) -> Callable[[bool], None]:
    """The setter of a plan's ``post_optim_event`` on the root FSDP ``model``: ``True`` registers the optimizer step
    post-hook that hands FSDP2 an event after every optimizer step, ``False`` removes it (FSDP2's default).

    Raises:
        UnsupportedPlanError: the running torch has no ``FSDPModule.set_post_optim_event``.
    """
    if not hasattr(model, "set_post_optim_event"):
        raise UnsupportedPlanError(f"the plan sets post_optim_event, but torch {torch.__version__} has no "
                                   f"FSDPModule.set_post_optim_event ({TESTED_ADVICE} or use a plan without it)")
    _remove_orphans()

    def set_post_optim_event(enable: bool) -> None:
        handle = _HOOKS.pop(model, None)
        if handle is not None:
            handle.remove()
        if enable:
            ref = weakref.ref(model)
            _HOOKS[model] = register_optimizer_step_post_hook(_hand_event(ref))
            _REGISTERED.append((ref, _HOOKS[model]))

    return set_post_optim_event


def hands_events(model: nn.Module) -> bool:
    """Whether ``model``'s applied plan sets ``post_optim_event`` (its hook is registered)."""
    return model in _HOOKS


def _remove_orphans() -> None:
    """Remove the hooks whose model is gone (outside any optimizer step)."""
    for ref, handle in list(_REGISTERED):
        if ref() is None:
            handle.remove()
            _REGISTERED.remove((ref, handle))


def _hand_event(model_ref: weakref.ref) -> Callable[[Any, Any, Any], None]:
    """The hook: after an optimizer step, an event on the model's current stream, handed to FSDP2; nothing once the
    model is gone (the next plan applied removes the hook)."""

    def hand_event(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        model = model_ref()
        if model is None:
            return
        event = event_after_step(model)
        if event is not None:
            model.set_post_optim_event(event)

    return hand_event


def event_after_step(model: nn.Module) -> torch.Event | None:
    """An event recorded now on the current stream of ``model``'s device; ``None`` on a CPU device (no events)."""
    where = next(model.parameters()).device
    return device_of(where.type).stream_event(where)
