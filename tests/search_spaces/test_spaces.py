"""Search spaces: every space builds valid, distinct plans; per-module lists and grouping of large models."""

from __future__ import annotations

import optuna
import pytest

from planner.artifacts.names import SpaceName
from planner.errors import SpaceParamsError, StudyConfigError
from planner.simulation.parameters import simulate
from planner.study.search_space import SearchSpace
from search_spaces import SPACES, assign, get_space, per_module, uniform

UNIFORM, PER_MODULE, ASSIGN = (SPACES[n] for n in (SpaceName.UNIFORM, SpaceName.PER_MODULE, SpaceName.ASSIGN))


def test_search_spaces_build_valid_distinct_plans(make_profile):
    p = make_profile(n_blocks=5)
    for space in (UNIFORM, PER_MODULE, ASSIGN):
        plans = [space.suggest(optuna.trial.FixedTrial(params), p) for params in space.grid(p)]
        assert plans[0].is_default_for(p)
        for plan in plans:
            plan.validate()
        # assign: the uniform grid, then prefetch 1 sync/async and 2 async keeping the last 1..4 of 5 blocks
        expected = {UNIFORM: 48, PER_MODULE: 24, ASSIGN: 48 + 3 * 4}[space]
        assert len({pl.behaviour_key() for pl in plans}) == len(plans) == expected
    # per_module: one module's own window, others untouched
    params = PER_MODULE.grid(p)[0] | {"fwd:b1": 3, "bwd:b3": 2}
    plan = PER_MODULE.suggest(optuna.trial.FixedTrial(params), p)
    assert plan.modules["b1"].forward_prefetch == ("b2", "b3", "b4")
    assert plan.modules["b3"].backward_prefetch == ("b2", "b1")
    assert plan.modules["b0"].forward_prefetch == ()
    assert plan.modules[""].forward_prefetch == ()
    # the root prefetches forward the first blocks, backward the last blocks
    root = uniform.build(p, 2, 2).modules[""]
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
    params = PER_MODULE.grid(p)[0] | {f"fwd:{groups[1][0]}": 2}
    plan = PER_MODULE.suggest(optuna.trial.FixedTrial(params), p)
    for f in groups[1][1]:
        assert len(plan.modules[f].forward_prefetch) == 2
    assert plan.modules["b1"].forward_prefetch == () and plan.modules["b5"].forward_prefetch == ()
    small = make_profile(n_blocks=5)
    assert [name for name, _ in per_module.groups(small)] == ["<root>", "b0", "b1", "b2", "b3", "b4"]


def test_the_registry_has_one_search_space_per_name():
    assert set(SPACES) == set(SpaceName)
    for name, space in SPACES.items():
        assert isinstance(space, SearchSpace) and space.name == name
        assert get_space(str(name)) is space


