"""The bytes alive at each mark of the compute timer's run, and each module's backward peak from them.

[Note: Backward temporaries] in :mod:`runtime.recording.compute_timer` says why. On GPU a mark reads the caching
allocator's counters (``memory_allocated``, ``max_memory_allocated``, then ``reset_peak_memory_stats``), host-side
and in program order, as the allocator accounts them. On CPU there are no counters: the run goes under
``torch.profiler.profile(profile_memory=True)``, each mark is an empty record-function block, entered outside the
dispatcher (``torch_private.profiler_mark``), and the marks are read against the allocation events after the run
(:func:`memory_at_marks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from torch.profiler import ProfilerActivity, profile

from runtime.ranks.device import device_of
from runtime.ranks.torch_private import profiler_allocations, profiler_mark, profiler_marks, profiler_running
from runtime.recording.peak_memory import stderr_silenced

MARK = "prefetch-planner: mark "  # the record_function name of a mark in a profiled run on CPU


class MarkMemory:
    """Reads ``(bytes alive, most bytes alive since the mark before)`` at each mark of one run.

    Use: ``with reader.reading(): ...`` around the run, :meth:`at_mark` in every mark, then :attr:`levels`
    (``None`` when nothing could be read: on CPU under a profiler already running, as a profiler cannot start
    inside another).
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.levels: list[tuple[int, int]] | None = None
        self._marks = 0
        self._profiling = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        self.levels, self._marks = ([] if self.cuda else None), 0
        if self.cuda:
            try:
                yield
            finally:
                device_of("cuda").reset_peak()
            return
        if profiler_running():
            yield
            return
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with stderr_silenced():  # [Note: Kineto's start and stop lines] in runtime.recording.peak_memory
            prof.__enter__()
        self._profiling = True
        try:
            yield
        finally:
            self._profiling = False
            with stderr_silenced():
                prof.__exit__(None, None, None)
        self.levels = memory_at_marks(profiler_allocations(prof), [t for t, _ in profiler_marks(prof, MARK)])

    def at_mark(self) -> None:
        """Called at each mark, inside :meth:`reading`."""
        if self.cuda and self.levels is not None:
            cuda = device_of("cuda")
            self.levels.append((cuda.allocated(), cuda.peak_allocated()))
            cuda.reset_peak()
        elif self._profiling:
            with profiler_mark(f"{MARK}{self._marks}"):
                pass
        self._marks += 1


def memory_at_marks(allocations: list[tuple[int, int, int]], marks: list[int]) -> list[tuple[int, int]]:
    """Per mark: ``(bytes alive at it, most bytes alive since the mark before)``, from a CPU memory profile.

    Args:
        allocations: :func:`runtime.ranks.torch_private.profiler_allocations`, ``(time ns, bytes, total after)``.
        marks: the marks' times, ns, on the same clock, in order.

    The totals count what was allocated while profiling and is still alive, so only differences between marks
    mean anything. Before the first allocation the total is that event's total less its size.
    """
    if not allocations:
        return [(0, 0) for _ in marks]
    out: list[tuple[int, int]] = []
    alive = allocations[0][2] - allocations[0][1]
    j = 0
    for t in marks:
        peak = alive
        while j < len(allocations) and allocations[j][0] <= t:
            alive = allocations[j][2]
            peak = max(peak, alive)
            j += 1
        out.append((alive, peak))
    return out


class MarkStep(NamedTuple):
    """One mark of the compute timer's run, as :func:`walk_marks` finds it.

    Attributes:
        index: its position among the marks; ``kind``, ``fqn``: the mark's.
        backward: the run is in its backward (the root's second ``enter`` opens it).
        opened: a module's window opened here (``enter``/``benter`` of a module not already open).
        top: the module the time up to the next mark belongs to (the innermost open one), ``None``: none open.
        pre: ``top`` has not yet had a nested module open in this phase (its part before its first child's).
    """

    index: int
    kind: str
    fqn: str
    backward: bool
    opened: bool
    top: str | None
    pre: bool


def walk_marks(marks: Sequence[tuple[str, str]], root: str) -> Iterator[MarkStep]:
    """The compute timer's windows over its ``(kind, fqn)`` marks, in order: the one walk its time attribution
    (:meth:`runtime.recording.compute_timer.ComputeTimer.attribute`) and :func:`backward_peaks` share.

    ``enter``/``exit`` open and close a module's forward window, ``benter``/``bexit`` its backward window; the
    root's second ``enter`` opens the backward; other kinds (the recompute's ``rstart``/``rtick``/``rend``) open
    nothing.
    """
    stack: list[str] = []
    child_seen: set[str] = set()
    backward = False
    for i, (kind, fqn) in enumerate(marks):
        opened = False
        if kind in ("enter", "benter"):
            if kind == "enter" and fqn == root and i > 0 and not stack:
                backward = True
                child_seen.clear()
            if stack and stack[-1] != fqn:
                child_seen.add(stack[-1])
            opened = fqn not in stack
            stack.append(fqn)
        elif kind in ("exit", "bexit") and fqn in stack:
            del stack[len(stack) - 1 - stack[::-1].index(fqn)]
        top = stack[-1] if stack else None
        yield MarkStep(i, kind, fqn, backward, opened, top, top is not None and top not in child_seen)


def backward_peaks(marks: list[tuple[str, str]], levels: list[tuple[int, int]], root: str) -> dict[str, int]:
    """Per module: the most bytes alive in its backward before its first nested module's, above those alive when
    that backward window opened (the compute timer's windows, :func:`walk_marks`; [Note: Backward temporaries]).

    Args:
        marks: the timer's ``(kind, fqn)`` per mark, in order.
        levels: :attr:`MarkMemory.levels`, one per mark; any other length gives ``{}`` (a mark the profiler did not
            see: no figure rather than a wrong one).
    """
    if len(levels) != len(marks):
        return {}
    peaks: dict[str, int] = {}
    start: dict[str, int] = {}
    for step in walk_marks(marks, root):
        if step.backward and step.opened:  # each backward window of a module called twice: its own start
            start[step.fqn] = levels[step.index][0]
        if step.backward and step.pre and step.index + 1 < len(levels):
            peaks[step.top] = max(peaks.get(step.top, 0), levels[step.index + 1][1] - start[step.top])
    return peaks
