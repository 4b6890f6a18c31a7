"""The in-loop tuner's restart chain, decided as the study decides it (no ranks, no storage).

Each start is one process: its race and confirmation run through
``planner.statistics.schedule.Schedule`` on synthetic steps; the chain's
earlier launches and looks come from ``planner.study.evidence.chain_of``
over the trials' records, and what is applied from
``planner.study.recommendation.JobVerdict``. Candidates have nothing to gain:
every plan's step is FSDP2's default's, times its offset in that process
(``N(0, tau^2)`` on the log scale, per plan and per process), a slowness the
round's steps share, and each step's own noise. The first start races the
candidates and confirms its survivor in the same process (the race's own
process); each later start races the plan against the default alone and
confirms it there, one fresh launch more, while the verdict is provisional.
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.statistics.verdict import Verdict
from planner.testing.chains import at_most, restart_chain

CHAINS = 2000


@pytest.mark.parametrize("candidates", [3, 5])
def test_the_restart_chain_of_plans_with_nothing_to_gain_is_ever_faster_at_most_2_5_percent(candidates):
    """The survivor of the first start's race carries that process's luck (its offset averages -2% to -4%, the hard
    case); its chain of re-confirmations is ever called faster, and so applied, at most 2.5% of the time (+3 standard
    errors)."""
    rng = np.random.default_rng(candidates)
    chains = [restart_chain(rng, candidates) for _ in range(CHAINS)]
    offsets = [o for _, o in chains if o is not None]
    assert np.mean(offsets) < -0.02  # the race picked on the process's luck
    assert sum(Verdict.PROVISIONAL == v[0] for v, _ in chains if v) > CHAINS // 5  # the chain goes on, often
    assert max(len(v) for v, _ in chains) == 4  # the picked launch, then up to 3 fresh ones
    ever = sum(Verdict.FASTER in v for v, _ in chains)
    assert ever <= at_most(0.025, CHAINS)
