"""The workload contract: what a study's factory returns on every rank.

A study names a factory ``"package.module:function"``; every rank calls
``factory(mesh, **kwargs)`` and gets a :class:`Workload` whose ``model`` is
already wrapped with ``fully_shard`` (per block, then the root).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from planner.artifacts.json_types import JsonObject
from planner.errors import WorkloadError
from runtime.accumulation import prepare_microbatch
from runtime.ranks.torch_private import unsharded_shapes


@dataclass
class Workload:
    """One training setup.

    Attributes:
        model: the root module, wrapped with ``fully_shard`` (an ``FSDPModule``).
        optimizer: built over ``model.parameters()`` (the sharded DTensors).
        make_batch: ``make_batch(step: int)`` returns the inputs of that step;
            the same step gives the same batch, so plans can be compared bitwise.
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss tensor.
        microbatches: forward/backward passes per optimizer step (gradient
            accumulation, ``[workload] microbatches``): step ``s`` runs
            microbatch ``i`` on ``make_batch(s * microbatches + i)`` and
            backpropagates its loss divided by ``microbatches``
            (:mod:`runtime.accumulation` sets FSDP2 for each).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    microbatches: int = 1


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


def build_workload(spec: str, mesh: Any, kwargs: JsonObject, microbatches: int = 1) -> Workload:
    """Call the factory and check what it returns.

    Args:
        microbatches: set on the workload (``[workload] microbatches``), unless 1.

    Raises:
        WorkloadError: the factory raises, or returns something that is not a
            :class:`Workload` with a ``fully_shard``-wrapped model; or
            ``microbatches`` < 1.
    """
    if not isinstance(microbatches, int) or microbatches < 1:
        raise WorkloadError(
            f"microbatches must be an integer >= 1, found {microbatches!r}; fix [workload] microbatches"
        )
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
    if microbatches != 1:
        workload.microbatches = microbatches
    return workload


def build_study_workload(table: Any, mesh: Any) -> Workload:
    """:func:`build_workload` from a study's ``[workload]`` table (``planner.artifacts.config.WorkloadTable``).

    Raises:
        WorkloadError: as :func:`build_workload`.
    """
    return build_workload(table.factory, mesh, table.kwargs, table.microbatches)


def fsdp_modules(model: nn.Module) -> list[tuple[str, FSDPModule]]:
    """``(fqn, module)`` of every FSDP module under ``model``, in ``named_modules`` order."""
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FSDPModule)]


def parameter_rows(modules: list[tuple[str, nn.Module]]) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per FSDP module, ``(dim-0 size, bytes per dim-0 row)`` of each parameter it manages itself, unsharded: what
    FSDP2 shards and pads (``FSDPParam._init_sharded_param``), a DTensor's global shape, or under FSDP + TP its
    tensor-parallel local shape (``torch_private.unsharded_shapes``).

    Args:
        modules: :func:`fsdp_modules` of the root.
    """
    def rows(p: nn.Parameter, shapes: dict[int, torch.Size]) -> tuple[int, int]:
        shape = shapes.get(id(p), p.shape)
        dim0 = shape[0] if len(shape) else 1
        return int(dim0), int(shape.numel() // max(1, dim0) * p.element_size())

    out = {}
    for fqn, m in modules:
        shapes = unsharded_shapes(m) if isinstance(m, FSDPModule) else {}
        out[fqn] = tuple(rows(p, shapes) for p in own_parameters(modules, fqn))
    return out


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


def forward_backward(workload: Workload, step: int) -> torch.Tensor:
    """Step ``step``'s forward and backward passes, every microbatch; returns the (detached) loss.

    One microbatch: ``loss_fn(model, make_batch(step))``, backpropagated. With
    N > 1, microbatch ``i`` runs on ``make_batch(step * N + i)`` after
    :func:`runtime.accumulation.prepare_microbatch` (only the last reduces
    gradients), backpropagates its loss / N, and the mean loss is returned.
    """
    n, model = workload.microbatches, workload.model
    if n == 1:
        loss = workload.loss_fn(model, workload.make_batch(step))
        loss.backward()
        return loss.detach()
    total = None
    for i in range(n):
        prepare_microbatch(model, i, n)
        loss = workload.loss_fn(model, workload.make_batch(step * n + i)) / n
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


def train_step(workload: Workload, step: int) -> torch.Tensor:
    """One optimizer step: ``zero_grad``, :func:`forward_backward`, ``optimizer.step()``; the (detached) loss."""
    workload.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(workload, step)
    workload.optimizer.step()
    return loss
