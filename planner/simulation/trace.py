"""The predicted timeline as a Chrome trace (opens in Perfetto) and as a PNG.

One track per resource (compute, all-gather, reduce-scatter, CPU waits), one
slice per compute / all-gather / reduce-scatter, and memory as a counter.
"""

from __future__ import annotations

import json
from pathlib import Path

from planner.artifacts.json_types import JsonObject
from planner.errors import PlannerError
from planner.simulation.simulator import SimResult, Track
from planner.units import MIB, mib

TRACKS = tuple(Track)  # one row per resource, top to bottom


def chrome_trace(result: SimResult, title: str = "predicted step") -> JsonObject:
    """The Chrome trace-event JSON object of a traced :class:`SimResult`.

    Times become µs (``ts``/``dur``); tracks are threads of one process.

    Raises:
        ValueError: the result was simulated without ``trace=True``.
    """
    if not result.events:
        raise ValueError("simulate(..., trace=True) first: this result has no timeline")
    events: list[JsonObject] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": title}},
    ]
    for tid, track in enumerate(TRACKS, start=1):
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": track}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
    for e in result.events:
        events.append({
            "ph": "X", "name": e.name, "cat": e.track, "pid": 1, "tid": TRACKS.index(e.track) + 1,
            "ts": e.start_ms * 1e3, "dur": max(0.0, e.end_ms - e.start_ms) * 1e3,
        })
    for t, nbytes in result.memory:
        events.append({"ph": "C", "name": "memory", "pid": 1, "ts": t * 1e3, "args": {"MiB alive": nbytes / MIB}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"step_ms": result.step_ms, "peak_bytes": result.peak_bytes,
                      "exposed_comm_ms": result.exposed_comm_ms, "lower_bound_ms": result.lower_bound_ms},
    }


def write_chrome_trace(result: SimResult, path: str | Path, title: str = "predicted step") -> None:
    """Write :func:`chrome_trace` to ``path``. Raises :class:`PlannerError` if it cannot."""
    try:
        Path(path).write_text(json.dumps(chrome_trace(result, title)))
    except OSError as e:
        raise PlannerError(f"cannot write trace {str(path)!r}: {e.strerror}") from None


COLORS = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2", "all-gather": "#dd8452",
          "reduce-scatter": "#c44e52", "wait": "#bbbbbb", "outside": "#937860"}  # outside: [Note: Work outside the
# modules]


def _pyplot():
    """matplotlib's pyplot on the Agg backend.

    Raises:
        PlannerError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlannerError("--png needs matplotlib: pip install matplotlib (or the project's [plot] extra)") from None
    return plt


def _draw_tracks(ax, result: SimResult) -> None:
    """One bar per event, one row per track (:data:`TRACKS`), coloured by kind (:data:`COLORS`)."""
    for row, track in enumerate(TRACKS):
        for e in (e for e in result.events if e.track == track):
            ax.broken_barh([(e.start_ms, e.end_ms - e.start_ms)], (row - 0.4, 0.8),
                           facecolors=COLORS.get(e.name.split(" ")[0], "#999999"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(TRACKS)), TRACKS)
    ax.invert_yaxis()


def _save(plt, fig, path: str | Path, dpi: int) -> None:
    """``fig`` to ``path``, closed either way.

    Raises:
        PlannerError: ``path`` cannot be written.
    """
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise PlannerError(f"cannot write {str(path)!r}: {e.strerror}") from None
    finally:
        plt.close(fig)


def write_png(result: SimResult, path: str | Path, title: str = "predicted step") -> None:
    """Draw the timeline (one row per track) and memory with matplotlib.

    Raises:
        PlannerError: matplotlib is not installed, or ``path`` cannot be written.
    """
    plt = _pyplot()
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(14, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    _draw_tracks(ax, result)
    ax.set_title(f"{title}: {result.step_ms:.1f} ms, exposed communication {result.exposed_comm_ms:.1f} ms, "
                 f"peak {mib(result.peak_bytes)}")
    if result.memory:
        ts, bs = zip(*result.memory, strict=True)
        mem.step(ts, [b / MIB for b in bs], where="post", color="#333333")
    mem.set_ylabel("MiB alive")
    mem.set_xlabel("ms")
    fig.tight_layout()
    _save(plt, fig, path, 110)


def write_comparison_png(results: list[tuple[str, SimResult]], path: str | Path) -> None:
    """Draw several predicted steps on one time axis, one panel each (FSDP2's default above a plan): their tracks,
    step and exposed communication, so the gain is seen where it is made.

    Raises:
        PlannerError: matplotlib is not installed, or ``path`` cannot be written.
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(results), 1, figsize=(14, 2.3 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, (title, result) in zip(axes[:, 0], results, strict=True):
        _draw_tracks(ax, result)
        ax.axvline(result.step_ms, color="#333333", linewidth=1)
        ax.set_title(f"{title}: step {result.step_ms:.0f} ms, exposed communication {result.exposed_comm_ms:.0f} ms",
                     loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("ms")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k != "outside"],
               loc="lower center", ncol=6, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    _save(plt, fig, path, 100)
