"""``prefetch-planner check``: the plan a model has, read back, checked against the known-bad patterns and priced.

The plan comes from ``runtime.current_plan`` (provenance ``user``); the profile was recorded under FSDP2's default.
Each plan is priced on the simulator of that profile, on the profile's own cluster: its predicted step with its band
(``planner.simulation.band``: the collective fit's leave-one-out error, the link as recorded, the ranks recorded),
its exposed communication and its peak. Torch-free: the tests build every case from a synthetic profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.artifacts.config import StudyConfig
from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.knobs import knob
from planner.artifacts.plan import ModulePlan, Plan
from planner.artifacts.profile import Profile
from planner.errors import PlannerError, one_line
from planner.study.known_bad import Finding, known_bad, summary_lines
from planner.units import mib


@dataclass(frozen=True)
class PricedPlan:
    """One plan on the profile's simulator.

    Attributes:
        label: ``"yours"``, ``"FSDP2 default"``, ``"the study's recommendation (trial 7)"``.
        plan: the plan.
        step_ms: the predicted step, ms; ``None`` when it could not be simulated (:attr:`why_not`).
        exposed_comm_ms: step time not covered by compute, ms.
        peak_bytes: the predicted peak per rank, bytes.
        why_not: why it was not priced, one line.
    """

    label: str
    plan: Plan
    step_ms: float | None = None
    exposed_comm_ms: float | None = None
    peak_bytes: int | None = None
    why_not: str | None = None

    def line(self) -> str:
        """``yours            812.4 ms, exposed communication 120.3 ms, peak 1.2 GiB``."""
        if self.step_ms is None:
            return f"{self.label:<36} not priced: {self.why_not}"
        return (f"{self.label:<36} {self.step_ms:8.1f} ms, exposed communication {self.exposed_comm_ms:.1f} ms, "
                f"peak {mib(self.peak_bytes)}")


@dataclass(frozen=True)
class CheckReport:
    """What ``check`` prints.

    Attributes:
        plan: the plan the model has.
        findings: the known-bad patterns it matches (``planner.study.known_bad``).
        priced: the plan, FSDP2's default and, where the study has one, its recommendation.
        unknown_knobs: the knobs the running torch could not read back.
    """

    plan: Plan
    findings: tuple[Finding, ...]
    priced: tuple[PricedPlan, ...]
    unknown_knobs: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The report: the configuration read back, the patterns, the prices and where the difference lies."""
        out = ["the plan the model has, read back from FSDP2's state:"]
        out += [f"  {line}" for line in configuration_lines(self.plan)]
        if self.unknown_knobs:
            out.append(f"  unknown (no state to read in this torch): {', '.join(self.unknown_knobs)}")
        out += summary_lines(self.findings)
        out.append("simulated on the profile's own cluster, as `simulate PROFILE PLAN` (predicted step, exposed "
                   "communication, peak):")
        out += [f"  {p.line()}" for p in self.priced]
        out += difference_lines(self.priced)
        return out

    def to_dict(self) -> dict:
        """The report as one JSON object (``check --json``)."""
        return {
            "plan": self.plan.to_dict(),
            "unknown_knobs": list(self.unknown_knobs),
            "findings": [{"pattern": str(f.pattern), "modules": list(f.modules), "detail": f.detail,
                          "source": f.source, "fix": f.fix} for f in self.findings],
            "priced": [{"label": p.label, "step_ms": p.step_ms,
                        "exposed_comm_ms": p.exposed_comm_ms, "peak_bytes": p.peak_bytes, "why_not": p.why_not}
                       for p in self.priced],
        }


def configuration_lines(plan: Plan) -> list[str]:
    """Per module what is set, compactly: modules with nothing set beyond FSDP2's default for them (no explicit
    prefetch, resharding as FSDP2 chooses, every knob at its default) in one line; then the plan's knobs."""
    plain, changed = [], []
    for fqn, m in plan.modules.items():
        parts = _beyond_default(fqn, m)
        (changed if parts else plain).append((fqn or "root", parts))
    out = [f"{fqn}: {'; '.join(parts)}" for fqn, parts in changed]
    if plain:
        names = [f for f, _ in plain]
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} modules)" if len(names) > 4 else "")
        out.append(f"as FSDP2 does by default: {shown}")
    changed = [f"{name} = {value!r}" for name, value in plan.knobs.items() if value != knob(name).default]
    out.append("plan knobs: " + (", ".join(changed) if changed else "FSDP2's defaults"))
    return out


def _beyond_default(fqn: str, m: ModulePlan) -> list[str]:
    """What is set on module ``fqn`` beyond FSDP2's default for it (the root keeps its parameters, a block
    reshards)."""
    parts = []
    if m.forward_prefetch:
        parts.append(f"forward prefetch {', '.join(t or 'root' for t in m.forward_prefetch)}")
    if m.backward_prefetch:
        parts.append(f"backward prefetch {', '.join(t or 'root' for t in m.backward_prefetch)}")
    fsdp2 = fqn != ""
    if not isinstance(m.reshard_after_forward, bool):
        parts.append(f"reshards to {m.reshard_after_forward} ranks after forward")
    elif m.reshard_after_forward != fsdp2:
        parts.append("keeps its parameters after forward" if fsdp2 else "reshards after forward")
    parts += [f"{name} = {value!r}" for name, value in m.knobs.items() if value != knob(name).default]
    return parts


