"""What the CLI prints after a tuning job: the race, the confirmation and its verdict, the calibration."""

from __future__ import annotations

from planner.artifacts.plan import Plan
from planner.statistics.verdict import Verdict, confirmation_rounds, confirmation_text, detectable_effect
from planner.study.session import TuneOutcome
from planner.units import mib


def describe(plan: Plan) -> str:
    """A short human description of a plan: the longest prefetch lists (a uniform plan's depths), async unshard,
    modules kept unsharded after forward, and the knobs left at FSDP2's default otherwise."""
    fwd = max(len(m.forward_prefetch) for m in plan.modules.values())
    bwd = max(max(1, len(m.backward_prefetch)) for m in plan.modules.values())
    n = len(plan.modules)
    k = sum(not m.reshard_after_forward for m in plan.modules.values())
    kept = ", no reshard after forward" if k == n else f", {k} of {n} modules unsharded after forward" if k > 1 else ""
    kept += ", reduce-scatter on its own process group" if plan.separate_reduce_scatter_group else ""
    kept += ", no reshard after backward between microbatches" if not plan.reshard_after_backward else ""
    return f"forward prefetch {fwd or 'implicit'}, backward prefetch {bwd}, async unshard {plan.unshard_async_op}{kept}"


def tune_report(outcome: TuneOutcome, study: str) -> list[str]:
    """The lines ``prefetch-planner tune`` prints when the job ends (rank 0)."""
    lines = [f"trial {number} FAIL: {reason}" for number, reason in outcome.failed.items()]
    race = outcome.race
    if not outcome.told or race is None:
        return lines + ["no plan was measured in this job; nothing written"]
    lines.append(f"\n  {'trial':>5}  {'predicted ms':>12}  {'race ms':>9}  {'vs default':>10}  {'rounds':>6}  "
                 f"{'peak MiB pred/meas':>18}  plan")
    for j, p in enumerate(outcome.told):
        pv = p.provenance
        ratio = 1.0 if j == race.default else pv.measured_ms / pv.default_measured_ms
        label = "FSDP2 default" if p.is_default_for(outcome.profile) else describe(p)
        if j in race.dropped:
            label += f"; dropped after {race.dropped[j]} rounds"
        peaks = f"{mib(pv.predicted_peak_bytes, 0, unit=False)} / {mib(pv.measured_peak_bytes, 0, unit=False)}"
        lines.append(f"  {pv.trial:>5}  {pv.predicted_ms:>12.1f}  {pv.measured_ms:>9.1f}  {ratio:>10.3f}  "
                     f"{len(race.step_ms(j)):>6}  {peaks:>18}  {label}")
    rounds, sigma = len(race.rounds), race.ratio_sigma()
    lines.append(f"race: {rounds} rounds, noise {race.noise_pct():.1f}% (step IQR / median); these rounds detect "
                 f"differences of {100 * detectable_effect(sigma, rounds):.1f}% or more")
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
    candidate, race = outcome.candidate, outcome.race
    if candidate is None:
        return [f"best plan: FSDP2's default, written to {outcome.plan_out}: every candidate was significantly slower"]
    pv = candidate.provenance
    interval = confirmation_text(pv.measured_ratio, pv.ratio_ci95, pv.rounds)
    confirmed = f"trial {pv.trial} vs FSDP2's default: {interval}: {pv.verdict} (noise {pv.noise_pct:.1f}%)"
    if pv.verdict == Verdict.FASTER:
        return [f"confirmation: {confirmed}",
                f"best plan: trial {pv.trial}, faster than FSDP2's default; written to {outcome.plan_out} "
                f"(`prefetch-planner studies best {study}`)"]
    needed = confirmation_rounds(race.ratio_sigma(), max(abs(1.0 - pv.measured_ratio), 0.005), (1, 10**6))
    return [f"confirmation: {confirmed}",
            f"best plan: FSDP2's default, written to {outcome.plan_out}; the closest candidate, trial {pv.trial}, "
            f"{'is slower' if pv.verdict == Verdict.SLOWER else 'shows no significant difference'}: about {needed} "
            f"confirmation rounds would resolve a difference of "
            f"{100 * abs(1.0 - pv.measured_ratio):.1f}% ([measure] confirm_max_rounds)"]

