"""The time/memory Pareto front as a PNG (``prefetch-planner studies pareto NAME --png out.png``)."""

from __future__ import annotations

from typing import Any


def plot_pareto(name: str, simulated: list[dict[str, Any]], front: list[dict[str, Any]],
                measured: list[dict[str, Any]], path: str) -> None:
    """Draw every simulated trial, the predicted front and the measured points; write ``path``.

    Args:
        simulated, front, measured: rows of ``planner.study.study_trials``
            (front: ``planner.study.pareto_front``); peaks in bytes, times in ms.

    Raises:
        OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r["predicted_peak_bytes"] / mib for r in simulated], [r["predicted_ms"] for r in simulated],
               s=8, c="0.75", label=f"simulated trials ({len(simulated)})")
    ax.step([r["predicted_peak_bytes"] / mib for r in front], [r["predicted_ms"] for r in front], where="post",
            c="tab:blue", marker="o", ms=4, label="predicted Pareto front")
    ok = [r for r in measured if not r["fail_reason"]]
    over = [r for r in measured if r["fail_reason"]]
    ax.scatter([r["measured_peak_bytes"] / mib for r in ok], [r["measured_ms"] for r in ok], marker="x", s=60,
               c="tab:red", label="measured (race median)")
    for r in ok:
        ax.annotate(f"trial {r['number']}" + (" (default)" if r["is_default"] else ""),
                    (r["measured_peak_bytes"] / mib, r["measured_ms"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    if over:
        ax.scatter([r["measured_peak_bytes"] / mib for r in over], [r["predicted_ms"] for r in over], marker="x",
                   s=60, c="0.4", label="over the budget (at its predicted ms)")
    ax.set_xlabel("peak memory per rank, MiB")
    ax.set_ylabel("step time, ms")
    ax.set_title(f"{name}: time vs memory")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
