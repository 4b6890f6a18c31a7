"""Compute time per FSDP module, forward and backward, exclusive of nested FSDP modules.

The recorder runs this with every module already unsharded and no
communication in the window (``runtime.recording.recorder``).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from planner.artifacts.rank_measurements import COMPUTE_FIELDS
from runtime.ranks import torch_private
from runtime.ranks.device import device_of
from runtime.recording.mark_memory import MarkMemory, backward_peaks, walk_marks
from runtime.workload import Workload, own_parameters

# [Note: Backward temporaries]
# A backward allocates more than the gradients it leaves: the loss's backward holds the gradient of the logits
# (batch x sequence x vocabulary, 500 MiB in the GPU Llama) while the LM head's backward uses it, and a block's
# attention and MLP backward hold theirs. A step's peak can fall there, in the root's backward before the last
# block's, and a simulator without them puts FSDP2's default under its measured peak and prices a last block kept
# unsharded at nothing where it costs one block's unsharded bytes. So the timer reads the bytes alive at each mark and
# the most alive since
# the one before (:mod:`runtime.recording.mark_memory`: on GPU the caching allocator's counters; on CPU a profiled run).
# A module's :attr:`ComputeTimer.backward_peak` is the most bytes alive in its backward before its first nested
# module's, above those alive when its backward started; the recorder takes its gradient there and its recomputed
# activations off it (``ModuleProfile.backward_temp_bytes``), as the simulator allocates those apart. A root's
# gradient comes in two parts: the LM head's before its blocks' backward, the embedding's after (the embedding runs
# first in forward, so last in backward). :attr:`ComputeTimer.root_grad_pre_bytes` reads the first part when the
# first nested module's backward starts; the rest is ``ModuleProfile.backward_post_grad_bytes``. Held whole
# through the blocks' backward, a large embedding's gradient would put the predicted peak high there.

# [Note: The recompute stops early]
# By default ``torch.utils.checkpoint`` stops recomputing once the tensors backward needs are back
# (``set_checkpoint_early_stop(True)``), so the last ops of a block's forward, such as a Llama MLP's down
# projection, never run again. A timer that ran its passes with early stop off would read a checkpointed block's
# backward above the user's. So the recompute runs as the user's does, under the user's setting.

# [Note: The root's saved tensors in two parts]
# The root's own forward saves tensors before its blocks (the embedding: its indices) and after them (the final
# norm, the LM head, the loss: HF's cross-entropy keeps the log-softmax, batch x sequence x vocabulary). Autograd
# runs the latter's nodes first in backward and frees what each saved as it runs, so they are gone before the last
# block's backward. A simulator that held all of the root's activations to the end of its backward over-predicts
# the peak at a checkpointed block's backward, and under-predicts a last block kept unsharded (the measurements:
# docs/decisions/rule-evidence.md). The timer counts the root's saved bytes after its first nested
# module's forward (:attr:`ComputeTimer.root_activation_post_bytes`, ``ModuleProfile.activation_post_bytes``); the
# simulator frees them at the end of the root's backward part before its children's.


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``, a tensor or nested lists, tuples and dicts of them (other values skipped)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_in(v)]
    return []


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind ``t``: a DTensor's local tensor's (under FSDP + TP a TP module's unsharded parameters
    and the tensors its DTensor ops save are DTensors, whose own ``untyped_storage`` is invalid).

    Raises:
        RuntimeError, NotImplementedError: a tensor with no storage (a fake or functional tensor).
    """
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


def first_seen(seen: dict[int, weakref.ref], key: int, t: torch.Tensor) -> bool:
    """Whether ``t``'s storage (data pointer ``key``) is seen for the first time; it is noted as seen.

    A pointer seen before counts again when the storage seen there is gone or was freed (FSDP2's reshard frees a
    module's unsharded parameters in the pass, ``resize_(0)``) and the allocator handed the address out again:
    the count does not depend on where the allocator puts things.
    """
    before = seen.get(key)
    if before is not None and (old := before()) is not None and old.data_ptr() == key:
        return False
    seen[key] = weakref.ref(storage_of(t))
    return True


