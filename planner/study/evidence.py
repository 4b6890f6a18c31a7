"""A study's evidence across launches: each plan's earlier confirmation launches, and the spread between launches.

Every confirmation stores its launches' rounds on its trial
(``confirm_launches``: the fresh launches of ``tune``, or the one in-process
launch of the in-loop tuner and of ``tune`` under torchrun). From them:
- the spread between launches the study has seen
  (:func:`study_spread`, [Note: Between-launch spread] in
  ``planner.statistics.verdict``): the conservative prior pooled with every
  plan measured in two launches or more;
- the launches behind a re-confirmed recommendation (:func:`earlier_launches`):
  a later job races the study's recommendation again as a fresh trial that
  ``reconfirms`` the trial it was recommended by, and that trial may itself
  re-confirm an older one; the chain's launches are the same plan against
  the same job's default, each in its own process, and the new launch is
  confirmed together with them ([Note: Provisional verdicts]).
Torch-free: built from trial records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from planner.statistics.schedule import Launches
from planner.statistics.verdict import DEFAULT_SPREAD, Spread, launch_estimate
from planner.study.records import MeasuredTrialRecord


def own_launches(record: MeasuredTrialRecord) -> Launches:
    """The trial's own confirmation launches as ``(plan_ms, default_ms)`` pairs (none if it was not confirmed)."""
    return [(list(x.plan_ms), list(x.default_ms)) for x in record.confirm_launches or []]


def study_spread(records: Iterable[MeasuredTrialRecord], exclude: str | None = None) -> Spread:
    """The study's between-launch spread: :data:`~planner.statistics.verdict.DEFAULT_SPREAD` pooled with each plan's
    launches (grouped by ``plan_key``, every trial of it), leaving out plan ``exclude`` (the plan being confirmed,
    whose own launches its confirmation adds)."""
    groups: dict[str, Launches] = {}
    for r in records:
        if r.plan_key and r.plan_key != exclude and r.confirm_launches:
            groups.setdefault(r.plan_key, []).extend(own_launches(r))
    return DEFAULT_SPREAD.updated([[launch_estimate(p, d) for p, d in g] for g in groups.values()])


def earlier_launches(by_number: Mapping[int, MeasuredTrialRecord], reconfirms: int | None) -> Launches:
    """The launches of the chain of trials that ``reconfirms`` starts (oldest first); a trial in the chain that
    is missing ends it."""
    out: Launches = []
    seen: set[int] = set()
    while reconfirms is not None and reconfirms in by_number and reconfirms not in seen:
        seen.add(reconfirms)
        record = by_number[reconfirms]
        out = own_launches(record) + out
        reconfirms = record.reconfirms
    return out
