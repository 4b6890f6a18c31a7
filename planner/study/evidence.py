"""A study's evidence across launches: each plan's earlier confirmation launches, and the spread between launches.

Every confirmation stores its launches' rounds on its trial
(``confirm_launches``: the fresh launches of ``tune``, or the one in-process
launch of the in-loop tuner and of ``tune`` under torchrun, marked ``picked``
when that process's race chose the plan among several). From them:
- the spread between launches the study has seen
  (:func:`study_spread`, [Note: Between-launch spread] in
  ``planner.statistics.launches``): the cluster's calibration or its
  device's prior, pooled with every plan measured in two fresh launches or
  more;
- the chain behind a re-confirmed plan (:func:`chain_of`): a later job races
  the study's recommendation, or its provisional plan, again as a fresh trial
  that ``reconfirms`` the trial it came from, and that trial may itself
  re-confirm an older one; the chain's launches are the same plan against
  the same job's default, each in its own process, and the new launch is
  confirmed together with them, at the level the chain's earlier looks leave
  ([Note: Looks spent over the restart chain] in ``planner.statistics.looks``),
  over the horizon its first look fixed.
Torch-free: built from trial records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from planner.artifacts.plan import Plan
from planner.artifacts.tables import MeasureTable
from planner.statistics.launches import DEFAULT_SPREAD, ConfirmLaunch, Spread, launch_estimate
from planner.statistics.looks import MAX_LAUNCHES, Looks
from planner.statistics.schedule import Schedule
from planner.statistics.verdict import Chain, Verdict
from planner.study.candidates import plan_key
from planner.study.cluster_spread import ClusterSpread
from planner.study.records import MeasuredTrialRecord


def own_launches(record: MeasuredTrialRecord) -> list[ConfirmLaunch]:
    """The trial's own confirmation launches (none if it was not confirmed)."""
    return list(record.confirm_launches or [])


def study_spread(records: Iterable[MeasuredTrialRecord], exclude: str | None = None,
                 start: Spread = DEFAULT_SPREAD) -> Spread:
    """The study's between-launch spread: ``start`` (the cluster's calibration, else its device's prior:
    ``planner.study.cluster_spread``) pooled with each plan's fresh launches (grouped by ``plan_key``, every trial
    of it; a race's own process is biased, [Note: The race's own process]), leaving out plan ``exclude`` (the plan
    being confirmed, whose own launches its confirmation adds). A verdict never uses less than the cluster's floor
    ([Note: The spread is floored at the cluster's bound])."""
    groups: dict[str, list[ConfirmLaunch]] = {}
    for r in records:
        if r.plan_key and r.plan_key != exclude and r.confirm_launches:
            groups.setdefault(r.plan_key, []).extend(x for x in own_launches(r) if not x.picked)
    return start.updated([[launch_estimate(x.plan_ms, x.default_ms) for x in g] for g in groups.values()])


def chain_of(by_number: Mapping[int, MeasuredTrialRecord], reconfirms: int | None) -> Chain:
    """The chain of trials that ``reconfirms`` starts: their launches (oldest first) and the looks their
    confirmations were ([Note: Looks spent over the restart chain]); a trial in the chain that is missing ends
    it. A look counts by its fresh launches; one that called the plan faster (total time) makes every later look
    a re-confirmation."""
    trials: list[MeasuredTrialRecord] = []
    seen: set[int] = set()
    while reconfirms is not None and reconfirms in by_number and reconfirms not in seen:
        seen.add(reconfirms)
        trials.insert(0, by_number[reconfirms])
        reconfirms = by_number[reconfirms].reconfirms
    launches: list[ConfirmLaunch] = []
    earlier: list[int] = []
    reconfirming, seen, horizon = False, 0, None
    for r in trials:
        launches += own_launches(r)
        c = r.confirmation
        if c is None:
            continue
        if horizon is None:  # fixed at the chain's first look
            horizon = c.horizon or MAX_LAUNCHES
        seen = max(seen, c.fresh_launches)
        if c.verdict == Verdict.FASTER and c.total_time:
            reconfirming = True
        elif not reconfirming and c.fresh_launches > (earlier[-1] if earlier else 0):
            earlier.append(c.fresh_launches)
    return Chain(tuple(launches), Looks(tuple(earlier), reconfirming, seen, horizon or MAX_LAUNCHES))


def round_schedule(records: Iterable[MeasuredTrialRecord], kept: list[tuple[Plan, int | None]],
                   measure: MeasureTable, confirm_launches: int | None, cluster: ClusterSpread,
                   on_drop: Callable[[int, int], None] | None = None) -> Schedule:
    """The schedule of a round's race and confirmation (``planner.statistics.schedule``) on the study's evidence:
    the spread between launches it has seen (:func:`study_spread`, the cluster's floor under it), and each
    re-confirmed plan's chain of earlier launches (:func:`chain_of`).

    Args:
        records: every trial of the study.
        kept: the round's plans that applied and fit, the baseline first, each with the trial it re-confirms
            (``None``: none).
        confirm_launches: the fresh launches the survivor is confirmed in (``TuningSession``'s).
        on_drop: called with a dropped plan's position and the rounds run.
    """
    records = list(records)
    by_number = {r.number: r for r in records if r.number is not None}
    chains = {j: chain_of(by_number, reconfirms) for j, (_, reconfirms) in enumerate(kept)}
    # The plan re-confirmed here adds its own launches to its confirmation: the study's spread leaves them out.
    again = next((plan for plan, reconfirms in kept if reconfirms is not None), None)
    spread = study_spread(records, plan_key(again) if again is not None else None, cluster.spread)
    confirm = measure.confirm_settings(confirm_launches, spread, cluster.floor)
    return Schedule(len(kept), measure.race_settings(), confirm, on_drop=on_drop,
                    earlier={j: chain for j, chain in chains.items() if chain.launches})
