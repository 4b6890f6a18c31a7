"""The memory budget of a tuning job: resolved and checked before the storage is touched, then each candidate's
measured peak held against it.

``[search] memory_budget`` (``planner.artifacts.memory_budget``: ``"1.5GiB"``,
``"+150MiB"``, ``"+10%"`` of FSDP2's default's measured peak) bounds every plan
the job may recommend, per rank. The simulated stage leaves out plans predicted
over it (Optuna's constraint), and the candidates come from those
(``planner.study.candidates.candidate``); the race's peak steps then measure
each candidate, and one measured over it is FAIL (:func:`fail_over_budget`).
"""

from __future__ import annotations

import logging

from planner.artifacts.config import StudyConfig
from planner.artifacts.memory_budget import NCCL_COMMUNICATOR_BYTES, PeakBudget, check_feasible
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.errors import FailKind
from planner.simulation.simulator import Simulator
from planner.study.measured import MeasuredStage, MeasuredTrial
from planner.study.records import Failure
from planner.study.search_space import SearchSpace
from planner.study.simulated import smallest_peak
from planner.units import mib

logger = logging.getLogger(__name__)


def job_budget(config: StudyConfig, profile: Profile, simulator: Simulator, space: SearchSpace) -> PeakBudget | None:
    """``[search] memory_budget`` in bytes per rank, checked against the smallest predicted peak in ``space``, with
    what each candidate is charged beside its predicted peak: the simulator's error on this job's baseline (FSDP2's
    default, whose peak the profile measured: the highest of its peak steps over its predicted peak, never below
    zero; :func:`highest_default_peak`) and, on
    CUDA, an allowance per NCCL communicator a plan adds ([Note: NCCL's buffers outside the caching allocator]);
    ``None``: unset.

    Raises:
        MemoryBudgetError: relative without a measured default peak, or below every plan's predicted peak.
    """
    budget = config.search.budget()
    if budget is None:
        return None
    budget_bytes = budget.resolve(profile.measured_peak_bytes)
    check_feasible(budget_bytes, smallest_peak(simulator, space), budget.text)
    predicted = simulator.run(Plan.default(profile)).peak_bytes
    measured = highest_default_peak(profile)
    error = max(0, measured - predicted) if measured is not None else 0
    communicator = NCCL_COMMUNICATOR_BYTES if profile.fingerprint.device_type == "cuda" else 0
    logger.info(f"      memory budget {budget.text}: {mib(budget_bytes)} per rank (FSDP2's default measured "
                f"{mib(measured)}, predicted {mib(predicted)}: each candidate's predicted peak is charged "
                f"{mib(error)} more" + (f", and {mib(communicator)} per NCCL communicator it adds)" if communicator
                                        else ")"))
    return PeakBudget(budget_bytes, error, communicator)


def highest_default_peak(profile: Profile) -> int | None:
    """The highest peak of FSDP2's default's peak steps on any rank, bytes (``RankMeasurements.steps.peak_bytes``);
    the profile's consolidated peak (a median over steps) where no rank's steps are kept. The peak moves from step
    to step by about a module's bytes: which module's buffers are alive at the peak depends on when the collectives
    end (the reference Llama read 1134, 1134 and 1183 MiB in three steps of one process, on both ranks)."""
    peaks = [b for r in profile.per_rank for b in (r.steps.peak_bytes or ())]
    return max(peaks) if peaks else profile.measured_peak_bytes


def fail_over_budget(stage: MeasuredStage, kept: list[MeasuredTrial], peak_bytes: list[int],
                     budget: PeakBudget | None) -> dict[int, str]:
    """Record FAIL (``FailKind.ERROR``: not measured again) each candidate whose measured peak exceeds the budget.

    Args:
        kept: the round's trials that applied on every rank, the baseline first.
        peak_bytes: their measured peaks, bytes per rank (max across ranks).
        budget: the job's budget (:func:`job_budget`; a measured peak is charged the NCCL allowance, not the
            simulator's error); ``None``: none.

    Returns:
        Position in ``kept`` -> the reason recorded. The baseline is never failed: it is what the job runs without
        the tuner (a budget below every predicted peak is refused earlier: ``check_feasible``).
    """
    out: dict[int, str] = {}
    if budget is None:
        return out
    for j, (a, peak) in enumerate(zip(kept, peak_bytes, strict=True)):
        if j == 0 or budget.admits(a.plan, peak, predicted=False):
            continue
        charged = budget.charged(a.plan, peak, predicted=False)
        out[j] = (f"measured peak {mib(peak)}" + (f" ({mib(charged)} with NCCL's buffers)" if charged > peak else "")
                  + f" exceeds the memory budget {mib(budget.limit_bytes)} "
                  f"(predicted {mib(a.candidate.predicted_peak_bytes)})")
        stage.fail([a], Failure(out[j], FailKind.ERROR), measured_peak_bytes=peak)
    return out
