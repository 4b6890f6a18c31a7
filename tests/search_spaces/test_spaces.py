"""Search spaces: every space builds valid, distinct plans; per-module lists and grouping of large models."""

from __future__ import annotations

import optuna
import pytest

from planner.errors import StudyConfigError
from search_spaces import SPACES, get_space, per_module, uniform


def test_search_spaces_build_valid_distinct_plans(make_profile):
    p = make_profile(n_blocks=5)
    for space in (uniform, per_module):
        plans = [space.suggest(optuna.trial.FixedTrial(params), p) for params in space.grid(p)]
        assert plans[0].is_default_for(p)
        for plan in plans:
            plan.validate()
        assert len({pl.behaviour_key() for pl in plans}) == len(plans) == (48 if space is uniform else 24)
    # per_module: one module's own window, others untouched
    params = per_module.grid(p)[0] | {"fwd:b1": 3, "bwd:b3": 2}
    plan = per_module.suggest(optuna.trial.FixedTrial(params), p)
    assert plan.modules["b1"].forward_prefetch == ("b2", "b3", "b4")
    assert plan.modules["b3"].backward_prefetch == ("b2", "b1")
    assert plan.modules["b0"].forward_prefetch == ()
    assert plan.modules[""].forward_prefetch == ()
    # the root prefetches forward the first blocks, backward the last blocks
    root = uniform.build(p, 2, 2, False).modules[""]
    assert root.forward_prefetch == ("b0", "b1") and root.backward_prefetch == ("b4", "b3")


def test_per_module_groups_large_models(make_profile):
    """Beyond MAX_GROUPS modules, consecutive modules share a parameter."""
    p = make_profile(n_blocks=199)  # 200 modules with the root
    groups = per_module.groups(p)
    assert len(groups) == per_module.MAX_GROUPS
    members = [f for _, ms in groups for f in ms]
    assert members == list(p.pre_forward_order)  # every module once, in forward order
    # 200 modules in 64 groups: group j holds modules [200j//64, 200(j+1)//64)
    assert groups[0] == ("<root>..b1", ["", "b0", "b1"])
    assert groups[1] == ("b2..b4", ["b2", "b3", "b4"])
    params = per_module.grid(p)[0] | {f"fwd:{groups[1][0]}": 2}
    plan = per_module.suggest(optuna.trial.FixedTrial(params), p)
    for f in groups[1][1]:
        assert len(plan.modules[f].forward_prefetch) == 2
    assert plan.modules["b1"].forward_prefetch == () and plan.modules["b5"].forward_prefetch == ()
    small = make_profile(n_blocks=5)
    assert [name for name, _ in per_module.groups(small)] == ["<root>", "b0", "b1", "b2", "b3", "b4"]


def test_every_space_starts_its_grid_with_fsdp2_default(make_profile):
    p = make_profile(n_blocks=3)
    for name, space in SPACES.items():
        first = space.suggest(optuna.trial.FixedTrial(space.grid(p)[0]), p)
        assert first.is_default_for(p), name


def test_unknown_space_names_the_choices():
    with pytest.raises(StudyConfigError, match="unknown search space 'nope'; choose one of per_module, uniform"):
        get_space("nope")
