"""``apply_plan`` applies every declared knob (``planner.artifacts.knobs.KNOBS``) through its setter, on the modules
its scope names, with the plan's value: a knob declared but not applied fails here."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.fsdp import FSDPModule

from planner.artifacts.knobs import KNOBS, Scope
from planner.errors import UnsupportedPlanError
from runtime.apply import ROOT_SETTERS, apply_plan, model_fingerprint
from runtime.reference_workloads import mlp
from runtime.workload import fsdp_modules


def _other(k):
    return next(v for v in k.choices if v != k.default)


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.name)
def test_the_running_torch_has_every_knobs_setter(k):
    assert k.setter in ROOT_SETTERS or hasattr(FSDPModule, k.setter), k.setter


def test_apply_plan_calls_each_knobs_setter_with_the_plans_value(mesh, monkeypatch):
    from planner.artifacts.plan import ModulePlan, Plan

    workload = mlp(mesh, dim=16, layers=2)
    model = workload.model
    fqns = [fqn for fqn, _ in fsdp_modules(model)]
    calls: list[tuple[str, str, object]] = []
    names = {id(m): fqn for fqn, m in fsdp_modules(model)}
    for k in KNOBS:
        if k.setter in ROOT_SETTERS:
            monkeypatch.setitem(ROOT_SETTERS, k.setter, lambda m, k=k: lambda v: calls.append((k.name, "root", v)))
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
        expected = {"root"} if k.setter in ROOT_SETTERS else {fqns[0]} if k.scope is Scope.ROOT else set(fqns)
        assert where == expected, (k.name, where)


def test_a_knob_the_running_torch_lacks_is_refused_before_anything_is_applied(mesh, monkeypatch):
    from planner.artifacts.plan import Plan

    workload = mlp(mesh, dim=16, layers=2)
    k = next(k for k in KNOBS if k.setter not in ROOT_SETTERS and k.scope is not Scope.MODULE)
    monkeypatch.delattr(FSDPModule, k.setter)
    plan = Plan(model_fingerprint(workload.model), {}).with_knobs(**{k.name: _other(k)})
    with pytest.raises(UnsupportedPlanError, match=f"the plan sets {k.name} = .* has no FSDPModule.{k.setter}"):
        apply_plan(workload.model, plan)
    apply_plan(workload.model, Plan(model_fingerprint(workload.model), {}))  # FSDP2's default needs no setter
