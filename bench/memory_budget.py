"""Benchmark: under a memory budget, does a per-module (``assign``) plan beat the best uniform plan on the ranks?

    python -m bench.memory_budget [studies/llama-cpu.toml studies/gpt2-cpu.toml] [--json out.json]
    python -m bench.memory_budget --refit run.json ...   # saved runs, today's simulator, no ranks
    python -m bench.memory_budget --blocks-only ...      # step 6 alone, on fresh ranks

One run per study, on its ranks, one model instance, a fresh process:

1. Record a profile (its ``measured_peak_bytes`` is FSDP2's default's peak).
2. The unconstrained best plan: a simulated ``assign`` study without a budget
   (``--sim-trials``), its best predicted plan; its peak is measured. The
   budget is the default's measured peak plus ``--share`` (3/4) of the
   unconstrained extra.
3. Candidates predicted within the budget: the ``assign`` study run again
   with the budget (Optuna constraints), its candidates
   (``planner.study.select_candidates``) that are not uniform plans; and the
   two best ``uniform`` grid plans (one global forward/backward depth, async
   unshard, reshard after forward). Their peaks are measured; a plan over the
   budget leaves.
4. Selection: ``--select-rounds`` interleaved rounds of the candidates and the
   default (Williams orders); the best measured ``assign`` plan and the best
   measured ``uniform`` plan go on.
5. Confirmation on fresh rounds (the selection's rounds are never reported):
   assign, uniform and the default, ``--rounds`` rounds, the order rotated
   (Williams design). Paired per-round ratios, median, 95% bootstrap interval
   and verdict (``planner.statistics.verdict.confirm``): assign/uniform, assign/default,
   uniform/default.
6. Keeping blocks unsharded: uniform forward prefetch 1 with async unshard,
   and the same keeping the last 1, 3 and all blocks unsharded after forward
   (``search_spaces.assign.keep_unsharded``), ``--block-rounds`` fresh rounds:
   the measured gain (ratio to the base, with its interval) against the
   predicted gain.

The simulator runs with the in-step parameters, as ``tune`` does
(``planner.simulation.in_step``). Targets: assign/uniform
<= 0.95 with verdict "faster"; every plan's measured peak within the budget;
the predicted gain of keeping blocks within 3 points of the measured gain.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from bench.budget_report import report
from bench.ranks import json_flag, report_saved, run_studies, saved_run_options, studies_argument
from planner.units import mib

if TYPE_CHECKING:
    import optuna
    import torch.distributed as dist

    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.simulator import SimParams
    from runtime.timing import StepCounter
    from runtime.workload import Workload

MODULE = "bench.memory_budget"
SHARE = 0.75  # of the unconstrained best plan's extra peak above the default's


@dataclass(frozen=True)
class BudgetSettings:
    """The bench's settings (its command-line options)."""

    sim_trials: int = 600
    share: float = SHARE
    select_rounds: int = 8
    rounds: int = 24
    block_rounds: int = 16
    skip_blocks: bool = False
    blocks_only: bool = False

    def forwarded(self) -> list[str]:
        """These settings as the command-line options the ranks are started with."""
        out = ["--sim-trials", str(self.sim_trials), "--share", str(self.share), "--select-rounds",
               str(self.select_rounds), "--rounds", str(self.rounds), "--block-rounds", str(self.block_rounds)]
        return out + (["--skip-blocks"] if self.skip_blocks else []) + (["--blocks-only"] if self.blocks_only else [])


def _sim_study(profile: Profile, study: str, sim_trials: int, memory_budget_bytes: int | None,
               params: SimParams | None) -> optuna.Study:
    """An in-memory simulated ``assign`` study (with Optuna constraints under a budget)."""
    import optuna

    from planner.artifacts.config import load_study_config
    from planner.artifacts.memory_budget import PeakBudget
    from planner.simulation.parameters import simulator_for
    from planner.study import simulated_stage
    from search_spaces import get_space

    config = load_study_config(study, space="assign", sim_trials=sim_trials)
    budget = PeakBudget(memory_budget_bytes) if memory_budget_bytes is not None else None
    return simulated_stage(simulator_for(profile, params), config, optuna.storages.InMemoryStorage(),
                           get_space("assign"), show_progress_bar=False, budget=budget)


def unconstrained_best(profile: Profile, study: str, sim_trials: int, params: SimParams | None) -> Plan:
    """The best predicted ``assign`` plan with no budget."""
    from planner.study import distinct_plans
    from search_spaces import get_space

    return distinct_plans(_sim_study(profile, study, sim_trials, None, params), profile, get_space("assign"))[0][1]


