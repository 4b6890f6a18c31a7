"""runtime/apply.py on a real one-rank FSDP2 model. ``apply_plan`` applies every declared knob
(``planner.artifacts.knobs.KNOBS``) through its setter, on the modules its scope names, with the plan's value: a knob
declared but not applied fails here. A training job asks the study for its plan (``load_best_plan``), read-only."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from planner.artifacts.knobs import KNOBS, Scope
from planner.errors import UnsupportedPlanError
from planner.testing import make_study_db, synthetic_profile
from runtime.apply import ROOT_SETTERS, apply_plan, load_best_plan, model_fingerprint
from runtime.ranks.torch_private import prefetch_counts, unshard_async_op
from runtime.reference_workloads import mlp
from runtime.workload import fsdp_modules
from search_spaces import get_space
from tests.runtime.models import sharded_mlp


def _other(k):
    return next(v for v in k.choices if v != k.default)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_the_running_torch_has_every_knobs_setter(k):
    assert k.name in ROOT_SETTERS or hasattr(FSDPModule, k.setter), k.setter


def test_apply_plan_calls_each_knobs_setter_with_the_plans_value(mesh, monkeypatch):
    from planner.artifacts.plan import ModulePlan, Plan

    workload = mlp(mesh, dim=16, layers=2)
    model = workload.model
    fqns = [fqn for fqn, _ in fsdp_modules(model)]
    calls: list[tuple[str, str, object]] = []
    names = {id(m): fqn for fqn, m in fsdp_modules(model)}
    for k in KNOBS:
        if k.name in ROOT_SETTERS:
            monkeypatch.setitem(ROOT_SETTERS, k.name, lambda m, k=k: lambda v: calls.append((k.name, "root", v)))
        else:
            monkeypatch.setattr(FSDPModule, k.setter, lambda self, v, k=k: calls.append((k.name, names[id(self)], v)),
                                raising=True)
    plan = Plan(model_fingerprint(model), {f: ModulePlan() for f in fqns})
    plan = plan.with_knobs(**{k.name: _other(k) for k in KNOBS if k.scope is not Scope.MODULE})
    plan = dataclasses.replace(plan, modules={f: m.with_knobs(**{k.name: _other(k) for k in KNOBS
                                                                 if k.scope is Scope.MODULE})
                                              for f, m in plan.modules.items()})
    apply_plan(model, plan)
    for k in KNOBS:
        where = {w for name, w, v in calls if name == k.name and v == _other(k)}
        expected = {"root"} if k.name in ROOT_SETTERS else {fqns[0]} if k.scope is Scope.ROOT else set(fqns)
        assert where == expected, (k.name, where)


def test_a_knob_the_running_torch_lacks_is_refused_before_anything_is_applied(mesh, monkeypatch):
    from planner.artifacts.plan import Plan

    workload = mlp(mesh, dim=16, layers=2)
    k = next(k for k in KNOBS if k.name not in ROOT_SETTERS and k.scope is not Scope.MODULE)
    monkeypatch.delattr(FSDPModule, k.setter)
    plan = Plan(model_fingerprint(workload.model), {}).with_knobs(**{k.name: _other(k)})
    with pytest.raises(UnsupportedPlanError, match=f"the plan sets {k.name} = .* has no FSDPModule.{k.setter}"):
        apply_plan(workload.model, plan)
    apply_plan(workload.model, Plan(model_fingerprint(workload.model), {}))  # FSDP2's default needs no setter


def _model(mesh, layers):
    return sharded_mlp(mesh, layers)


def test_the_best_faster_plan_for_this_model_then_the_default_for_another(mesh, tmp_path, caplog):
    model = _model(mesh, 3)
    fingerprint = model_fingerprint(model)
    profile = dataclasses.replace(synthetic_profile(blocks=list(fingerprint.module_fqns[1:])), fingerprint=fingerprint)
    url = make_study_db(
        tmp_path, profile, sim_trials=20, space=get_space("uniform")
    )  # trial 1 (80 ms) is confirmed faster than 100 ms
    db = tmp_path / "s.db"
    before = "\n".join(sqlite3.connect(db).iterdump())
    with caplog.at_level(logging.INFO, logger="runtime.apply"):
        plan = load_best_plan(url, "s", model)
    assert plan.provenance.verdict == "faster" and plan.provenance.measured_ratio == 0.8
    assert "confirmed faster than FSDP2's default by job test: total-time ratio 0.800" in caplog.text
    apply_plan(model, plan)
    assert unshard_async_op(model) == plan.unshard_async_op
    assert prefetch_counts(model.blocks[0])[0] == len(plan.modules["blocks.0"].forward_prefetch)
    assert "\n".join(sqlite3.connect(db).iterdump()) == before  # read-only: nothing written

    other = _model(mesh, 2)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runtime.apply"):
        default = load_best_plan(url, "s", other)
    assert default.modules == {} and default.unshard_async_op is False  # every module as wrapped
    assert "FSDP2's default: study 's' has no concluded tuning job for this model and world size" in caplog.text
    apply_plan(other, default)
    assert unshard_async_op(other) is False


def test_root_setters_are_keyed_by_declared_root_knobs():
    from planner.artifacts.knobs import knob

    assert all(knob(name).scope is Scope.ROOT for name in ROOT_SETTERS)


def test_post_optim_event_hands_fsdp2_an_event_after_every_optimizer_step(mesh, monkeypatch):
    """A plan with ``post_optim_event`` registers the optimizer step post-hook: each ``optimizer.step()`` hands
    FSDP2 the event recorded after it; FSDP2's default plan removes the hook. (A CPU device records no event: the
    event is stood in for here.)"""
    import runtime.post_optim as post_optim
    from planner.artifacts.plan import Plan

    workload = mlp(mesh, dim=16, layers=2)
    model = workload.model
    events = iter(range(1000))
    monkeypatch.setattr(post_optim, "event_after_step", lambda m: next(events))
    handed: list[object] = []
    monkeypatch.setattr(type(model), "set_post_optim_event", lambda self, event: handed.append(event), raising=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = Plan(model_fingerprint(model), {})
    apply_plan(model, plan.with_knobs(post_optim_event=True))
    for _ in range(2):
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    assert handed == [0, 1] and post_optim.hands_events(model)
    apply_plan(model, plan)
    optimizer.step()
    assert handed == [0, 1] and not post_optim.hands_events(model)


def test_without_an_event_fsdp2_keeps_its_own_wait(mesh):
    """On a CPU device the hook records nothing and hands nothing: FSDP2's root waits on the current stream, and
    the step runs."""
    import runtime.post_optim as post_optim
    from planner.artifacts.plan import Plan

    workload = mlp(mesh, dim=16, layers=2)
    model = workload.model
    assert post_optim.event_after_step(model) is None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    apply_plan(model, Plan(model_fingerprint(model), {}).with_knobs(post_optim_event=True))
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    model(torch.randn(4, 16)).sum().backward()
    apply_plan(model, Plan(model_fingerprint(model), {}))


def test_the_post_optim_hook_leaves_with_its_model(mesh, monkeypatch):
    """A model dropped while its plan sets ``post_optim_event``: its hook does nothing in the optimizer steps after
    (which iterate over the hooks: no hook may remove itself there), and the next plan applied removes it."""
    import gc

    import runtime.post_optim as post_optim
    from planner.artifacts.plan import Plan

    handles = []
    register = post_optim.register_optimizer_step_post_hook
    monkeypatch.setattr(post_optim, "register_optimizer_step_post_hook", lambda hook: handles.append(register(hook))
                        or handles[-1])
    model = mlp(mesh, dim=16, layers=2).model
    apply_plan(model, Plan(model_fingerprint(model), {}).with_knobs(post_optim_event=True))
    (handle,) = handles
    assert handle.id in handle.hooks_dict_ref() and post_optim.hands_events(model)
    del model
    gc.collect()
    other = mlp(mesh, dim=16, layers=2).model
    torch.optim.SGD(other.parameters(), lr=0.1).step()  # the orphan hook runs, and does nothing
    assert handle.id in handle.hooks_dict_ref()
    apply_plan(other, Plan(model_fingerprint(other), {}))
    assert handle.id not in handle.hooks_dict_ref()


def _random_plan(model, seed: int):
    """A plan for ``model`` with every knob away from FSDP2's default where it can be, random prefetch lists and
    resharding: what a confirmed plan may hold."""
    import random

    from planner.artifacts.plan import ModulePlan, Plan

    rng = random.Random(seed)
    fqns = [fqn for fqn, _ in fsdp_modules(model)]
    modules = {f: ModulePlan(forward_prefetch=tuple(rng.sample([g for g in fqns if g != f], rng.randint(0, 2))),
                             backward_prefetch=tuple(rng.sample([g for g in fqns if g != f], rng.randint(0, 2))),
                             reshard_after_forward=rng.random() < 0.5).with_knobs(
        **{k.name: rng.choice(k.choices) for k in KNOBS if k.scope is Scope.MODULE}) for f in fqns}
    plan = Plan(model_fingerprint(model), modules)
    return plan.with_knobs(**{k.name: _other(k) for k in KNOBS if k.scope is not Scope.MODULE})


def _configuration(model, plan, monkeypatch) -> list[tuple]:
    """Every setter ``apply_plan(model, plan)`` calls, in order: ``(module, setter, arguments)``, modules by FQN
    (FSDP2's own setters), or ``("<root>", knob, value)`` for the knobs applied through ``ROOT_SETTERS``."""
    names = {id(m): fqn for fqn, m in fsdp_modules(model)}
    calls: list[tuple] = []

    def plain(value):
        if isinstance(value, (list, tuple)):
            return tuple(names.get(id(v), v) for v in value)
        return names.get(id(value), value)

    setters = {"set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "set_reshard_after_forward"}
    setters |= {k.setter for k in KNOBS if k.name not in ROOT_SETTERS}
    with monkeypatch.context() as patch:
        for setter in sorted(setters):
            original = getattr(FSDPModule, setter)

            def spy(self, *args, _setter=setter, _original=original, **kwargs):
                calls.append((names[id(self)], _setter, tuple(plain(a) for a in args), tuple(sorted(kwargs.items()))))
                return _original(self, *args, **kwargs)
            patch.setattr(FSDPModule, setter, spy)
        for name, wrapper in list(ROOT_SETTERS.items()):
            def wrapped(root, _name=name, _wrapper=wrapper):
                inner = _wrapper(root)
                return lambda value: (calls.append(("<root>", _name, value)), inner(value))
            patch.setitem(ROOT_SETTERS, name, wrapped)
        apply_plan(model, plan)
    return calls


@pytest.mark.parametrize("seed", range(5))
def test_a_plan_read_back_from_its_json_configures_fsdp_as_the_plan_object(mesh, monkeypatch, tmp_path, seed):
    """The confirmed plan object and the same plan through its JSON file (``to_json``, ``load_plan``): every FSDP
    module gets the same setter calls with the same values, every knob included, and reads back the same."""
    from planner.artifacts.plan import Plan
    from runtime.apply import load_plan
    from runtime.post_optim import hands_events
    from runtime.ranks.torch_private import reshard_after_forward

    confirmed = _random_plan(mlp(mesh, dim=16, layers=3).model, seed)
    confirmed.to_json(tmp_path / "plan.json")
    read_back = load_plan(tmp_path / "plan.json")
    a, b = mlp(mesh, dim=16, layers=3).model, mlp(mesh, dim=16, layers=3).model
    calls = _configuration(a, confirmed, monkeypatch)
    assert calls == _configuration(b, read_back, monkeypatch)
    assert {c[1] for c in calls} >= {k.name for k in KNOBS if k.name in ROOT_SETTERS} | {
        k.setter for k in KNOBS if k.name not in ROOT_SETTERS}
    state = [(prefetch_counts(m), unshard_async_op(m), reshard_after_forward(m)) for _, m in fsdp_modules(a)]
    assert state == [(prefetch_counts(m), unshard_async_op(m), reshard_after_forward(m)) for _, m in fsdp_modules(b)]
    assert hands_events(a) and hands_events(b)
    for model in (a, b):  # FSDP2's default again: no optimizer hook left behind
        apply_plan(model, Plan(model_fingerprint(model), {}))


def _held(plan):
    """``plan`` as FSDP2 holds it: a module without parameters of its own keeps none after forward."""
    from planner.artifacts.plan import Plan

    own = dict(zip(plan.fingerprint.module_fqns, plan.fingerprint.param_numels, strict=True))
    return Plan(plan.fingerprint, {f: m if own[f] else dataclasses.replace(m, reshard_after_forward=False)
                                   for f, m in plan.modules.items()}, plan.knobs)


@pytest.mark.parametrize("seed", range(5))
def test_current_plan_reads_back_the_plan_applied_and_applying_it_changes_nothing(mesh, monkeypatch, seed):
    """``current_plan`` after ``apply_plan``: the plan applied, every prefetch list, resharding and knob read from
    FSDP2's state, of provenance ``user``; applying what it read makes the same prefetch and resharding calls as the
    plan itself on a fresh model and calls no knob's setter (FSDP2 acts on each value already), and reads back the
    same."""
    from planner.artifacts.plan import Plan, Source
    from runtime.current import current_plan

    model = mlp(mesh, dim=16, layers=3).model
    plan = _random_plan(model, seed)
    apply_plan(model, plan)
    read = current_plan(model)
    assert read.behaviour_key() == _held(plan).behaviour_key()
    assert read.provenance.source == Source.USER and read.provenance.unknown_knobs is None
    other = mlp(mesh, dim=16, layers=3).model
    again, fresh = _configuration(model, read, monkeypatch), _configuration(other, plan, monkeypatch)
    structure = {"set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "set_reshard_after_forward"}
    assert [c for c in again if c[1] in structure] == [c for c in fresh if c[1] in structure]
    assert [c for c in again if c[1] not in structure] == []
    assert {c[1] for c in fresh if c[1] not in structure} >= {k.name for k in KNOBS if k.name in ROOT_SETTERS}
    assert current_plan(model).behaviour_key() == read.behaviour_key()
    for m in (model, other):  # FSDP2's default again: no optimizer hook left behind
        apply_plan(m, Plan(model_fingerprint(m), {}))


def test_a_model_as_wrapped_reads_as_fsdp2s_default(mesh):
    """Before its first forward too: the root wrapped without a ``reshard_after_forward`` keeps its parameters
    (FSDP2 decides so at its first forward), every block reshards, no prefetch list, every knob at its default."""
    from planner.artifacts.plan import ModulePlan, Plan
    from runtime.current import current_plan

    model = _model(mesh, 3)
    expected = Plan(model_fingerprint(model), {f: ModulePlan(reshard_after_forward=f != "")
                                               for f, _ in fsdp_modules(model)})
    assert current_plan(model).behaviour_key() == expected.behaviour_key()
    model(torch.randn(4, 16)).sum().backward()
    assert current_plan(model).behaviour_key() == expected.behaviour_key()


def test_prefetch_lists_set_by_hand_are_read_in_the_order_fsdp2_issues_them(mesh):
    from runtime.current import current_plan

    model = _model(mesh, 3)
    b = model.blocks
    b[0].set_modules_to_forward_prefetch([b[2], b[1]])
    b[2].set_modules_to_backward_prefetch([b[1], b[0]])
    b[1].set_reshard_after_forward(False, recurse=False)
    read = current_plan(model)
    assert read.modules["blocks.0"].forward_prefetch == ("blocks.2", "blocks.1")
    assert read.modules["blocks.2"].backward_prefetch == ("blocks.1", "blocks.0")
    assert read.modules["blocks.1"].reshard_after_forward is False
    assert read.modules["blocks.0"].reshard_after_forward is True


def test_a_knob_without_state_in_this_torch_is_unknown_and_left_as_it_is(mesh, monkeypatch):
    """A torch that holds no state for a knob: ``current_plan`` names it unknown (the plan carries FSDP2's default
    for it, never a guess), and ``apply_plan`` of that plan leaves the model's own value alone."""
    import runtime.ranks.torch_private as torch_private
    from runtime.current import current_plan

    model = _model(mesh, 3)
    model.blocks[1].set_unshard_in_backward(False)

    def missing(module):
        raise AttributeError("FSDPParamGroup.unshard_in_backward")

    monkeypatch.setattr(torch_private, "unshard_in_backward", missing)
    read = current_plan(model)
    assert read.provenance.unknown_knobs == ("unshard_in_backward",)
    assert read.modules["blocks.1"].knobs.unshard_in_backward is True  # FSDP2's default, marked unknown
    apply_plan(model, read)
    monkeypatch.undo()
    assert torch_private.unshard_in_backward(model.blocks[1]) is False


def test_a_plan_knob_set_on_some_modules_only_is_unknown(mesh):
    """``reduce_scatter_max_input_buffers`` set by hand on one block: a plan holds one value for every module, so
    the knob is unknown rather than either value."""
    from runtime.current import current_plan

    model = _model(mesh, 3)
    model.blocks[1].set_reduce_scatter_max_input_buffers(2, recurse=False)
    assert current_plan(model).provenance.unknown_knobs == ("reduce_scatter_max_input_buffers",)
    model.set_reduce_scatter_max_input_buffers(2)
    read = current_plan(model)
    assert read.provenance.unknown_knobs is None and read.knobs.reduce_scatter_max_input_buffers == 2


def test_a_separate_reduce_scatter_group_the_model_set_itself_is_read_and_switched_off_by_fsdp2s_default(mesh):
    """The user's code gave reduce-scatter its own group before any plan: it reads back as set, FSDP2's default
    plan switches it off (the profile is recorded under FSDP2's default), and the user's plan puts the same group
    back, creating none."""
    from planner.artifacts.plan import Plan
    from runtime.current import current_plan
    from runtime.ranks.torch_private import reduce_scatter_group, separate_reduce_scatter_group

    model = _model(mesh, 2)
    model.set_separate_reduce_scatter_group(True)
    own = reduce_scatter_group(model.blocks[0])
    users = current_plan(model)
    assert users.knobs.separate_reduce_scatter_group is True
    apply_plan(model, Plan(model_fingerprint(model), {}))
    assert separate_reduce_scatter_group(model.blocks[0]) is False
    apply_plan(model, users)
    assert reduce_scatter_group(model.blocks[0]) is own


class _GlooAllGather:
    """A custom all-gather (FSDP2's ``AllGather`` protocol: ``allocate`` and the call) that runs on gloo."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        import torch.distributed as dist

        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def test_a_custom_all_gather_is_left_in_place_and_every_plan_still_applies(mesh, caplog):
    """[Note: What blocks a knob]: a model whose blocks all-gather through their own comm (``set_custom_all_gather``).
    FSDP2's default and a plan setting ``allocate_memory_from_process_group_for_comm`` apply without raising (FSDP2
    asserts when that setter meets a custom comm); the knob is left alone with one log line per model, the steps
    run, and ``current_plan`` marks the knob unknown (at world size 1 FSDP2 calls no all-gather)."""
    from runtime.current import current_plan, fsdp2_default

    workload = mlp(mesh, dim=16, layers=3)
    model = workload.model
    comm = _GlooAllGather()
    for block in model.blocks:
        block.set_custom_all_gather(comm)
    default = fsdp2_default(model)
    with caplog.at_level(logging.INFO, logger="runtime.apply"):
        for plan in (default, default.with_knobs(allocate_memory_from_process_group_for_comm=True), default):
            apply_plan(model, plan)
            workload.loss_fn(model, workload.make_batch(0)).backward()
    lines = [r.message for r in caplog.records if "allocate_memory_from_process_group_for_comm" in r.message]
    assert lines == ["apply_plan: allocate_memory_from_process_group_for_comm left as the model has it: its comms "
                     "are not FSDP2's own (_GlooAllGather)"]
    assert "allocate_memory_from_process_group_for_comm" in current_plan(model).provenance.unknown_knobs
