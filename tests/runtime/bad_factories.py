"""Workload factories that are wrong on purpose (imported by rank processes)."""

import torch

from runtime.workload import Workload


def raises(mesh, **kwargs):
    raise RuntimeError("out of coffee")


def unwrapped(mesh, **kwargs):
    model = torch.nn.Linear(4, 4)
    return Workload(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda s: torch.ones(2, 4), lambda m, b: m(b).sum())
