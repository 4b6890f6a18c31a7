"""planner.study.candidates: the one candidate constructor (the budget inside it), and in_round_order: the round's
candidates in one stated order, each plan once."""

from __future__ import annotations

import dataclasses

from planner.artifacts.memory_budget import PeakBudget
from planner.study.candidates import Candidate, candidate, in_round_order
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


def test_one_constructor_predicts_a_candidate_and_applies_the_budget(make_profile):
    """``candidate`` simulates the plan (or takes a trial's prediction) and is ``None`` for a plan predicted over the
    budget: the sites that race a stored trial again (interrupted, the recommendation) leave such a plan out by it."""
    from planner.simulation.parameters import simulator_for

    p = make_profile(n_blocks=4)
    simulator = simulator_for(p)
    plan = uniform.build(p, 2, 1)
    predicted = simulator.run(plan)
    c = candidate(plan, simulator, {"d": 2}, reconfirms=5)
    assert (c.predicted_ms, c.predicted_peak_bytes, c.params, c.reconfirms) == (
        predicted.step_ms, predicted.peak_bytes, {"d": 2}, 5)
    assert candidate(plan, simulator, budget=PeakBudget(predicted.peak_bytes)) == dataclasses.replace(
        c, params={}, reconfirms=None)
    assert candidate(plan, simulator, budget=PeakBudget(predicted.peak_bytes - 1)) is None
    assert candidate(plan, prediction=(1.0, 10), budget=PeakBudget(10)).predicted_ms == 1.0  # a trial's own
    assert candidate(plan, prediction=(1.0, 11), budget=PeakBudget(10)) is None
    # the simulator's error on the baseline is charged to every prediction; NCCL's buffers to a plan that adds a
    # communicator (its reduce-scatter's own group)
    assert candidate(plan, prediction=(1.0, 10), budget=PeakBudget(12, error_bytes=3)) is None
    separate = plan.with_knobs(separate_reduce_scatter_group=True)
    assert candidate(plan, prediction=(1.0, 10), budget=PeakBudget(12, communicator_bytes=5)) is not None
    assert candidate(separate, prediction=(1.0, 10), budget=PeakBudget(12, communicator_bytes=5)) is None
