"""planner.study.candidates.in_round_order: the round's candidates in one stated order, each plan once."""

from __future__ import annotations

from planner.study.candidates import Candidate, in_round_order
from search_spaces import uniform


def _candidate(profile, depth: int, **kw) -> Candidate:
    """A plan that prefetches the next ``depth`` modules in forward (0: FSDP2's default)."""
    return Candidate({"d": depth}, {}, uniform.build(profile, depth, 1), 10.0 - depth, 0, **kw)


def test_the_round_order_is_user_default_predicted_recommended_resumed_simulated(make_profile):
    p = make_profile(n_blocks=4)
    default, user, predicted, recommended = (_candidate(p, d) for d in (0, 1, 2, 3))
    resumed, simulated = [_candidate(p, 1, reconfirms=7)], [_candidate(p, 3), _candidate(p, 2), _candidate(p, 1)]
    assert default.plan.is_default_for(p)

    order = in_round_order(default, simulated, user=user, predicted=predicted, recommended=recommended,
                           resumed=resumed)
    assert order == [user, default, predicted, recommended]  # each plan once, at its first place

    alone = in_round_order(default, [_candidate(p, 2), _candidate(p, 3)], resumed=[_candidate(p, 1)])
    assert [c.params["d"] for c in alone] == [0, 1, 2, 3]
    assert in_round_order(default, [_candidate(p, 2)], default_retried=True) == [_candidate(p, 2)]
    assert in_round_order(None, [], predicted=predicted) == [predicted]
