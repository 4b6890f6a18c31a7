"""What the CLI prints after a tuning job: the measured round, the best plan, the calibration."""

from __future__ import annotations

from jobs.tune import TuneOutcome
from planner.calibrate import summary
from planner.plan import Plan


def describe(plan: Plan) -> str:
    """A short human description of a plan (prefetch depths, async unshard)."""
    fwd = max(len(m.forward_prefetch) for m in plan.modules.values())
    bwd = max(max(1, len(m.backward_prefetch)) for m in plan.modules.values())
    return f"forward prefetch {fwd or 'implicit'}, backward prefetch {bwd}, async unshard {plan.unshard_async_op}"


def tune_report(outcome: TuneOutcome, study: str) -> list[str]:
    """The lines ``prefetch-planner tune`` prints when the job ends (rank 0)."""
    lines = [f"trial {number} FAIL: {reason}" for number, reason in outcome.failed.items()]
    if not outcome.told:
        return lines + ["no plan was measured in this job; nothing written"]
    default_ms = outcome.told[0].provenance.default_measured_ms
    lines.append(f"\n  {'trial':>5}  {'predicted ms':>12}  {'measured ms':>11}  {'vs default':>10}  plan")
    for p in outcome.told:
        pv = p.provenance
        ratio = pv.measured_ms / default_ms if default_ms else float("nan")
        label = "FSDP2 default" if p.is_default_for(outcome.profile) else describe(p)
        lines.append(f"  {pv.trial:>5}  {pv.predicted_ms:>12.1f}  {pv.measured_ms:>11.1f}  {ratio:>10.3f}  {label}")
    best = outcome.best.provenance
    ratio = best.measured_ms / default_ms if default_ms else float("nan")
    lines.append(f"\nbest plan: trial {best.trial}, {best.measured_ms:.1f} ms vs FSDP2 default "
                 f"{default_ms:.1f} ms (ratio {ratio:.3f}); written to {outcome.plan_out}")
    study_best = outcome.study_best.provenance
    lines.append(f"study-wide best so far: trial {study_best.trial}, {study_best.measured_ms:.1f} ms "
                 f"(`prefetch-planner studies best {study}`)")
    if outcome.calibration is not None:
        c = outcome.calibration
        lines.append(f"calibration on these {len(c.before_pct)} measured plans: {summary(c.before_pct)} before, "
                     f"{summary(c.after_pct)} after; saved with the profile for later runs")
    lines.append(f"profile written to {outcome.profile_out}")
    return lines
