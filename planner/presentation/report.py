"""What the CLI prints after a tuning job: the race, the confirmation and its verdict, the simulator's fit."""

from __future__ import annotations

import math
import statistics

from planner.artifacts.knobs import MODULE_KNOBS, PLAN_KNOBS
from planner.artifacts.plan import Plan, Source, baseline_name
from planner.statistics.design import ConfirmDesign
from planner.statistics.verdict import Confirmation
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
    if not outcome.plans_measured or race is None:
        return lines + ["no plan was measured in this job; nothing written"]
    lines.append(f"\n  {'trial':>5}  {'predicted ms':>12}  {'race ms':>9}  {'race ratio':>10}  {'rounds':>6}  "
                 f"{'peak MiB pred/meas':>18}  plan")
    for j, p in enumerate(outcome.plans_measured):
        pv = p.provenance
        ratio = 1.0 if j == race.default else math.exp(statistics.median(race.log_ratios(j, race.default)))
        label = ("yours (the plan the model arrived with)" if pv.source == Source.USER else
                 "FSDP2 default" if p.is_default_for(outcome.profile) else describe(p))
        if j in race.dropped:
            label += f"; dropped after {race.dropped[j]} rounds"
        peaks = f"{mib(pv.predicted_peak_bytes, 0, unit=False)} / {mib(pv.measured_peak_bytes, 0, unit=False)}"
        lines.append(f"  {pv.trial:>5}  {pv.predicted_ms:>12.1f}  {pv.measured_ms:>9.1f}  {ratio:>10.3f}  "
                     f"{len(race.step_ms(j)):>6}  {peaks:>18}  {label}")
    detectable = race.detectable_slowdown()
    lines.append(f"race: {len(race.rounds)} rounds, noise {race.noise_pct():.1f}% (step IQR / median); race ratio = "
                 f"median paired per-round ratio to {_baseline(outcome)}, not confirmed"
                 + (f"; its last look's sign test drops a plan {100 * detectable:.1f}% slower than the leader with "
                    "80% power" if math.isfinite(detectable) else
                    "; too few rounds for its sign test to drop a plan" if detectable == math.inf else ""))
    lines += _verdict_lines(outcome, study)
    budget = outcome.plans_measured[0].provenance.memory_budget_bytes
    if budget is not None and outcome.written is not None:
        peak = outcome.written.provenance.measured_peak_bytes
        lines.append(f"memory budget {mib(budget, 0)} per rank: the written plan's measured peak is {mib(peak, 0)}")
    c = outcome.calibration
    if c is not None:
        saved = "saved with the profile for later runs" if c.accepted else "not saved"
        lines.append(f"the simulator's fit to these {len(outcome.plans_measured)} measured plans: {c.reason}; {saved}")
    lines.append(f"profile written to {outcome.profile_out}")
    return lines


def _verdict_lines(outcome: TuneOutcome, study: str) -> list[str]:
    candidate, best = outcome.candidate, outcome.best
    lines = []
    confirmation = outcome.confirmation
    if candidate is not None and confirmation is not None:
        lines.append(f"confirmation: trial {candidate.provenance.trial} vs {_baseline(outcome)}: {confirmation.line()} "
                     f"(noise {confirmation.noise_pct:.1f}%)")
        lines.append(power_line(confirmation))
    elif candidate is not None:
        return [f"race survivor: trial {candidate.provenance.trial}; its confirmation runs next"
                + (f": {design_line(outcome.design)}" if outcome.design is not None else ", in fresh launches")]
    if best is not None:
        lines.append(f"best plan: {best.line(study)}; written to {outcome.plan_out} "
                     f"(`prefetch-planner studies best {study}`)")
    return lines


def _baseline(outcome: TuneOutcome) -> str:
    """The round's baseline, in words: the first plan measured ([Note: The user's plan is the baseline] in
    ``planner.study.session``)."""
    return baseline_name(outcome.plans_measured[0].provenance.source == Source.USER)


def design_line(d: ConfirmDesign) -> str:
    """``4 fresh launches of 10 rounds (80 steps), 81% power for a 3.0% gain at the cluster's spread 4.5% and the
    race's noise 2.1% a round``: the power the design was sized for, before any launch, and the spread and noise it
    assumed (:func:`power_line` says what the launches then measured, through the same
    :func:`planner.statistics.verdict.power`)."""
    where = f"{d.launches} fresh launch(es)" if d.launches else "this process, then a fresh launch at each later start"
    reach = "" if d.resolves else " (no design of up to 6 launches reaches 80%: the cluster's spread dominates)"
    assumed = f" {100 * d.tau:.1f}%" if d.tau == d.tau else ""
    noise = f" and the race's noise {100 * d.sigma:.1f}% a round" if d.sigma == d.sigma else ""
    return (f"{where} of {d.rounds} rounds ({d.steps()} steps), {100 * d.power:.0f}% power for a "
            f"{100 * d.resolve:.1f}% gain at the cluster's spread{assumed}{noise}{reach}; the chain looks up to "
            f"{d.horizon} fresh launch(es)")


def power_line(c: Confirmation) -> str:
    """What the confirmation could find: the total-time gain its launches and rounds call faster with 80% power
    (no nudge to re-run it: a verdict is not re-tried until it says "faster")."""
    gain = c.detectable()
    if not gain == gain:
        return "      (power unknown: a confirmation from before the total-time estimand)"
    fresh = c.fresh_launches
    if fresh < 1:
        return ("      power: none in this process: its race picked the survivor, so only a fresh launch can call it "
                "faster (the next start or `tune` job adds one)")
    return (f"      power: {fresh} fresh launch(es) of {c.rounds // max(1, c.launches)} rounds call a total-time gain "
            f"of {100 * gain:.1f}% faster with 80% power at what these launches measured (between-launch spread "
            f"{100 * c.tau:.1f}%{', the floor' if c.df is None and c.fresh is not None else ''}, noise "
            f"{100 * c.noise_sigma():.1f}% a round); the design's line above assumed the race's noise")


def conclusion_report(confirmation: Confirmation | None, best: BestPlan, study: str, plan_out: str) -> list[str]:
    """The lines ``prefetch-planner tune`` prints after the confirmation launches."""
    lines = []
    if confirmation is None:
        lines.append("confirmation: no launch measured the survivor; the study's recommendation is unchanged")
    else:
        lines.append(f"confirmation: {confirmation.line()} (noise {confirmation.noise_pct:.1f}%; each launch a "
                     "fresh process; the interval includes the spread between launches)")
        lines.append(power_line(confirmation))
    lines.append(f"best plan: {best.line(study)}; written to {plan_out} (`prefetch-planner studies best {study}`)")
    return lines
