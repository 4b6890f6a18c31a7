"""What the CLI prints after a tuning job: the race, the confirmation and its verdict, the calibration."""

from __future__ import annotations

import math
import statistics

from planner.artifacts.knobs import MODULE_KNOBS, PLAN_KNOBS
from planner.artifacts.plan import Plan
from planner.statistics.verdict import Confirmation, Verdict, confirmation_rounds, confirmation_text
from planner.study.queries import BestPlan
from planner.study.session import TuneOutcome
from planner.units import mib


def describe(plan: Plan) -> str:
    """A short human description of a plan: the longest prefetch lists (a uniform plan's depths), the knobs shown
    always (async unshard), modules kept unsharded after forward, then each knob set otherwise than FSDP2's default
    (``Knob.text``)."""
    fwd = max(len(m.forward_prefetch) for m in plan.modules.values())
    bwd = max(max(1, len(m.backward_prefetch)) for m in plan.modules.values())
    n = len(plan.modules)
    kept = sum(not m.reshard_after_forward for m in plan.modules.values())
    parts = [f"forward prefetch {fwd or 'implicit'}", f"backward prefetch {bwd}"]
    parts += [k.describe(plan.knobs[k.name]) for k in PLAN_KNOBS if k.shown]
    if kept == n:
        parts.append("no reshard after forward")
    elif kept > 1:
        parts.append(f"{kept} of {n} modules unsharded after forward")
    parts += [k.describe(plan.knobs[k.name]) for k in PLAN_KNOBS if not k.shown]
    for k in MODULE_KNOBS:
        changed = [m.knobs[k.name] for m in plan.modules.values() if m.knobs[k.name] != k.default]
        parts += [f"{k.describe(changed[0])} ({len(changed)} of {n} modules)"] if changed else []
    return ", ".join(p for p in parts if p)


def tune_report(outcome: TuneOutcome, study: str) -> list[str]:
    """The lines ``prefetch-planner tune`` prints when the job ends (rank 0)."""
    lines = [f"trial {number} FAIL: {reason}" for number, reason in outcome.failed.items()]
    race = outcome.race
    if not outcome.told or race is None:
        return lines + ["no plan was measured in this job; nothing written"]
    lines.append(f"\n  {'trial':>5}  {'predicted ms':>12}  {'race ms':>9}  {'race ratio':>10}  {'rounds':>6}  "
                 f"{'peak MiB pred/meas':>18}  plan")
    for j, p in enumerate(outcome.told):
        pv = p.provenance
        ratio = 1.0 if j == race.default else math.exp(statistics.median(race.log_ratios(j, race.default)))
        label = "FSDP2 default" if p.is_default_for(outcome.profile) else describe(p)
        if j in race.dropped:
            label += f"; dropped after {race.dropped[j]} rounds"
        peaks = f"{mib(pv.predicted_peak_bytes, 0, unit=False)} / {mib(pv.measured_peak_bytes, 0, unit=False)}"
        lines.append(f"  {pv.trial:>5}  {pv.predicted_ms:>12.1f}  {pv.measured_ms:>9.1f}  {ratio:>10.3f}  "
                     f"{len(race.step_ms(j)):>6}  {peaks:>18}  {label}")
    detectable = race.detectable_slowdown()
    lines.append(f"race: {len(race.rounds)} rounds, noise {race.noise_pct():.1f}% (step IQR / median); race ratio = "
                 "median paired per-round ratio to FSDP2's default, not confirmed"
                 + (f"; its last look drops a plan {100 * detectable:.1f}% slower than the leader with 80% power"
                    if detectable == detectable else ""))
    lines += _verdict_lines(outcome, study)
    budget = outcome.told[0].provenance.memory_budget_bytes
    if budget is not None and outcome.written is not None:
        peak = outcome.written.provenance.measured_peak_bytes
        lines.append(f"memory budget {mib(budget, 0)} per rank: the written plan's measured peak is {mib(peak, 0)}")
    c = outcome.calibration
    if c is not None:
        saved = "saved with the profile for later runs" if c.accepted else "not saved"
        lines.append(f"calibration on these {len(outcome.told)} measured plans: {c.reason}; {saved}")
    lines.append(f"profile written to {outcome.profile_out}")
    return lines


def _verdict_lines(outcome: TuneOutcome, study: str) -> list[str]:
    candidate, best = outcome.candidate, outcome.best
    lines = []
    if candidate is not None and candidate.provenance.verdict is not None:
        pv = candidate.provenance
        interval = confirmation_text(pv.measured_ratio, pv.ratio_ci95, pv.rounds, pv.launches or 1)
        lines.append(f"confirmation: trial {pv.trial} vs FSDP2's default: {interval}: {pv.verdict} "
                     f"(noise {pv.noise_pct:.1f}%)")
        if pv.verdict != Verdict.FASTER:
            needed = confirmation_rounds(outcome.race.ratio_sigma(), max(abs(1.0 - pv.measured_ratio), 0.005),
                                         (6, 10**4))
            lines.append(f"      about {needed} confirmation rounds per launch would find a speed-up of "
                         f"{100 * abs(1.0 - pv.measured_ratio):.1f}% with 80% power ([measure] confirm_max_rounds)")
    elif candidate is not None:
        return [f"race survivor: trial {candidate.provenance.trial}; its confirmation runs next, in fresh launches"]
    if best is not None:
        lines.append(f"best plan: {best.line(study)}; written to {outcome.plan_out} "
                     f"(`prefetch-planner studies best {study}`)")
    return lines


def conclusion_report(confirmation: Confirmation | None, best: BestPlan, study: str, plan_out: str) -> list[str]:
    """The lines ``prefetch-planner tune`` prints after the confirmation launches."""
    lines = []
    if confirmation is None:
        lines.append("confirmation: no launch measured the survivor; the study's recommendation is unchanged")
    else:
        c = confirmation
        lines.append(f"confirmation: {confirmation_text(c.ratio, c.ci95, c.rounds, c.launches)}: {c.verdict} "
                     f"(noise {c.noise_pct:.1f}%; each launch a fresh process, the interval the hull of the "
                     "launches' sign-test intervals)")
    lines.append(f"best plan: {best.line(study)}; written to {plan_out} (`prefetch-planner studies best {study}`)")
    return lines