def candidates(profile: Profile, study: str, sim_trials: int, memory_budget_bytes: int,
               params: SimParams | None) -> dict[str, Plan]:
    """Named candidates predicted within the budget: up to 3 per-module ``assign`` plans, the 2 best uniform."""

    from planner.artifacts.memory_budget import PeakBudget
    from planner.simulation.parameters import simulate
    from planner.study import select_candidates
    from search_spaces import get_space

    sim = _sim_study(profile, study, sim_trials, memory_budget_bytes, params)
    space = get_space("uniform")
    grid = [(g, space.build(g, profile)) for g in space.grid(profile)]
    uniform_keys = {plan.behaviour_key() for _, plan in grid}
    per_module = [c for c in select_candidates(sim, profile, get_space("assign"), 6,
                                               budget=PeakBudget(memory_budget_bytes))
                  if c.plan.behaviour_key() not in uniform_keys][:3]
    fitting = []
    for g, plan in grid[1:]:  # FSDP2's default first: not a candidate
        r = simulate(profile, plan, params)
        if r.peak_bytes <= memory_budget_bytes and not plan.is_default_for(profile):
            fitting.append((r.step_ms, g, plan))
    fitting.sort(key=lambda x: x[0])
    out = {f"assign #{i + 1}": c.plan for i, c in enumerate(per_module)}
    for i, (_, g, plan) in enumerate(fitting[:2]):
        out[f"uniform #{i + 1} (fwd {g['forward_depth']}, bwd {g['backward_depth']}"
            f"{', async' if g['unshard_async_op'] else ''}{'' if g['reshard_after_forward'] else ', kept'})"] = plan
    return out