class ComputeTimer:
    """Marks forward/backward entry and exit of each FSDP module and attributes time to it.

    Forward windows come from forward pre/post hooks; backward windows from
    gradient hooks on each module's outputs (its backward starts) and inputs
    (its backward ends). Time between two marks belongs to the innermost open
    module, so times are exclusive of nested FSDP modules. Activation bytes
    saved for backward are counted per module with
    ``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded,
    storages counted once); the parameters saved for backward are noted
    (:attr:`saved_parameter_storages`): a module none of whose parameters is
    saved (an embedding) needs no all-gather in backward.

    Recompute (activation checkpointing): a forward hook on each direct child of a non-root FSDP module that
    fires inside the backward window means the module recomputes its forward there (``torch.utils.checkpoint``
    re-runs the block's forward after FSDP2's pre-backward hook unsharded it). The module is noted in
    :attr:`recomputing`, and its children's forward time there is its ``recompute_ms`` (a part of its
    ``bwd_ms``; what the block does between its children, a residual add, is left out). The bytes of the
    outputs of its submodules there, at any depth (each storage once, :func:`first_seen`), are
    :attr:`recompute_bytes`: the recomputed activations, which live until the block's gradient compute has used
    them. Functional ops' outputs (an activation function called as a function, a residual add) are not seen:
    an underestimate.
    The recompute runs as the user's does, stopped early ([Note: The recompute stops early]): the child running
    then never returns. Each submodule forward that returns in it marks ``rtick``; one no ``rend`` closes ends at
    its last ``rtick``.

    A mark is ``Device.mark``: on CPU the host clock; on GPU the hooks run ahead of
    the kernels they launch, so a mark is a CUDA event recorded on the current
    stream, turned into seconds (``Event.elapsed_time``) after the run.

    ``run(..., memory=True)`` also reads the bytes alive at each mark and at most since the one before, and sets
    :attr:`backward_peak` ([Note: Backward temporaries]) and :attr:`root_grad_pre_bytes`.

    ``hooks_first``: the timer's module hooks run before FSDP2's (``prepend=True``), so a module's window holds
    FSDP2's work for it: the all-gather in its pre-forward (``FSDPState._pre_forward``) and in its pre-backward
    (``FSDPState._pre_backward``, a hook on the outputs registered in ``_post_forward``), and its post-backward
    (``RegisterPostBackwardFunction``, on the inputs as FSDP2 wraps them). The recorder's passes that hold only
    some modules unsharded need it: the others' all-gathers would else land in their parent's window.
    ``after_backward(fqn)`` then runs when a module's backward ends, after its post-backward.
    """

    def __init__(self, modules: list[tuple[str, nn.Module]], root: str, device: str = "cpu",
                 hooks_first: bool = False, after_backward: Callable[[str], None] | None = None):
        self.root = root
        self.after_backward = after_backward
        self.cuda = device == "cuda"
        self.device = device_of(device)
        self.marks: list[tuple[Any, str, str]] = []
        self.live: list[str] = []  # forward stack, for activation attribution
        self.act_bytes: dict[str, int] = defaultdict(int)
        self.seen_storages: dict[int, weakref.ref] = {}  # data pointer -> the storage seen there (first_seen)
        self.param_storages: set[int] = set()
        self.saved_parameter_storages: set[int] = set()  # storages of parameters autograd saved for backward
        self.handles = []
        self.in_backward = False
        self.recomputing: set[str] = set()  # modules whose forward ran again in backward (checkpointed)
        self.recompute_depth: dict[str, int] = defaultdict(int)
        self.recompute_bytes: dict[str, int] = defaultdict(int)  # its children's outputs in backward, last run
        self.recompute_seen: dict[str, dict[int, weakref.ref]] = defaultdict(dict)  # per module
        self.memory = MarkMemory(self.cuda)
        self.reading_memory = False
        self.modules = modules
        # the root's gradient bytes alive when its first nested module's backward starts (the LM head's, not the
        # embedding's), from the last run with memory; None before
        self.root_grad_pre_bytes: int | None = None
        self.backward_peak: dict[str, int] = {}  # [Note: Backward temporaries], from the last run with memory
        # of the root's activation bytes, those saved after its first nested module's forward (the final norm's, the
        # LM head's, the loss's): its backward frees them before its nested modules' ([Note: The root's saved
        # tensors in two parts])
        self.root_activation_post_bytes = 0
        self.child_entered = False  # in this forward
        fsdp = {id(m) for _, m in modules}
        for fqn, m in modules:
            self.handles.append(m.register_forward_pre_hook(self._pre_hook(fqn), with_kwargs=True, prepend=hooks_first))
            self.handles.append(m.register_forward_hook(self._post_hook(fqn), prepend=hooks_first))
            if fqn == root or torch_private.compiled_wrapper(m):  # a compiled block's inside runs as its graphs
                continue
            for child in m.children():
                if id(child) not in fsdp:
                    self.handles.append(child.register_forward_pre_hook(self._recompute_hook(fqn, +1)))
                    self.handles.append(child.register_forward_hook(self._recompute_hook(fqn, -1)))
                    for deeper in list(child.modules())[1:]:
                        if id(deeper) not in fsdp:
                            self.handles.append(deeper.register_forward_hook(self._recompute_bytes_hook(fqn)))

    def mark(self, kind: str, fqn: str) -> None:
        self.marks.append((self.device.mark(), kind, fqn))
        if self.reading_memory:
            self.memory.at_mark()
            if kind == "benter" and self.root_grad_pre_bytes is None:
                grads = [p.grad for p in own_parameters(self.modules, self.root) if p.grad is not None]
                self.root_grad_pre_bytes = sum(  # a sharded gradient (a root not held unsharded): its local shard
                    (g.to_local() if isinstance(g, DTensor) else g).untyped_storage().nbytes() for g in grads)

    def _marks_to_seconds(self) -> None:
        seconds = self.device.seconds([m for m, _, _ in self.marks])
        self.marks = [(s, kind, fqn) for s, (_, kind, fqn) in zip(seconds, self.marks, strict=True)]

    def _once(self, kind: str, fqn: str):
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self.mark(kind, fqn)
                self.recompute_depth[fqn] = 0  # a recompute stopped early never returned from its last child
                if kind == "bexit" and self.after_backward is not None:
                    self.after_backward(fqn)

        return hook

    def _pre_hook(self, fqn: str):
        def hook(module, args, kwargs):
            self.mark("enter", fqn)
            self.live.append(fqn)
            if fqn != self.root:
                self.child_entered = True
                end_hook = self._once("bexit", fqn)
                for t in tensors_in((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(end_hook)

        return hook

    def _post_hook(self, fqn: str):
        def hook(module, args, output):
            self.mark("exit", fqn)
            self.live.remove(fqn)
            if fqn != self.root:
                start_hook = self._once("benter", fqn)
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(start_hook)

        return hook

    def _recompute_hook(self, fqn: str, step: int):
        def hook(module, *hook_args):
            if not self.in_backward or (step < 0 and self.recompute_depth[fqn] == 0):
                return
            if step < 0:
                self.recompute_bytes[fqn] += self._new_bytes(fqn, tensors_in(hook_args[-1]))
            self.recompute_depth[fqn] += step
            if step > 0 and self.recompute_depth[fqn] == 1:
                self.recomputing.add(fqn)
                self.mark("rstart", fqn)
            elif step < 0 and self.recompute_depth[fqn] == 0:
                self.mark("rend", fqn)
            elif step < 0:
                self.mark("rtick", fqn)

        return hook

    def _recompute_bytes_hook(self, fqn: str):
        def hook(module, args, output):
            if self.in_backward and self.recompute_depth[fqn] > 0:
                self.recompute_bytes[fqn] += self._new_bytes(fqn, tensors_in(output))
                self.mark("rtick", fqn)

        return hook

    def _new_bytes(self, fqn: str, tensors: list[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            try:
                storage = storage_of(t)
                key = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a wrapper with no storage of its own, as in _pack
                continue
            if key not in self.param_storages and first_seen(self.recompute_seen[fqn], key, t):
                total += storage.nbytes()
        return total

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = storage_of(t)
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        if key in self.param_storages:
            self.saved_parameter_storages.add(key)
        elif self.live and first_seen(self.seen_storages, key, t):
            self.act_bytes[self.live[-1]] += storage.nbytes()
            if self.live[-1] == self.root and self.child_entered and not self.in_backward:
                self.root_activation_post_bytes += storage.nbytes()
        return t

    def run(self, workload: Workload, step: int, memory: bool = False) -> None:
        """One forward + backward, marking windows; ``memory``: also :attr:`backward_peak` (on CPU the run is
        profiled, which slows it: not a run to time; under a profiler already running it reads none)."""
        if not memory:
            self._run(workload, step)
            return
        self.reading_memory = True
        self.root_grad_pre_bytes = None
        try:
            with self.memory.reading():
                self._run(workload, step)
        finally:
            self.reading_memory = False
        if self.memory.levels is not None:
            self.backward_peak = backward_peaks([(k, f) for _, k, f in self.marks], self.memory.levels, self.root)

    def _run(self, workload: Workload, step: int) -> None:
        self.marks.clear()
        self.seen_storages.clear()
        self.act_bytes.clear()
        self.root_activation_post_bytes = 0
        self.child_entered = False
        self.saved_parameter_storages.clear()
        # the unsharded parameters (a module held sharded registers its shards: its figures are not kept); under
        # FSDP + TP a held module's unsharded parameters are DTensors too, on the TP mesh
        sharded = {key for _, m in self.modules for key in torch_private.unsharded_shapes(m)}
        self.param_storages = {storage_of(p).data_ptr() for p in workload.model.parameters() if id(p) not in sharded}
        self.mark("enter", self.root)
        self.recompute_depth.clear()
        self.recompute_bytes.clear()
        self.recompute_seen.clear()
        # the recompute runs as the user's: early stop ends it mid-forward ([Note: The recompute stops early])
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            loss = workload.loss_fn(workload.model, workload.make_batch(step))
        self.mark("exit", self.root)
        self.mark("enter", self.root)
        self.in_backward = True
        try:
            loss.backward()
        finally:
            self.in_backward = False
        self.mark("exit", self.root)
        self._marks_to_seconds()

    def attribute(self) -> tuple[dict[str, dict[str, float]], list[str], list[str], dict[str, int]]:
        """Exclusive ms per module and phase, pre-/post-forward order, forward calls of the last run
        (:func:`attribute_marks`)."""
        return attribute_marks(self.marks, self.root)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def attribute_marks(marks: list[tuple[float, str, str]], root: str
                    ) -> tuple[dict[str, dict[str, float]], list[str], list[str], dict[str, int]]:
    """A run's marks, ``(seconds, kind, fqn)`` in order, as exclusive ms per module and phase
    (:data:`planner.artifacts.rank_measurements.COMPUTE_FIELDS`), the pre- and post-forward orders (``root`` left out)
    and each module's forward calls: the windows of :func:`runtime.recording.mark_memory.walk_marks`, a recompute
    from its start to its end or, stopped early, to its last tick ([Note: The recompute stops early])."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COMPUTE_FIELDS, 0.0))
    pre_order, post_order = [], []
    calls: dict[str, int] = defaultdict(int)
    recompute_start: dict[str, float] = {}
    recompute_last: dict[str, float] = {}  # its last rtick ([Note: The recompute stops early])
    for step in walk_marks([(kind, fqn) for _, kind, fqn in marks], root):
        i, kind, fqn, t = step.index, step.kind, step.fqn, marks[step.index][0]
        if recompute_start and kind not in ("rtick", "rend"):  # one stopped early: it ended at its last rtick
            for f, start in recompute_start.items():
                out[f]["recompute_ms"] += (recompute_last.pop(f) - start) * 1e3
            recompute_start.clear()
        if kind == "rstart":
            recompute_start[fqn] = recompute_last[fqn] = t
        elif kind == "rtick":
            if fqn in recompute_start:
                recompute_last[fqn] = t
        elif kind == "rend":
            recompute_last.pop(fqn, None)
            out[fqn]["recompute_ms"] += (t - recompute_start.pop(fqn, t)) * 1e3
        elif kind == "enter" and not step.backward and fqn != root:
            pre_order.append(fqn)
            calls[fqn] += 1
        elif kind == "exit" and not step.backward and fqn != root:
            post_order.append(fqn)
        if step.top is not None and i + 1 < len(marks):
            dt = (marks[i + 1][0] - t) * 1e3
            phase = "bwd" if step.backward else "fwd"
            out[step.top][f"{phase}_ms"] += dt
            if step.pre:
                out[step.top][f"{phase}_pre_ms"] += dt
    return dict(out), pre_order, post_order, dict(calls)