def test_build_is_suggest_on_the_stored_parameters_and_refuses_others_in_one_error(make_profile):
    p, other = make_profile(n_blocks=3), make_profile(n_blocks=5)
    for name, space in SPACES.items():
        params = space.grid(p)[-1]
        assert space.build(params, p) == space.suggest(optuna.trial.FixedTrial(params), p), name
        assert set(space.distributions(params, p)) <= set(params)
        missing = dict(params)
        missing.pop(sorted(missing)[0])
        out_of_range = {k: (99 if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in params.items()}
        for bad in (missing, out_of_range):
            with pytest.raises(SpaceParamsError, match=f"do not build a plan in the {name} space"):
                space.build(bad, p)
    # the parameters of a smaller model lack the per-module ones of the blocks it does not have
    with pytest.raises(SpaceParamsError, match="fwd:b3"):
        PER_MODULE.build(PER_MODULE.grid(p)[0] | {"fwd:b1": 2}, other)


def test_every_space_starts_its_grid_with_fsdp2_default(make_profile):
    p = make_profile(n_blocks=3)
    for name, space in SPACES.items():
        first = space.suggest(optuna.trial.FixedTrial(space.grid(p)[0]), p)
        assert first.is_default_for(p), name


def test_unknown_space_names_the_choices():
    with pytest.raises(
        StudyConfigError, match="unknown search space 'nope'; choose one of assign, per_module, uniform"
    ):
        get_space("nope")


def test_assign_grid_behaves_as_the_uniform_grid(make_profile):
    """Uniform depth d is every issue distance d: the same simulated step and peak, point for point."""
    p = make_profile(n_blocks=5)
    assert ASSIGN.grid(p)[:48] == ASSIGN.uniform_grid(p)
    keep = ASSIGN.suggest(optuna.trial.FixedTrial(ASSIGN.grid(p)[48 + 1]), p)  # prefetch 1 async, last 2 kept
    assert [f for f, m in keep.modules.items() if not m.reshard_after_forward] == ["", "b3", "b4"]
    for a, u in zip(ASSIGN.uniform_grid(p), UNIFORM.grid(p), strict=True):
        pa, pu = (s.suggest(optuna.trial.FixedTrial(g), p) for s, g in ((ASSIGN, a), (UNIFORM, u)))
        ra, ru = simulate(p, pa), simulate(p, pu)
        assert (ra.step_ms, ra.peak_bytes) == (ru.step_ms, ru.peak_bytes), u
    assert len({ASSIGN.suggest(optuna.trial.FixedTrial(g), p).behaviour_key() for g in ASSIGN.uniform_grid(p)}) == 48


def test_assign_maps_distances_onto_issuers(make_profile):
    """Forward distance k: appended to the list of the module k before it (the root when fewer precede it);
    backward alike in reverse post-forward order; resharding per module, the root keeps its parameters."""
    p = make_profile(n_blocks=5)
    params = ASSIGN.grid(p)[0] | {
        "fwd:b3": 2,
        "fwd:b1": 3,
        "fwd:b4": 1,
        "bwd:b1": 3,
        "raf:b2": False,
        "raf:<root>": True,
    }
    plan = ASSIGN.suggest(optuna.trial.FixedTrial(params), p)
    m = plan.modules
    assert m[""].forward_prefetch == ("b1",)  # b1 at distance 3 has only 2 modules before it: the root issues it
    assert m["b1"].forward_prefetch == ("b3",) and m["b3"].forward_prefetch == ("b4",)
    assert m["b0"].forward_prefetch == m["b2"].forward_prefetch == m["b4"].forward_prefetch == ()
    # backward order: root, b4, b3, b2, b1, b0. b1 at distance 3 is issued by b4; the rest at 1 by their predecessor
    assert m["b4"].backward_prefetch == ("b3", "b1") and m["b2"].backward_prefetch == ()
    assert m[""].backward_prefetch == ("b4",) and m["b1"].backward_prefetch == ("b0",)
    assert not m["b2"].reshard_after_forward and m["b3"].reshard_after_forward
    assert not m[""].reshard_after_forward  # as wrapped
    # a module kept unsharded is predicted to hold its bytes: more memory, one backward all-gather less
    default = simulate(p, plan.__class__.default(p))
    kept = simulate(p, assign.keep_unsharded(plan.__class__.default(p), p, 2))
    assert kept.comm_ms == pytest.approx(default.comm_ms - 2 * 5.0)
    assert kept.peak_bytes == default.peak_bytes  # b4, b3 (2U) held while b2 is gathered: as the default's 2U + buffer
    every = simulate(p, assign.keep_unsharded(plan.__class__.default(p), p, 5))
    assert every.peak_unsharded_bytes == 5 * 1000 and every.peak_bytes > default.peak_bytes


def test_assign_offers_gpu_and_accumulation_knobs_only_where_they_act(make_profile):
    import dataclasses

    cpu = make_profile(n_blocks=2)
    assert "reduce_scatter_max_input_buffers" not in ASSIGN.grid(cpu)[0]
    assert "reshard_after_backward" not in ASSIGN.grid(cpu)[0]
    gpu = dataclasses.replace(make_profile(n_blocks=2, device="cuda"), microbatches=2)
    params = ASSIGN.grid(gpu)[0] | {"reduce_scatter_max_input_buffers": 2, "reshard_after_backward": False}
    plan = ASSIGN.suggest(optuna.trial.FixedTrial(params), gpu)
    assert plan.reduce_scatter_max_input_buffers == 2 and plan.reshard_after_backward is False


def test_assign_skips_backward_all_gathers_only_where_backward_reads_no_parameter(make_profile):
    import dataclasses

    p = make_profile(n_blocks=3)
    assert not any(k.startswith("uib:") for k in ASSIGN.grid(p)[0])  # every block saves its parameters
    embedding = dataclasses.replace(p.modules["b0"], needs_parameters_in_backward=False)
    p = dataclasses.replace(p, modules={**p.modules, "b0": embedding})
    assert [k for k in ASSIGN.grid(p)[0] if k.startswith("uib:")] == ["uib:b0"]
    params = ASSIGN.grid(p)[0] | {"uib:b0": False, "separate_reduce_scatter_group": True}
    plan = ASSIGN.suggest(optuna.trial.FixedTrial(params), p)
    assert [f for f, m in plan.modules.items() if not m.knobs.unshard_in_backward] == ["b0"]
    assert plan.separate_reduce_scatter_group is True
    assert (
        simulate(p, plan).comm_ms < simulate(p, ASSIGN.suggest(optuna.trial.FixedTrial(ASSIGN.grid(p)[0]), p)).comm_ms
    )


def test_a_module_outside_the_roots_forward_keeps_fsdp2s_default(make_profile):
    """A module the recorder saw outside the root's forward (torchtitan's ``ChunkedLossWrapper`` calls ``lm_head``
    from the loss) is in neither order: every space's plans leave it without prefetch, no module prefetches it,
    and the simulator runs them."""
    import dataclasses

    p = make_profile(n_blocks=4)
    outside = "b3"
    p = dataclasses.replace(p, pre_forward_order=tuple(f for f in p.pre_forward_order if f != outside),
                            post_forward_order=tuple(f for f in p.post_forward_order if f != outside))
    assert outside in p.fingerprint.module_fqns
    for space in (UNIFORM, PER_MODULE, ASSIGN):
        for params in space.grid(p):
            plan = space.suggest(optuna.trial.FixedTrial(params), p)
            plan.validate()
            assert plan.modules[outside].forward_prefetch == plan.modules[outside].backward_prefetch == ()
            assert all(outside not in m.forward_prefetch + m.backward_prefetch for m in plan.modules.values())
            assert simulate(p, plan).step_ms > 0
