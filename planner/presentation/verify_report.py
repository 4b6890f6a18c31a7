"""What ``prefetch-planner verify`` prints: the plan's claim, each launch, the combined re-measurement and whether it
agrees with the claim."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from planner.artifacts.plan import Plan
from planner.statistics.agreement import ClaimCheck, compare_with_claim
from planner.statistics.launches import DEFAULT_SPREAD, ConfirmLaunch, Spread
from planner.statistics.looks import Looks
from planner.statistics.verdict import Confirmation, confirm_launches, confirmation_text, step_noise_pct


@dataclass(frozen=True)
class Verification:
    """A plan's re-measurement: its launches' rounds combined, and the check against its claim.

    Attributes:
        confirmation: the launches' rounds combined as a confirmation's are (``confirm_launches``).
        check: the re-measurement against the plan's recorded claim.
        launch_ratios: each launch's own total-time ratio.
    """

    confirmation: Confirmation
    check: ClaimCheck
    launch_ratios: list[float]


def verification(plan: Plan, launches: Sequence[tuple[Sequence[float], Sequence[float]]],
                 floor: Spread = DEFAULT_SPREAD) -> Verification:
    """``launches`` (per launch ``(plan_ms, default_ms)``, ms) combined and set against ``plan``'s claim, the spread
    between launches floored at ``floor`` (the cluster's: ``planner.study.cluster_spread``) and pooled from it.

    Raises:
        ValueError: no launch, or one with fewer rounds than a confirmation needs.
    """
    noise = step_noise_pct([list(t) for launch in launches for t in launch])
    confirmation = confirm_launches([ConfirmLaunch(list(p), list(d)) for p, d in launches], noise, floor,
                                    Looks(horizon=len(launches)), floor)
    p = plan.provenance
    claimed = p.measured_ratio if p.ratio_of == "total time" else None
    check = compare_with_claim(confirmation, claimed, p.ratio_ci95 if claimed is not None else None)
    ratios = [sum(plan_ms) / sum(default_ms) for plan_ms, default_ms in launches]
    return Verification(confirmation, check, ratios)


def claim_line(plan: Plan, path: str) -> str:
    """What ``plan`` (read from ``path``) claims: its confirmation, or that it records none."""
    p = plan.provenance
    where = f"trial {p.trial} of study {p.study}" if p.study is not None and p.trial is not None else "a plan"
    if p.measured_ratio is None or p.ratio_ci95 is None:
        return f"plan {path}: {where}; it records no confirmed ratio to check"
    if p.ratio_of != "total time":
        return (f"plan {path}: {where}, confirmed before the total-time estimand (median ratio {p.measured_ratio:.3f})"
                "; its claim is not a total-time ratio and is not checked")
    rounds, launches = p.rounds or 0, p.launches or 1
    return (f"plan {path}: {where}, claimed {confirmation_text(p.measured_ratio, p.ratio_ci95, rounds, launches)}"
            f" ({p.verdict})")


def launch_line(index: int, launches: int, plan_ms: Sequence[float], default_ms: Sequence[float]) -> str:
    """One launch: its total-time ratio and each model's median step."""
    ratio = sum(plan_ms) / sum(default_ms)
    return (f"      launch {index}/{launches}: total-time ratio {ratio:.3f} over {len(plan_ms)} rounds (median step: "
            f"plan {statistics.median(plan_ms):.1f} ms, FSDP2's default {statistics.median(default_ms):.1f} ms)")


def verify_report(result: Verification, tuner_modules: Sequence[str]) -> list[str]:
    """The lines after the launches: the combined re-measurement, the check against the claim, and what the ranks
    had loaded of the tuner (nothing, as in a user's job)."""
    c = result.confirmation
    lines = [f"verified: {c.line()}", result.check.line()]
    if tuner_modules:
        lines.append(f"warning: the verify ranks had loaded parts of the tuner ({', '.join(tuner_modules)}); a "
                     "user's job would not have")
    else:
        lines.append("the verify ranks loaded nothing of the tuner (no study, simulator, Optuna or recorder), as a "
                     "user's job")
    if len(result.launch_ratios) > 1:
        spread = max(result.launch_ratios) / min(result.launch_ratios) - 1
        lines.append(f"the launches' ratios differ by {100 * spread:.1f}% (between-launch spread used: "
                     f"{100 * (c.tau or 0):.1f}% on the log scale)")
    return lines
