"""The time/memory Pareto front as a PNG (``prefetch-planner studies pareto NAME --png out.png``)."""

from __future__ import annotations

from planner.study.records import MeasuredTrialRecord, SimulatedTrialRecord
from planner.units import MIB


def plot_pareto(name: str, simulated: list[SimulatedTrialRecord], front: list[SimulatedTrialRecord],
                measured: list[MeasuredTrialRecord], path: str) -> None:
    """Draw every simulated trial, the predicted front and the measured points; write ``path``.

    Args:
        simulated, front, measured: ``planner.study.study_trials``' records
            (front: ``planner.study.pareto_front``), with their peaks; peaks in bytes, times in ms.

    Raises:
        OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([t.predicted_peak_bytes / MIB for t in simulated], [t.predicted_ms for t in simulated],
               s=8, c="0.75", label=f"simulated trials ({len(simulated)})")
    ax.step([t.predicted_peak_bytes / MIB for t in front], [t.predicted_ms for t in front], where="post",
            c="tab:blue", marker="o", ms=4, label="predicted Pareto front")
    ok = [t for t in measured if t.failure is None]
    over = [t for t in measured if t.failure is not None]
    ax.scatter([t.measured_peak_bytes / MIB for t in ok], [t.race_ms for t in ok], marker="x", s=60,
               c="tab:red", label="measured (race median)")
    for t in ok:
        ax.annotate(f"trial {t.number}" + (" (default)" if t.is_default else ""),
                    (t.measured_peak_bytes / MIB, t.race_ms), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    if over:
        ax.scatter([t.measured_peak_bytes / MIB for t in over], [t.predicted_ms for t in over], marker="x",
                   s=60, c="0.4", label="over the budget (at its predicted ms)")
    ax.set_xlabel("peak memory per rank, MiB")
    ax.set_ylabel("step time, ms")
    ax.set_title(f"{name}: time vs memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
