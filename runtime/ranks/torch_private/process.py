"""Process-wide private torch state: gloo's worker threads, the profiler's event tree, a fake process group and
Dynamo's compiled graphs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def gloo_worker_threads() -> int:
    """The worker threads a gloo process group runs its collectives on, by default (``ProcessGroupGloo``'s
    ``Options::threads``).

    Why: the simulator's CPU rule that a synchronous reduce-scatter runs beside an all-gather in flight assumes two
    ([Note: Gloo's two worker threads] in ``planner/simulation/_kernel/param_group.py``); the default is read
    from ``ProcessGroupGloo._Options()._threads``, which has no public accessor.
    """
    import torch.distributed as dist

    return int(dist.ProcessGroupGloo._Options()._threads)


def profiler_allocations(prof: Any, within: str | None = None) -> list[tuple[int, int, int]]:
    """``(time ns, bytes allocated (+) or freed (-), total allocated after it)`` of a memory profile, in time order.

    ``within``: only the allocations inside a ``torch.profiler.record_function(within)`` block.

    Why: the measured peak on a CPU device. ``torch.profiler.profile(profile_memory=True)``
    records every allocation with the allocator's running total
    (``c10::ProfiledCPUMemoryReporter``: "Total Allocated", bytes allocated
    while profiling and still alive, from every thread); the public
    ``prof.events()`` folds allocations into their ops and keeps no running
    total. Read from ``prof.profiler.kineto_results.experimental_event_tree()``,
    events tagged ``torch._C._profiler._EventType.Allocation``
    (``extra_fields.alloc_size``, ``total_allocated``).
    """
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = [(e, within is None) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, inside = stack.pop()
        if event.tag == _EventType.Allocation and inside:
            fields = event.extra_fields
            out.append((event.start_time_ns, int(fields.alloc_size), int(fields.total_allocated)))
        inside = inside or event.name == within
        stack.extend((child, inside) for child in event.children)
    out.sort()
    return out


def profiler_running() -> bool:
    """Whether a ``torch.profiler`` (or ``torch.autograd.profiler``) profile is active in this process
    (``torch.autograd._profiler_enabled``).

    Why: a profiler cannot start inside another; the compute timer's memory run on CPU profiles, so under a
    user's profiler it reads no memory instead of failing the user's job.
    """
    return bool(torch.autograd._profiler_enabled())


def profiler_marks(prof: Any, prefix: str) -> list[tuple[int, str]]:
    """``(time ns, name)`` of the ``record_function`` blocks whose name starts with ``prefix``, in time order, on
    the clock of :func:`profiler_allocations`.

    Why: the bytes alive at chosen points of a profiled run on a CPU device (:mod:`runtime.recording.compute_timer`
    marks
    each module's window with an empty block). Read from the same event tree as :func:`profiler_allocations`
    (``experimental_event_tree()``, ``name``, ``start_time_ns``).
    """
    out: list[tuple[int, str]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name.startswith(prefix):
            out.append((event.start_time_ns, event.name))
        stack.extend(event.children)
    out.sort()
    return out


def profiler_mark(name: str) -> Any:
    """An empty block named ``name`` in the running profiler's trace (:func:`profiler_marks` finds it), entered
    outside the dispatcher (``torch._C._profiler._RecordFunctionFast``). Why: ``record_function`` is a dispatcher
    op, which selective activation checkpointing's recomputation raises on when its forward did not run it."""
    return torch._C._profiler._RecordFunctionFast(name)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A default process group of ``world_size`` ranks in this one process, whose collectives do nothing.

    Why: ``prefetch-planner profile --from-trace --model FACTORY`` builds the traced job's model to read its
    parameter counts (:func:`runtime.apply.model_fingerprint`), sharded over the traces' world size, without
    launching ranks. ``fully_shard`` needs a mesh of that size; torch's testing ``FakeStore`` and its ``"fake"``
    backend (``torch.testing._internal.distributed.fake_pg``) give one.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process (``torch._dynamo.utils.counters["stats"]
    ["unique_graphs"]``).

    Why: the tests check that the tuner's hooks make no compiled block compile again; Dynamo has no public counter.
    """
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper of another module (``OptimizedModule``; FSDP2 subclasses it
    in place as ``FSDPOptimizedModule``), whose wrapped module and everything under it run as compiled graphs.

    Why: a forward hook on a module inside a compiled graph is traced into it when it exists at compile time (under
    ``fullgraph=True`` a hook calling ``time.perf_counter`` fails the user's step) and silently skipped when added
    after (Dynamo's ``skip_nnmodule_hook_guards``), so the recorder hooks only the wrapper, which runs eagerly.
    ``torch._dynamo.eval_frame.OptimizedModule`` has no public name.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)
