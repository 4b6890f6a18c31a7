"""The workload contract: what a study's factory returns on every rank.

A study names a factory ``"package.module:function"``; every rank calls
``factory(mesh, **kwargs)`` and gets a :class:`Workload` whose ``model`` is
already wrapped with ``fully_shard`` (per block, then the root).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from planner.errors import WorkloadError


@dataclass
class Workload:
    """One training setup.

    Attributes:
        model: the root module, wrapped with ``fully_shard`` (an ``FSDPModule``).
        optimizer: built over ``model.parameters()`` (the sharded DTensors).
        make_batch: ``make_batch(step: int)`` returns the inputs of that step;
            the same step gives the same batch, so plans can be compared bitwise.
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss tensor.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]


def load_factory(spec: str) -> Callable[..., Workload]:
    """Import ``"package.module:function"``.

    Raises:
        WorkloadError: malformed spec, module not importable, or no such function.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise WorkloadError(f"workload factory must look like 'package.module:function', found {spec!r}")
    module_name, func_name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise WorkloadError(f"cannot import workload module {module_name!r} ({e}); check [workload] factory") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise WorkloadError(f"module {module_name!r} has no function {func_name!r}; check [workload] factory")
    return factory


def build_workload(spec: str, mesh: Any, kwargs: dict[str, Any]) -> Workload:
    """Call the factory and check what it returns.

    Raises:
        WorkloadError: the factory raises, or returns something that is not a
            :class:`Workload` with a ``fully_shard``-wrapped model.
    """
    factory = load_factory(spec)
    try:
        workload = factory(mesh, **kwargs)
    except Exception as e:  # noqa: BLE001 - a user factory may raise anything
        raise WorkloadError(f"workload factory {spec!r} raised {type(e).__name__}: {e}") from None
    if not isinstance(workload, Workload):
        raise WorkloadError(f"workload factory {spec!r} returned {type(workload).__name__}, expected runtime.Workload")
    if not isinstance(workload.model, FSDPModule):
        raise WorkloadError(
            f"workload factory {spec!r} returned a model that is not wrapped with fully_shard; "
            "call fully_shard on each block, then on the root"
        )
    return workload


def fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """``(fqn, module)`` of every FSDP module under ``model``, in ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]


def own_parameters(modules: list[tuple[str, nn.Module]], fqn: str) -> list[nn.Parameter]:
    """Parameters FSDP module ``fqn`` manages itself (not those of nested FSDP modules).

    Args:
        modules: :func:`fsdp_modules` of the root.
        fqn: one of their FQNs.
    """
    nested = {
        id(p) for f, m in modules if f != fqn and (fqn == "" or f.startswith(fqn + ".")) for p in m.parameters()
    }
    return [p for p in dict(modules)[fqn].parameters() if id(p) not in nested]


def train_step(workload: Workload, step: int) -> torch.Tensor:
    """One optimizer step on ``make_batch(step)``; returns the (detached) loss."""
    workload.optimizer.zero_grad(set_to_none=True)
    loss = workload.loss_fn(workload.model, workload.make_batch(step))
    loss.backward()
    workload.optimizer.step()
    return loss.detach()
