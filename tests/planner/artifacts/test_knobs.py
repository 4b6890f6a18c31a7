"""The knob registry (``planner.artifacts.knobs``): every declared knob round-trips through Plan JSON, is
sampled by the ``assign`` space, and moves the simulator somewhere."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from planner.artifacts.knobs import KNOBS, MODULE_KNOBS, PLAN_KNOBS, Knob, KnobValues, Scope, Written, position
from planner.artifacts.plan import Plan
from planner.errors import PlanFormatError
from planner.simulation.parameters import simulate
from planner.testing import synthetic_profile
from search_spaces import uniform
from search_spaces.assign import AssignSpace


def _other(k: Knob):
    """A value of ``k`` other than FSDP2's default."""
    return next(v for v in k.choices if v != k.default)


def _with(plan: Plan, k: Knob, value) -> Plan:
    if k.scope is Scope.MODULE:
        return dataclasses.replace(plan, modules={f: m.with_knobs(**{k.name: value}) for f, m in plan.modules.items()})
    return plan.with_knobs(**{k.name: value})


def _profiles():
    """Profiles that put each kind of knob to work: CPU and GPU, with and without gradient accumulation, with
    modules whose parameters backward does not read, with stream work after the optimizer step."""
    for device, microbatches in itertools.product(("cpu", "cuda"), (1, 2)):
        p = synthetic_profile(n_blocks=3, ag=[5.0, 15.0, 10.0], rs=30.0, device=device, grad_bytes=500,
                              activation_bytes=200, unsharded_bytes=2000)
        modules = {f: dataclasses.replace(m, needs_parameters_in_backward=False) for f, m in p.modules.items()}
        yield dataclasses.replace(p, microbatches=microbatches, modules=modules, post_optimizer_ms=8.0)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_every_knob_round_trips_through_plan_json(k):
    p = synthetic_profile(n_blocks=2)
    plan = _with(Plan.default(p), k, _other(k))
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.behaviour_key() != Plan.default(p).behaviour_key()
    assert Plan.from_json(Plan.default(p).to_json()) == Plan.default(p)
    default_text = Plan.default(p).to_json()
    assert (f'"{k.name}"' in default_text) == (k.written is not Written.CHANGED)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_every_knob_is_simulated(k):
    """Some profile and base plan where the knob's other value changes the prediction: a declared knob the kernel
    does not read fails here."""
    moved = []
    for p in _profiles():
        for base in (Plan.default(p), uniform.build(p, 1, 2).with_knobs(unshard_async_op=True)):
            a, b = simulate(p, base), simulate(p, _with(base, k, _other(k)))
            moved.append((a.step_ms, a.peak_bytes, a.reserved_peak_bytes) != (b.step_ms, b.peak_bytes,
                                                                                 b.reserved_peak_bytes))
    assert any(moved), f"{k.name} changes no prediction: write its rule in planner.simulation._kernel"


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_the_assign_space_samples_every_knob_with_its_declared_choices(k):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    seen = set()
    for p in _profiles():
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        for _ in range(12):
            plan = AssignSpace().suggest(study.ask(), p)
            values = [m.knobs[k.name] for m in plan.modules.values()] if k.scope is Scope.MODULE else [
                plan.knobs[k.name]]
            seen.update(values)
    assert seen == set(k.choices)


def test_knob_values_refuse_unknown_knobs_wrong_types_and_the_other_scope():
    with pytest.raises(PlanFormatError, match="'prefetch_depth' is not an FSDP2 knob"):
        KnobValues(prefetch_depth=2)
    with pytest.raises(PlanFormatError, match="reduce_scatter_max_input_buffers must be >= 1, found 0"):
        KnobValues(reduce_scatter_max_input_buffers=0)
    with pytest.raises(PlanFormatError, match="must be an integer, found True"):
        KnobValues(reduce_scatter_max_input_buffers=True)
    with pytest.raises(PlanFormatError, match="unshard_in_backward is a module knob"):
        KnobValues(unshard_in_backward=False)
    assert KnobValues(unshard_async_op=False) == KnobValues() and hash(KnobValues(unshard_async_op=False)) == hash(
        KnobValues())


def test_positions_index_the_scope_the_kernel_reads():
    assert [position(k.name) for k in PLAN_KNOBS] == list(range(len(PLAN_KNOBS)))
    assert [position(k.name) for k in MODULE_KNOBS] == list(range(len(MODULE_KNOBS)))
    assert {k.name for k in KNOBS} == {k.name for k in (*PLAN_KNOBS, *MODULE_KNOBS)}


def test_a_knob_newer_than_the_profiles_torch_is_never_sampled():
    """``Knob.since``: FSDP2 in torch 2.11 (the GPU machines') has no ``set_reduce_scatter_max_input_buffers`` nor
    ``set_separate_reduce_scatter_group``; a profile recorded there never samples them, one from 2.13 does."""
    from planner.artifacts.knobs import KNOBS, available, grid_params, release_line, sampled
    from planner.artifacts.names import SpaceName

    assert release_line("2.11.0+cu130") == (2, 11) and release_line("2.14.1") == (2, 14)
    assert release_line("test") is None  # a synthetic profile's: every knob available
    newer = {k.name for k in KNOBS if not available(k, "2.11.0+cu130")}
    assert newer == {"reduce_scatter_max_input_buffers", "separate_reduce_scatter_group"}
    for k in KNOBS:
        assert available(k, "2.13.0") and available(k, None)
        assert not sampled(k, "cuda", 2, True, SpaceName.ASSIGN, "2.11.0+cu130") or k.name not in newer
    old = {name for params in grid_params("cuda", 2, SpaceName.ASSIGN, "2.11.0+cu130") for name in params}
    new = {name for params in grid_params("cuda", 2, SpaceName.ASSIGN, "2.13.0") for name in params}
    assert old == new - newer and newer <= new