def difference_lines(priced: Sequence[PricedPlan]) -> list[str]:
    """Where each priced plan differs from the first (the model's own): step, exposed communication, peak."""
    if not priced or priced[0].step_ms is None:
        return []
    yours = priced[0]
    out = []
    for p in priced[1:]:
        if p.step_ms is None:
            continue
        step = yours.step_ms - p.step_ms
        comm = yours.exposed_comm_ms - p.exposed_comm_ms
        peak = yours.peak_bytes - p.peak_bytes
        faster = "slower" if step > 0 else "faster"
        sign = "+" if peak >= 0 else "-"
        out.append(f"yours against {p.label}: {abs(step):.1f} ms {faster} a step (exposed communication "
                   f"{comm:+.1f} ms), peak {sign}{mib(abs(peak))}")
    return out


def price(label: str, plan: Plan, profile: Profile) -> PricedPlan:
    """``plan`` on the cluster ``profile`` was recorded on, priced as ``simulate PROFILE PLAN`` prices it
    (:meth:`planner.simulation.what_if.Scenario.price`: one answer for one profile and plan); a plan the simulator
    refuses (an integer ``reshard_after_forward``) comes back unpriced with the reason."""
    from planner.simulation.what_if import Scenario

    try:
        result = Scenario.of(profile).price(plan).result
    except PlannerError as e:
        return PricedPlan(label, plan, why_not=one_line(e))
    return PricedPlan(label, plan, result.step_ms, result.exposed_comm_ms, result.peak_bytes)


def check_plan(plan: Plan, profile: Profile, recommended: Plan | None = None, recommended_label: str | None = None,
               memory_budget_bytes: int | None = None, reentrant: bool = False) -> CheckReport:
    """The report on ``plan`` (the model's own) for ``profile`` (recorded under FSDP2's default).

    Args:
        plan: the plan the model has (``runtime.current_plan``).
        profile: its profile.
        recommended: the study's recommendation for this model, if it has one; priced beside.
        recommended_label: how the report names it (default ``"the study's recommendation"``).
        memory_budget_bytes: the per-rank budget a prefetch depth is checked against; ``None``: not checked.
        reentrant: the model checkpoints with ``use_reentrant=True``.

    Raises:
        PlanMismatchError: ``plan`` is not of ``profile``'s model.
    """
    plan.check_matches(profile)
    priced = [price("yours", plan, profile), price("FSDP2 default", Plan.default(profile), profile)]
    if recommended is not None:
        priced.append(price(recommended_label or "the study's recommendation", recommended, profile))
    return CheckReport(plan, tuple(known_bad(plan, profile, memory_budget_bytes, reentrant)), tuple(priced),
                       tuple(plan.provenance.unknown_knobs or ()))


def check_in_study(config: StudyConfig, fingerprint: Fingerprint, plan: Plan) -> list[str]:
    """``AutoTuner(check_only=True)``: the report on ``plan`` (the model's, read back) from what study
    ``config.name`` holds, read-only: its latest profile of this job (same model, world size, device, dtypes and
    torch: ``planner.study.in_loop.same_job``), its recommendation priced beside, the memory budget of
    ``[search] memory_budget``. Without such a profile: the configuration read back, and how to record one.

    Raises:
        StorageError: the storage cannot be opened.
    """
    from planner.artifacts.memory_budget import MemoryBudget
    from planner.errors import StudyNotFoundError
    from planner.study.in_loop import same_job, study_profiles
    from planner.study.queries import recommendation_for

    profiles = [p for p in study_profiles(config) or [] if same_job(p.fingerprint, fingerprint)]
    if not profiles:
        return (["the plan the model has, read back from FSDP2's state:"]
                + [f"  {line}" for line in configuration_lines(plan)]
                + [f"not priced: study {config.name!r} holds no profile of this model on this world size and torch; "
                   "run the AutoTuner once without check_only, or `prefetch-planner check STUDY.toml`"])
    profile = profiles[-1]
    try:
        best = recommendation_for(config.storage_url, config.name, fingerprint)
    except StudyNotFoundError:
        best = None
    recommended = None if best is None or best.keeps_baseline else best.plan
    label = None if recommended is None else (f"study {config.name!r}'s recommendation "
                                              f"(trial {recommended.provenance.trial})")
    budget = config.search.memory_budget
    budget_bytes = MemoryBudget.parse(budget).resolve(profile.measured_peak_bytes) if budget else None
    return check_plan(plan, profile, recommended, label, budget_bytes).lines()
