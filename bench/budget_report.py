"""The report of one ``bench.memory_budget`` run (fresh or saved), predicted with today's simulator."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from planner.units import mib

if TYPE_CHECKING:
    from planner.simulation.simulator import SimResult


def report(run: dict) -> dict:
    """Print one run's figures with today's simulator; returns the summary."""
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.in_step import in_step_params
    from planner.simulation.parameters import simulate

    profile = Profile.from_dict(run["profile"])
    params = in_step_params(profile) if profile.in_step is not None else None
    summary: dict = {"study": run["study"]}

    def sim(d: dict):
        return simulate(profile, Plan.from_dict(d), params)

    if "memory_budget_bytes" in run:
        _report_budget(run, sim, summary)
    else:
        print(f"\n== {run['study']}")
    if "blocks_times" in run:
        _report_blocks(run, sim, summary)
    return summary


def _report_budget(run: dict, sim: Callable[[dict], SimResult], summary: dict) -> None:
    from planner.statistics.verdict import confirm, step_noise_pct

    budget = run["memory_budget_bytes"]
    summary["budget_mib"] = budget / 2**20
    print(f"\n== {run['study']}: budget {mib(budget)} per rank = FSDP2 default's measured "
          f"{mib(run['default_peak_bytes'], unit=False)} + {run['share']:.0%} of the unconstrained best plan's extra "
          f"(measured {mib(run['unconstrained_peak_bytes'], unit=False)}, "
          f"predicted {mib(sim(run['unconstrained']).peak_bytes, unit=False)})")
    print(f"{'candidate':<44} {'pred ms':>8} {'sel ms':>8} {'pred MiB':>9} {'meas MiB':>9}  fits")
    for n, c in run["candidates"].items():
        r, sel = sim(c["plan"]), run["selection"].get(n)
        med = f"{sorted(sel)[len(sel) // 2]:8.0f}" if sel else f"{'-':>8}"
        print(f"{n:<44} {r.step_ms:>8.0f} {med} {mib(r.peak_bytes, unit=False):>9} "
              f"{mib(c['measured_peak_bytes'], unit=False):>9}  "
              f"{'yes' if c['measured_peak_bytes'] <= budget else 'NO'}")
    pick, times = run["picked"], run["confirmation"]
    print(
        f"selected on {len(run['selection']['FSDP2 default'])} rounds: "
        + ", ".join(f"{k}: {v}" for k, v in pick.items())
    )
    noise = step_noise_pct(list(times.values()))
    pairs = [("assign", "uniform"), ("assign", "default"), ("uniform", "default")]
    names = {**pick, "default": "FSDP2 default"}
    print(f"confirmation on {len(times['FSDP2 default'])} fresh rounds (order rotated), step noise {noise:.1f}%:")
    for a, b in pairs:
        if a in names and b in names:
            c = confirm(times[names[a]], times[names[b]], noise, seed=1)
            summary[f"{a}/{b}"] = {"ratio": c.ratio, "ci95": list(c.ci95), "verdict": str(c.verdict)}
            print(f"  {a}/{b}: ratio {c.ratio:.3f}, 95% CI [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}], {c.verdict}")


def _report_blocks(run: dict, sim: Callable[[dict], SimResult], summary: dict) -> None:
    from planner.statistics.verdict import confirm, step_noise_pct

    bt, plans = run["blocks_times"], run["blocks"]
    noise = step_noise_pct(list(bt.values()))
    base = "prefetch 1 async"
    b_sim = sim(plans[base])
    print(f"keeping blocks unsharded, against uniform prefetch 1 async ({len(bt[base])} fresh rounds): "
          "gain measured [95% CI] / predicted; peak measured / predicted MiB")
    summary["blocks"] = {}
    for n in plans:
        r = sim(plans[n])
        m = run["blocks_peaks"][n]
        if n == base:
            print(f"  {n:<28} {'':>31} {mib(m, unit=False):>8} / {mib(r.peak_bytes, unit=False)}")
            continue
        c = confirm(bt[n], bt[base], noise, seed=1)
        pred = r.step_ms / b_sim.step_ms
        summary["blocks"][n] = {"measured": c.ratio, "ci95": list(c.ci95), "predicted": pred,
                                "points_apart": 100 * abs(pred - c.ratio)}
        print(f"  {n:<28} {c.ratio:.3f} [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}] / {pred:.3f} "
              f"({100 * (pred - c.ratio):+.1f} pts) {mib(m, unit=False):>8} / {mib(r.peak_bytes, unit=False)}")