@dataclass
class BudgetBench:
    """One study's run on every rank: rank 0 decides the plans, every rank measures them, ``run`` collects."""

    study: str
    settings: BudgetSettings
    workload: Workload
    profile: Profile
    params: SimParams | None
    steps: StepCounter
    group: dist.ProcessGroup
    run: dict[str, Any]

    @property
    def rank0(self) -> bool:
        import torch.distributed as dist

        return dist.get_rank() == 0

    def shared(self, make: Callable[[], dict[str, Plan]]) -> dict[str, Plan]:
        """Rank 0's named plans (``make()``, called on rank 0 alone) on every rank."""
        from planner.artifacts.plan import Plan
        from runtime.ranks.collectives import broadcast_from_rank0

        payload = {n: p.to_dict() for n, p in make().items()} if self.rank0 else None
        return {n: Plan.from_dict(d) for n, d in broadcast_from_rank0(payload, self.group).items()}

    def peaks(self, plans: dict[str, Plan]) -> dict[str, int]:
        """Each plan's peak bytes per rank (``runtime.recording.peak_memory``: median over steps of the max across
        ranks)."""
        from runtime.measuring.round import warm_up_steps
        from runtime.ranks.collectives import gather_objects
        from runtime.recording.peak_memory import PEAK_STEPS, peak_of_steps
        from runtime.recording.steps import WorkloadSteps

        peaks: list[list[int]] = [[] for _ in plans]
        runner = WorkloadSteps(self.workload, list(plans.values()), self.group, self.steps)
        _, failure = runner.run(warm_up_steps(range(len(plans)), PEAK_STEPS + 1), peaks)
        if failure is not None:
            raise RuntimeError(f"a peak step of plan {failure.plan} raised: {failure.error}")
        reports = gather_objects(peaks, self.group)
        return {n: peak_of_steps([rep[i] for rep in reports]) for i, n in enumerate(plans)}

    def interleaved(self, plans: dict[str, Plan], rounds: int) -> dict[str, list[float]]:
        """``rounds`` rounds of the plans, Williams orders; on rank 0 each plan's step times (max across ranks)."""
        from planner.statistics.race import balanced_orders
        from runtime.measuring.measure import measure_plans
        from runtime.recording.steps import WorkloadSteps

        orders = balanced_orders(len(plans))
        block = [orders[r % len(orders)] for r in range(rounds)]
        step_ms = measure_plans(WorkloadSteps(self.workload, list(plans.values()), self.group, self.steps), block)
        return dict(zip(plans, step_ms, strict=True)) if self.rank0 else {}

    def budget_stages(self) -> None:
        """Steps 2-5: the budget, the candidates, the selection and the confirmation, into ``run``."""
        from planner.artifacts.plan import Plan

        s, profile = self.settings, self.profile
        best = self.shared(lambda: {"unconstrained best": unconstrained_best(profile, self.study, s.sim_trials,
                                                                             self.params)})
        default_peak = profile.measured_peak_bytes
        best_peak = self.peaks(best)["unconstrained best"]
        budget = int(default_peak + s.share * max(0, best_peak - default_peak))
        self.run.update(memory_budget_bytes=budget, default_peak_bytes=default_peak,
                        unconstrained=best["unconstrained best"].to_dict(), unconstrained_peak_bytes=best_peak)
        if self.rank0:
            print(f"\n== {self.run['study']}: FSDP2 default peak {mib(default_peak)}, unconstrained best "
                  f"{mib(best_peak)}; budget {mib(budget)} ({s.share:.0%} of the extra)", flush=True)
        cands = self.shared(lambda: candidates(profile, self.study, s.sim_trials, budget, self.params))
        cand_peaks = self.peaks(cands)
        fit = {n: p for n, p in cands.items() if cand_peaks[n] <= budget}
        default = {"FSDP2 default": Plan.default(profile)}
        selection = self.interleaved({**default, **fit}, s.select_rounds)
        pick = {}
        if self.rank0:
            for kind in ("assign", "uniform"):
                mine = [n for n in fit if n.startswith(kind)]
                if mine:
                    pick[kind] = min(mine, key=lambda n: sorted(selection[n])[len(selection[n]) // 2])
        pick = self._from_rank0(pick)
        self.run.update(candidates={n: {"plan": p.to_dict(), "measured_peak_bytes": cand_peaks[n]}
                                    for n, p in cands.items()}, selection=selection, picked=pick)
        finalists = {**{pick[k]: fit[pick[k]] for k in pick}, **default}
        self.run["confirmation"] = self.interleaved(finalists, s.rounds)

    def _from_rank0(self, value: Any) -> Any:
        from runtime.ranks.collectives import broadcast_from_rank0

        return broadcast_from_rank0(value if self.rank0 else None, self.group)

    def kept_blocks(self) -> None:
        """Step 6: uniform prefetch 1 async keeping the last 1, 3 and all blocks unsharded, into ``run``."""
        from search_spaces import uniform
        from search_spaces.assign import keep_unsharded

        base = uniform.build(self.profile, 1, 1).with_knobs(unshard_async_op=True)
        blocks = len(self.profile.modules) - 1
        kept = {"prefetch 1 async": base}
        for k in sorted({1, min(3, blocks), blocks}):
            kept[f"+ last {k} kept unsharded"] = keep_unsharded(base, self.profile, k)
        self.run["blocks"] = {n: p.to_dict() for n, p in kept.items()}
        self.run["blocks_peaks"] = self.peaks(kept)
        self.run["blocks_times"] = self.interleaved(kept, self.settings.block_rounds)


def rank_main(study: str, settings: BudgetSettings, json_out: str | None) -> None:
    """Every rank: record a profile, run the steps; rank 0 reports (and writes ``json_out``)."""
    import optuna
    import torch.distributed as dist

    from planner.artifacts.config import load_study_config
    from planner.simulation.in_step import in_step_params
    from runtime.ranks.rank import job_rank
    from runtime.recording.recorder import record_profile
    from runtime.timing import StepCounter
    from runtime.workload import build_study_workload

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    config = load_study_config(study)
    with job_rank(config.launch) as rank:
        mesh = rank.mesh
        workload = build_study_workload(config.workload, mesh)
        profile = record_profile(workload, warmup_steps=1, steps=config.measure.steps,
                                 repeats=config.measure.profile_repeats)
        bench = BudgetBench(study, settings, workload, profile,
                            in_step_params(profile) if profile.in_step is not None else None, StepCounter(),
                            dist.group.WORLD,
                            {"study": config.name, "profile": profile.to_dict(), "share": settings.share})
        if not settings.blocks_only:
            bench.budget_stages()
        if not settings.skip_blocks:
            bench.kept_blocks()
        if bench.rank0:
            report(bench.run)
            if json_out:
                Path(json_out).write_text(json.dumps(bench.run, indent=1))
        del workload, bench
        rank.ended = True


@click.command(help=__doc__)
@studies_argument
@click.option("--sim-trials", default=600, show_default=True, help="trials of each simulated assign study")
@click.option("--share", default=SHARE, show_default=True, help="of the unconstrained extra peak the budget allows")
@click.option("--select-rounds", default=8, show_default=True, help="rounds of the selection")
@click.option("--rounds", default=24, show_default=True, help="fresh rounds of the confirmation")
@click.option("--block-rounds", default=16, show_default=True, help="fresh rounds of the keep-blocks comparison")
@click.option("--skip-blocks", is_flag=True, help="without step 6")
@click.option("--blocks-only", is_flag=True, help="step 6 alone: the gains of keeping blocks")
@saved_run_options
def main(studies: tuple[str, ...], json_out: str | None, refit: tuple[str, ...], **options: Any) -> None:
    if report_saved(refit, report):
        return
    settings = BudgetSettings(**options)
    run_studies(MODULE, studies, lambda study: [study, *settings.forwarded(), *json_flag(json_out)],
                lambda study: rank_main(study, settings, json_out))


if __name__ == "__main__":
    main()
