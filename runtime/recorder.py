"""The recorder: measure a Profile from real training steps on every rank.

What it records and how (DESIGN.md, Measurement):

- Step ms, optimizer ms (and peak memory on GPU) of FSDP2's default plan:
  median over timed steps after warm-up.
- Pre- and post-forward order of the FSDP modules, with multiplicity, from
  forward hooks.
- Compute ms per module, forward and backward, exclusive of nested FSDP
  modules: every FSDP module is unsharded first, with ``reshard_after_forward``
  off, gradient sync off (``set_requires_gradient_sync(False)``) and
  ``set_reshard_after_backward(False)``, so no collective runs inside the
  window. Forward windows come from forward pre/post hooks; backward windows
  from gradient hooks on each module's outputs (its backward starts) and
  inputs (its backward ends). Time between two marks belongs to the innermost
  open module.
- Activation bytes saved for backward, per module, from
  ``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded, storages
  counted once).
- All-gather ms: ``module.unshard()`` after a barrier, all ranks together;
  reduce-scatter ms: ``reduce_scatter_tensor`` of the gradient's size and dtype.
  Medians of several repeats.
- Per-rank figures are consolidated with ``all_gather_object``: max across
  ranks, per-rank kept.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.profile import ModuleProfile, Profile
from runtime.apply import model_fingerprint
from runtime.measure import device_type_of, synchronize
from runtime.workload import Workload, fsdp_modules, own_parameters, train_step

_TIMED = ("fwd_ms", "bwd_ms", "fwd_pre_ms", "bwd_pre_ms")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _reshard_after_forward(module: nn.Module) -> bool:
    # FSDPParamGroup.post_forward_mesh_info is None when the module keeps its
    # parameters after forward (the root, by FSDPState._lazy_init).
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


def _clear_unsharded_grads(module: nn.Module) -> None:
    # Gradients accumulated with sync off live on the unsharded parameters;
    # drop them so the next synced backward does not reduce them.
    group = module._get_fsdp_state()._fsdp_param_group
    for fsdp_param in group.fsdp_params if group is not None else ():
        fsdp_param.unsharded_accumulated_grad = None
        if hasattr(fsdp_param, "_unsharded_param"):
            fsdp_param._unsharded_param.grad = None


class _ComputeRecorder:
    """Marks forward/backward entry and exit of each FSDP module and attributes time.

    On CPU a mark is ``time.perf_counter()``; on GPU the hooks run ahead of
    the kernels they launch, so a mark is a CUDA event recorded on the current
    stream, turned into seconds (``Event.elapsed_time``) after the run.
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], root: str, device: str = "cpu"):
        self.root = root
        self.cuda = device == "cuda"
        self.marks: list[tuple[Any, str, str]] = []
        self.live: list[str] = []  # forward stack, for activation attribution
        self.act_bytes: dict[str, int] = defaultdict(int)
        self.seen_storages: set[int] = set()
        self.param_storages: set[int] = set()
        self.handles = []
        for fqn, m in modules:
            self.handles.append(m.register_forward_pre_hook(self._pre_hook(fqn), with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post_hook(fqn)))

    def mark(self, kind: str, fqn: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((event, kind, fqn))
        else:
            self.marks.append((time.perf_counter(), kind, fqn))

    def _marks_to_seconds(self) -> None:
        if self.cuda and self.marks:
            torch.cuda.synchronize()
            first = self.marks[0][0]
            self.marks = [(first.elapsed_time(e) / 1e3, kind, fqn) for e, kind, fqn in self.marks]

    def _once(self, kind: str, fqn: str):
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self.mark(kind, fqn)

        return hook

    def _pre_hook(self, fqn: str):
        def hook(module, args, kwargs):
            self.mark("enter", fqn)
            self.live.append(fqn)
            if fqn != self.root:
                end_hook = self._once("bexit", fqn)
                for t in _tensors((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(end_hook)

        return hook

    def _post_hook(self, fqn: str):
        def hook(module, args, output):
            self.mark("exit", fqn)
            self.live.remove(fqn)
            if fqn != self.root:
                start_hook = self._once("benter", fqn)
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(start_hook)

        return hook

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        if self.live and key not in self.seen_storages and key not in self.param_storages:
            self.seen_storages.add(key)
            self.act_bytes[self.live[-1]] += t.untyped_storage().nbytes()
        return t

    def run(self, workload: Workload, step: int) -> None:
        """One forward + backward, marking windows."""
        self.marks.clear()
        self.seen_storages.clear()
        self.act_bytes.clear()
        self.param_storages = {p.untyped_storage().data_ptr() for p in workload.model.parameters()}
        self.mark("enter", self.root)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            loss = workload.loss_fn(workload.model, workload.make_batch(step))
        self.mark("exit", self.root)
        self.mark("enter", self.root)
        loss.backward()
        self.mark("exit", self.root)
        self._marks_to_seconds()

    def attribute(self) -> tuple[dict[str, dict[str, float]], list[str], list[str], dict[str, int]]:
        """Exclusive ms per module and phase, pre-/post-forward order, forward calls."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(_TIMED, 0.0))
        pre_order, post_order = [], []
        calls: dict[str, int] = defaultdict(int)
        stack: list[str] = []
        child_seen: set[str] = set()
        backward = False
        for i, (t, kind, fqn) in enumerate(self.marks):
            if kind in ("enter", "benter"):
                if kind == "enter" and fqn == self.root and i > 0 and not stack:
                    backward = True  # the second root entry opens the backward window
                    child_seen.clear()
                if stack and stack[-1] != fqn:
                    child_seen.add(stack[-1])
                stack.append(fqn)
                if kind == "enter" and not backward and fqn != self.root:
                    pre_order.append(fqn)
                    calls[fqn] += 1
            else:
                if fqn in stack:
                    del stack[len(stack) - 1 - stack[::-1].index(fqn)]
                if kind == "exit" and not backward and fqn != self.root:
                    post_order.append(fqn)
            if stack and i + 1 < len(self.marks):
                dt = (self.marks[i + 1][0] - t) * 1e3
                top = stack[-1]
                phase = "bwd" if backward else "fwd"
                out[top][f"{phase}_ms"] += dt
                if top not in child_seen:
                    out[top][f"{phase}_pre_ms"] += dt
        return dict(out), pre_order, post_order, dict(calls)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def record_profile(workload: Workload, warmup_steps: int = 2, steps: int = 3, repeats: int = 3) -> Profile:
    """Record a :class:`Profile` on every rank (collective: all ranks call it).

    Args:
        workload: this rank's workload; its model must not have run a plan
            other than FSDP2's default.
        warmup_steps: untimed default-plan steps first.
        steps: timed default-plan steps (step ms, optimizer ms).
        repeats: repeats of each compute and communication measurement
            (medians are kept; one extra warm-up repeat is dropped).

    Returns:
        The consolidated profile (the same on every rank). Times in ms,
        sizes in bytes.
    """
    model, optimizer = workload.model, workload.optimizer
    modules = fsdp_modules(model)
    root = modules[0][0]
    device = device_type_of(workload)
    world = dist.get_world_size()
    fingerprint = model_fingerprint(model, world)

    # 1. FSDP2's default plan: step ms, optimizer ms, peak memory.
    for s in range(warmup_steps):
        train_step(workload, s)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_ms, opt_ms = [], []
    for s in range(steps):
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(model, workload.make_batch(s)).backward()
        synchronize(device)
        t1 = time.perf_counter()
        optimizer.step()
        synchronize(device)
        t2 = time.perf_counter()
        step_ms.append((t2 - t0) * 1e3)
        opt_ms.append((t2 - t1) * 1e3)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    raf = {fqn: _reshard_after_forward(m) for fqn, m in modules}

    # 2. Compute with every module unsharded and no communication.
    model.set_reshard_after_forward(False)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    for _, m in modules:
        m.unshard()
    rec = _ComputeRecorder(modules, root, device)
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    try:
        for r in range(repeats + 1):
            rec.run(workload, r)
            times, pre_order, post_order, calls = rec.attribute()
            if r == 0:
                continue
            for fqn, _ in modules:
                for key in _TIMED:
                    samples[fqn][key].append(times.get(fqn, {}).get(key, 0.0))
    finally:
        rec.remove()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        for fqn, m in modules:
            m.set_reshard_after_forward(raf[fqn], recurse=False)
            _clear_unsharded_grads(m)
            m.reshard()
        optimizer.zero_grad(set_to_none=True)

    # 3. Communication in isolation, all ranks together.
    ag_ms: dict[str, float] = {}
    for fqn, m in modules:
        ts = []
        for _ in range(repeats + 1):
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            m.unshard()
            synchronize(device)
            ts.append((time.perf_counter() - t0) * 1e3)
            m.reshard()
        ag_ms[fqn] = statistics.median(ts[1:])
    rs_ms: dict[str, float] = {}
    sharded: dict[str, int] = {}
    for (fqn, m), numel, nbytes in zip(modules, fingerprint.param_numels, fingerprint.param_bytes):
        own = own_parameters(modules, fqn)
        sharded[fqn] = sum(p.to_local().numel() * p.element_size() for p in own)
        dtype = own[0].dtype if own else torch.float32
        padded = -(-numel // world) * world
        inp = torch.zeros(padded, dtype=dtype, device=device)
        out = torch.empty(padded // world, dtype=dtype, device=device)
        ts = []
        for _ in range(repeats + 1):
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            _reduce_scatter(out, inp)
            synchronize(device)
            ts.append((time.perf_counter() - t0) * 1e3)
        rs_ms[fqn] = statistics.median(ts[1:])
    opt_state = sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )

    local = {
        "rank": dist.get_rank(),
        "step_ms": statistics.median(step_ms),
        "optimizer_ms": statistics.median(opt_ms),
        "optimizer_state_bytes": opt_state,
        "peak_bytes": peak,
        "pre_forward_order": pre_order,
        "post_forward_order": post_order,
        "modules": {
            fqn: {
                **{k: statistics.median(samples[fqn][k]) for k in _TIMED},
                "all_gather_ms": ag_ms[fqn],
                "reduce_scatter_ms": rs_ms[fqn],
                "sharded_bytes": sharded[fqn],
                "activation_bytes": rec.act_bytes.get(fqn, 0),
            }
            for fqn, _ in modules
        },
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, local)
    return _consolidate(gathered, fingerprint, raf, calls)


def _consolidate(per_rank: list[dict], fingerprint, raf: dict[str, bool], calls: dict[str, int]) -> Profile:
    """Max across ranks of every figure; orders must agree across ranks."""
    first = per_rank[0]
    for other in per_rank[1:]:
        if other["post_forward_order"] != first["post_forward_order"]:
            raise RuntimeError(f"ranks disagree on the post-forward order: rank 0 {first['post_forward_order']}, "
                               f"rank {other['rank']} {other['post_forward_order']}")
    unsharded = dict(zip(fingerprint.module_fqns, fingerprint.param_bytes))
    modules = {}
    for fqn in fingerprint.module_fqns:
        figures = {k: max(r["modules"][fqn][k] for r in per_rank) for k in first["modules"][fqn]}
        modules[fqn] = ModuleProfile(
            fqn=fqn,
            fwd_ms=figures["fwd_ms"],
            bwd_ms=figures["bwd_ms"],
            fwd_pre_ms=min(figures["fwd_pre_ms"], figures["fwd_ms"]),
            bwd_pre_ms=min(figures["bwd_pre_ms"], figures["bwd_ms"]),
            all_gather_ms=figures["all_gather_ms"],
            reduce_scatter_ms=figures["reduce_scatter_ms"],
            unsharded_bytes=unsharded[fqn],
            sharded_bytes=int(figures["sharded_bytes"]),
            grad_bytes=unsharded[fqn],
            activation_bytes=int(figures["activation_bytes"]),
            reshard_after_forward=raf[fqn],
            calls=max(1, calls.get(fqn, 1)),
        )
    root = fingerprint.module_fqns[0]
    peaks = [r["peak_bytes"] for r in per_rank if r["peak_bytes"] is not None]
    return Profile(
        fingerprint=fingerprint,
        pre_forward_order=(root, *first["pre_forward_order"]),
        post_forward_order=(*first["post_forward_order"], root),
        modules=modules,
        optimizer_ms=max(r["optimizer_ms"] for r in per_rank),
        optimizer_state_bytes=max(r["optimizer_state_bytes"] for r in per_rank),
        measured_step_ms=max(r["step_ms"] for r in per_rank),
        measured_peak_bytes=max(peaks) if peaks else None,
        per_rank=per_rank,
        consolidation="max",
    )


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor) -> None:
    # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in newer torch
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp)
