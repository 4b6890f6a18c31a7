"""The names a study chooses from: the ranks' backend and allocator, how collectives are timed, the search space, the
sampler.

Shared by the study config (which validates them), the search spaces and the
sampler registry (keyed by them) and the runtime (the backend), so this module
imports nothing.
"""

from __future__ import annotations

import enum


class Backend(enum.StrEnum):
    """``torch.distributed`` backend of the ranks: ``gloo`` on CPU, ``nccl`` on CUDA GPUs."""

    GLOO = "gloo"
    NCCL = "nccl"


class Allocator(enum.StrEnum):
    """``[launch] allocator``: the ranks' CPU memory allocator (``runtime.ranks.allocator``).

    ``system``: the C library's ``malloc`` (glibc's on Linux), as a plain ``torchrun`` runs. ``jemalloc``: jemalloc
    preloaded and told to keep every page it has (``runtime.ranks.allocator.JEMALLOC_CONF``), as PyTorch's CPU launcher
    offers (``torch.backends.xeon.run_cpu --enable-jemalloc``): a CPU step then takes no page faults, as a GPU step
    takes no ``cudaMalloc`` under the caching allocator.
    """

    SYSTEM = "system"
    JEMALLOC = "jemalloc"


class CollectiveTiming(enum.StrEnum):
    """``[measure] collectives``: where the recorder times each module's all-gather and reduce-scatter.

    ``in-step``: inside a few traced steps of FSDP2's default, the transfer on its own clock (NCCL's kernel on a
    GPU), the wait for late ranks apart ([Note: Collectives on NCCL's clock] in
    ``planner.traces.in_step_collectives``). ``isolated``: one ``unshard()`` and one bare reduce-scatter at a time,
    every rank together (``runtime.recording.collective_timer``). ``auto``: in-step on a GPU, isolated on CPU.
    """

    AUTO = "auto"
    IN_STEP = "in-step"
    ISOLATED = "isolated"


class SpaceName(enum.StrEnum):
    """``[search] space``: the search spaces (``search_spaces.SPACES`` implements each)."""

    UNIFORM = "uniform"
    PER_MODULE = "per_module"
    ASSIGN = "assign"


class SamplerName(enum.StrEnum):
    """``[search] sampler``: the Optuna samplers of the simulated stage (``planner.study.samplers``)."""

    TPE = "tpe"
    NSGA2 = "nsga2"
    RANDOM = "random"
