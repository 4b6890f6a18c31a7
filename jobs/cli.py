"""The ``prefetch-planner`` command line: the jobs that run on ranks (``tune``, ``profile``) and the planner's
commands that need none (``simulate``, ``presets``, ``studies``).

Outside torchrun, ``tune`` and ``profile`` check what they can in this
process, then start ``[launch] nproc_per_node`` ranks running the same
command (``runtime.ranks.launch``); under torchrun each process is one rank. Rank 0
prints the progress (the jobs' ``logging`` records) and the report; every bad
input prints one line ``error: ...`` to stderr and exits 2. Importing this
module does not import torch: the jobs are imported by the commands that run
them.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import click

from jobs.check_command import check
from jobs.launching import exit_on_rank_error, exit_with_ranks, handed_over, log_rank0_progress, study_config
from jobs.outputs import check_before_launch
from planner.artifacts.config import StudyConfig
from planner.errors import PlannerError
from planner.presentation.options import CONTEXT_SETTINGS, PlannerGroup, what_if_options
from planner.presentation.simulate_command import presets_command, simulate
from planner.presentation.studies_command import studies
from planner.version import DISTRIBUTION


@click.group(cls=PlannerGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name=DISTRIBUTION, prog_name="prefetch-planner", message="%(prog)s %(version)s")
def main() -> None:
    """Auto-tune FSDP2 prefetching: record, simulate, search, measure, apply."""


main.add_command(simulate)
main.add_command(studies)
main.add_command(presets_command)
main.add_command(check)

_EXPECTED_RANK_EXITS = (2, 3, 130)  # rank 0 printed the one line of these


@main.command()
@click.argument("study_toml")
@click.option("--storage", help="SQLAlchemy URL (default: [study] storage, else sqlite:///<toml dir>/<name>.db).")
@click.option("--sim-trials", type=int, help="Simulated trials (default: [search] sim_trials).")
@click.option(
    "--measured-trials", type=int, help="Best simulated plans to measure (default: [search] measured_trials)."
)
@click.option("--memory-budget", help='Peak per rank a written plan may reach: "1.5GiB", or above FSDP2\'s default\'s '
                                     'measured peak, "+150MiB", "+10%" (default: [search] memory_budget; none).')
@click.option("--plan-out", help="Where to write the best plan (default: <toml dir>/<name>.plan.json).")
@click.option("--profile-out", help="Where to write the profile (default: <toml dir>/<name>.profile.json).")
@click.option("--from-profile", "profile_in", help="Tune from this profile instead of recording one (e.g. "
              "`profile --from-trace ... --model FACTORY`'s); it must be of the study's model and world size.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@what_if_options
@click.option("--job", hidden=True, help="The job's name (set by the launching process).")
@click.option("--confirm-launches", default="0", hidden=True,
              help="Fresh launches the launching process runs the confirmation in (0: in this job; auto: as many "
                   "as the confirmation's design chooses).")
@click.option("--validated-config", hidden=True, help="The study, validated (set by the launching process).")
def tune(study_toml, plan_out, profile_out, profile_in, no_progress, job, confirm_launches, validated_config,
         **options) -> None:
    """Run a tuning study: record a profile, simulate, race the best plans, confirm the survivor in fresh
    launches, write the study's recommendation. With --target: predict the best plan for a cluster from the
    study's profile (its blocks repeated to --depth), no ranks; the plan's provenance is 'predicted'.

    Outside torchrun this starts the study's nproc_per_node ranks itself, then
    [measure] confirm_launches fresh launches for the confirmation; under
    torchrun it runs as that rank and confirms in its own processes.
    """
    from jobs.tune import TuneJob
    from planner.simulation.what_if import WhatIf
    from planner.study.measured import job_name
    from runtime.ranks.launch import in_torchrun, launch_ranks

    ask = WhatIf(**{f.name: options.pop(f.name) for f in dataclasses.fields(WhatIf)})
    config = study_config(study_toml, validated_config, **options)  # --storage, --sim-trials, ...: the study's keys
    ask.check()
    if ask.target is not None:
        from jobs.predict import tune_for_target

        for line in tune_for_target(config, ask, profile_in or config.default_output(".profile.json"),
                                    plan_out or config.default_output(".predicted.plan.json"), not no_progress):
            click.echo(line)
        return
    if ask.depth is not None:
        raise PlannerError("--depth goes with --target (tune predicts for a cluster then)")
    plan_out = plan_out or config.default_output(".plan.json")
    profile_out = profile_out or config.default_output(".profile.json")
    if in_torchrun():
        log_rank0_progress()
        try:
            launches = None if confirm_launches == "auto" else int(confirm_launches)
            outcome = TuneJob(config, plan_out, profile_out, progress=not no_progress, job=job,
                              confirm_launches=launches, profile_in=profile_in).run()
        except (PlannerError, KeyboardInterrupt) as e:
            exit_on_rank_error(e)
        if outcome is not None:
            from planner.presentation.report import tune_report

            for line in tune_report(outcome, config.name):
                click.echo(line)
        return
    check_before_launch(config, plan_out, profile_out, profile_in=profile_in)
    job = job_name()
    args = ["--plan-out", plan_out, "--profile-out", profile_out, "--job", job,
            "--confirm-launches", "auto" if config.measure.confirm_launches is None
            else str(config.measure.confirm_launches)]
    args += (["--from-profile", profile_in] if profile_in is not None else []) + (["--no-progress"] * no_progress)
    with handed_over(config) as handover:
        exit_with_ranks(launch_ranks(["tune", study_toml, *handover, *args], config.launch), "tuning",
                         _EXPECTED_RANK_EXITS)
        _confirm_in_fresh_launches(study_toml, config, job, plan_out, handover)


def _confirm_in_fresh_launches(study_toml: str, config: StudyConfig, job: str, plan_out: str,
                               handover: list[str]) -> None:
    """The confirmation launches of ``job``'s race survivor, then its verdict and the study's recommendation:
    first the cluster's calibration where it has none (``[measure] calibration_launches``), then as many launches
    of as many rounds as the confirmation's design asks at the cluster's spread. ``handover``: the arguments that
    hand the ranks the validated config (:func:`_handed_over`)."""
    from planner.artifacts.plan import baseline_name
    from planner.presentation.report import conclusion_report, design_line
    from planner.study.confirmation import conclude, design_for, pending
    from runtime.ranks.launch import launch_ranks

    waiting = pending(config, job)
    if waiting is None:
        return  # the race dropped every candidate, or the survivor was confirmed in the job
    design, cluster = design_for(config, waiting)
    calibrate_launches = config.measure.calibration_launches_for(cluster.key.device_type)
    if not cluster.calibrated and calibrate_launches > 0:
        click.echo(f"[calibrate] {cluster.key.text} has no calibration of its spread between launches "
                   f"(now {cluster.line()})")
        _calibrate(study_toml, config, calibrate_launches, handover)
        design, cluster = design_for(config, waiting)
    click.echo(f"[confirm] {cluster.line()}")
    baseline = baseline_name(waiting.baseline.provenance.source == "user")
    click.echo(f"[confirm] trial {waiting.survivor.provenance.trial} against {baseline}: {design_line(design)}")
    how = ("each plan on its own model from its first step" if config.measure.confirm_model_per_plan
           else "one model switching plans")
    for i in range(design.launches):
        click.echo(f"[confirm {i + 1}/{design.launches}] fresh ranks: trial {waiting.survivor.provenance.trial} "
                   f"against {baseline}, {design.rounds} rounds, {how}")
        code = launch_ranks(["confirm", study_toml, *handover, "--job", job, "--rounds", str(design.rounds)],
                            config.launch)
        if code:
            click.echo(f"confirmation launch {i + 1} failed (exit code {code}); concluding on the launches measured",
                       err=True)
            break
    confirmation, best = conclude(config, job, plan_out, horizon=design.horizon)
    for line in conclusion_report(confirmation, best, config.name, plan_out):
        click.echo(line)


def _calibrate(study_toml: str, config: StudyConfig, launches: int, handover: list[str],
               profile_in: str | None = None) -> None:
    """``launches`` fresh calibration launches of the study's cluster ([Note: What a calibration runs] in
    ``planner.study.cluster_spread``), their cost printed first; a launch that fails ends it (its launches so far
    are kept)."""
    from runtime.ranks.launch import launch_ranks

    m = config.measure
    warmup = max(2, m.warmup_steps)
    steps = launches * 2 * (m.calibration_rounds + warmup)
    click.echo(f"[calibrate] {launches} fresh launches x 2 plans x ({warmup} warm-up + {m.calibration_rounds} rounds)"
               f" = {steps} steps, each launch a new process with two model instances")
    extra = ["--from-profile", profile_in] if profile_in is not None else []
    for i in range(launches):
        code = launch_ranks(["calibrate", study_toml, *handover, "--launch", str(i), "--launches", str(launches),
                             *extra], config.launch)
        if code:
            click.echo(f"calibration launch {i + 1} failed (exit code {code}); keeping the launches measured",
                       err=True)
            return


@main.command(hidden=True)
@click.argument("study_toml")
@click.option("--storage", help="SQLAlchemy URL (default: [study] storage).")
@click.option("--job", required=True, help="The tuning job whose race survivor to confirm.")
@click.option("--rounds", type=int, help="Rounds of this launch (default: those the survivor's trial asks for).")
@click.option("--validated-config", hidden=True, help="The study, validated (set by the launching process).")
def confirm(study_toml, storage, job, rounds, validated_config) -> None:
    """One fresh confirmation launch of a tuning job's race survivor (``tune`` runs it; under torchrun, one rank)."""
    from jobs.confirm import ConfirmJob
    from runtime.ranks.launch import in_torchrun, launch_ranks

    config = study_config(study_toml, validated_config, storage=storage)
    if in_torchrun():
        log_rank0_progress()
        try:
            launches = ConfirmJob(config, job, rounds).run()
        except PlannerError as e:
            exit_on_rank_error(e)
        if launches:
            click.echo(f"      launch measured; the survivor now has {launches} launch(es)")
        return
    check_before_launch(config)
    with handed_over(config) as handover:
        exit_with_ranks(launch_ranks(["confirm", study_toml, *handover, "--job", job,
                                       *(["--rounds", str(rounds)] if rounds else [])], config.launch),
                         "confirmation", _EXPECTED_RANK_EXITS)


@main.command()
@click.argument("study_toml")
@click.option("--storage", help="SQLAlchemy URL (default: [study] storage, else sqlite:///<toml dir>/<name>.db).")
@click.option("--launches", type=click.IntRange(2, 48), default=12, show_default=True,
              help="Fresh launches: FSDP2's default against a copy of itself and against unselected plans, in turn.")
@click.option("--from-profile", "profile_in", help="A profile of the model to draw the unselected plans on (default: "
              "the study's latest stored profile; none: the default against a copy of itself only).")
@click.option("--launch", type=int, hidden=True, help="This launch's index (set by the launching process).")
@click.option("--validated-config", hidden=True, help="The study, validated (set by the launching process).")
def calibrate(study_toml, storage, launches, profile_in, launch, validated_config) -> None:
    """Measure this cluster's spread between launches: unselected plans against FSDP2's default in fresh
    launches. The calibration's upper bound replaces the device's prior as the floor of every verdict on this
    cluster (device, backend, world size, mesh) in the study's storage, and new studies there start from it.
    Launches add up: run it again to add more."""
    from jobs.calibrate import CalibrateJob, describe_pair
    from runtime.ranks.launch import in_torchrun

    config = study_config(study_toml, validated_config, storage=storage)
    if in_torchrun():
        log_rank0_progress()
        try:
            result = CalibrateJob(config, launch or 0, launches, profile_in).run()
        except PlannerError as e:
            exit_on_rank_error(e)
        if result is not None:
            click.echo(f"[calibrate {(launch or 0) + 1}/{launches}] {describe_pair(result.last_pair)} measured; "
                       f"{result.line()}")
        return
    check_before_launch(config, profile_in=profile_in)
    with handed_over(config) as handover:
        _calibrate(study_toml, config, launches, handover, profile_in)
    _report_cluster(config)


def _report_cluster(config: StudyConfig) -> None:
    """Print the cluster spreads the study's storage holds now."""
    from planner.storages import open_storage, storage_errors
    from planner.study.cluster_spread import stored_clusters

    with storage_errors(config.storage_url):
        storage = open_storage(config.storage_url, config)
        try:
            for spread in stored_clusters(storage.engine):
                click.echo(f"{spread.key.text}: {spread.line()}")
        finally:
            storage.engine.dispose()


@main.command()
@click.argument("inputs", nargs=-1, required=True, metavar="STUDY_TOML | --from-trace TRACE...")
@click.option("-o", "--output", help="Profile JSON to write (default: <toml dir>/<name>.profile.json).")
@click.option("--torch-trace", help="Also write one default-plan step's torch.profiler trace (rank 0) here.")
@click.option("--from-trace", "from_trace", is_flag=True,
              help="Build the profile from a job's torch.profiler traces (one per rank, or per rank and profiler "
                   "cycle, or their directories); no rank runs.")
@click.option("--model", help="With --from-trace: the traced job's workload factory (package.module:function), "
                              "for the model's own parameter counts (else estimated).")
@click.option("--model-kwargs", help="With --model: the factory's keyword arguments, a JSON object.")
@click.option("--own-plan-out", help="Also write the plan the study's model arrives with (its hand-set prefetch, "
                                     "resharding and knobs, read back: runtime.current_plan) here.")
@click.option("--validated-config", hidden=True, help="The study, validated (set by the launching process).")
def profile(inputs, output, torch_trace, from_trace, model, model_kwargs, own_plan_out, validated_config) -> None:
    """Record a profile on the study's ranks (the recorder `tune` uses), or build one from traces (--from-trace).
    A model that arrives with a plan of its own is recorded under FSDP2's default."""
    if from_trace:
        _profile_from_trace(list(inputs), output, model, model_kwargs)
        return
    if len(inputs) != 1 or model or model_kwargs:
        raise click.UsageError("give one study TOML (or --from-trace and the traces); --model needs --from-trace")
    from jobs.profile import ProfileJob
    from runtime.ranks.launch import in_torchrun, launch_ranks

    study_toml = inputs[0]
    config: StudyConfig = study_config(study_toml, validated_config)
    output = output or config.default_output(".profile.json")
    if in_torchrun():
        log_rank0_progress()
        try:
            result = ProfileJob(config, output, torch_trace, own_plan_out).run()
        except PlannerError as e:
            exit_on_rank_error(e)
        if result is not None:
            recorded, predicted_ms, own = result
            click.echo(f"profile written to {output}: {len(recorded.modules)} FSDP modules, measured step "
                       f"{recorded.measured_step_ms:.1f} ms (FSDP2 default), predicted {predicted_ms:.1f} ms")
            if own is not None or own_plan_out:
                click.echo("the model arrives with " + ("a plan of its own" if own else "FSDP2's default")
                           + (f", written to {own_plan_out}" if own_plan_out else "")
                           + (" (`prefetch-planner check` prices it)" if own else ""))
        return
    check_before_launch(config, output, torch_trace, own_plan_out, storage=False)
    with handed_over(config) as handover:
        code = launch_ranks(["profile", study_toml, *handover, "-o", output]
                            + (["--torch-trace", torch_trace] if torch_trace else [])
                            + (["--own-plan-out", own_plan_out] if own_plan_out else []), config.launch)
    exit_with_ranks(code, "profiling", (2,))


@main.command()
@click.argument("plan_json")
@click.argument("study_toml")
@click.option("--launches", type=click.IntRange(1, 20), default=3, show_default=True,
              help="Fresh launches of the study's ranks (each a new process per rank).")
@click.option("--rounds", type=click.IntRange(4, 500), default=24, show_default=True,
              help="Interleaved rounds per launch: one step of the plan's model and one of FSDP2's default's.")
@click.option("--json", "json_out", help="Also write the launches' rounds and the result to this JSON file.")
@click.option("--out", hidden=True, help="Where rank 0 writes its launch's rounds (set by the launching process).")
@click.option("--validated-config", hidden=True, help="The study, validated (set by the launching process).")
def verify(plan_json, study_toml, launches, rounds, json_out, out, validated_config) -> None:
    """Re-measure a plan against FSDP2's default as a user's job runs it, and check its claim.

    Each launch starts the study's ranks afresh; every rank builds the study's model twice, applies the plan from
    PLAN_JSON to one (load_plan, apply_plan) and leaves the other as fully_shard wrapped it, and times interleaved
    rounds; nothing of the tuner is loaded. Prints the total-time ratio over the launches with its 95% interval and
    whether it agrees with the plan's recorded claim. Under torchrun it runs as that rank, one launch.
    """
    from jobs.verify import LaunchTimes, check_before_launch, verify_rank
    from runtime.ranks.launch import in_torchrun, launch_ranks

    config = study_config(study_toml, validated_config)
    if in_torchrun():
        log_rank0_progress()
        try:
            times = verify_rank(config, plan_json, rounds)
        except PlannerError as e:
            exit_on_rank_error(e)
        if times is not None and out:
            times.to_json(out)
        elif times is not None:  # the user's own torchrun: this one launch is the re-measurement
            from planner.presentation.verify_report import claim_line
            from runtime.apply import load_plan

            plan = load_plan(plan_json)
            click.echo(claim_line(plan, plan_json))
            _verify_report(plan, plan_json, [times], json_out, config)
        return
    plan = check_before_launch(config, plan_json)
    from planner.presentation.verify_report import claim_line, launch_line

    click.echo(claim_line(plan, plan_json))
    measured: list[LaunchTimes] = []
    with handed_over(config) as handover, tempfile.TemporaryDirectory(prefix="prefetch-planner-") as folder:
        for i in range(launches):
            click.echo(f"[verify {i + 1}/{launches}] fresh ranks: the plan from its file and FSDP2's default, one "
                       f"model each, {rounds} interleaved rounds")
            path = str(Path(folder) / f"launch{i}.json")
            code = launch_ranks(["verify", plan_json, study_toml, *handover, "--rounds", str(rounds), "--out", path],
                                config.launch)
            exit_with_ranks(code, "verify", _EXPECTED_RANK_EXITS)
            measured.append(LaunchTimes.load(path))
            click.echo(launch_line(i + 1, launches, measured[-1].plan_ms, measured[-1].default_ms))
    _verify_report(plan, plan_json, measured, json_out, config)


def _verify_report(plan: Any, plan_json: str, measured: list[Any], json_out: str | None,
                   config: StudyConfig) -> None:
    """Print the combined re-measurement and the check against the claim, at the cluster's floor of the spread
    (its calibration in the study's storage, else its device's prior); write ``json_out`` when given."""
    import json

    from planner.presentation.verify_report import verification, verify_report
    from planner.study.cluster_spread import ClusterKey, stored_cluster_spread

    cluster = stored_cluster_spread(config.storage_url, ClusterKey.of(plan.fingerprint, config.launch.backend))
    result = verification(plan, [(t.plan_ms, t.default_ms) for t in measured], cluster.spread)
    loaded = sorted({m for t in measured for m in t.tuner_modules})
    for line in verify_report(result, loaded):
        click.echo(line)
    if json_out:
        c, check = result.confirmation, result.check
        Path(json_out).write_text(json.dumps({
            "plan": plan_json, "claimed": check.claimed, "claimed_ci95": check.claimed_ci95,
            "verified": c.ratio, "verified_ci95": c.ci95, "verdict": str(c.verdict), "agreement": check.agreement.name,
            "ratio_of_ratios": check.ratio_of_ratios, "launch_ratios": result.launch_ratios,
            "launches": [t.__dict__ for t in measured]}, indent=1))


def _profile_from_trace(paths: list[str], output: str | None, model: str | None, model_kwargs: str | None) -> None:
    from jobs.from_trace import profile_from_trace

    if not output:
        raise click.UsageError("--from-trace needs -o/--output, the profile JSON to write")
    traced, predicted_ms = profile_from_trace(paths, output, model, model_kwargs)
    p = traced.profile
    click.echo(f"profile written to {output}: {len(p.modules)} FSDP modules from {len(traced.ranks)} trace(s) "
               f"(ranks {', '.join(map(str, traced.ranks))}; {traced.steps} step(s) each), traced step "
               f"{p.measured_step_ms:.1f} ms (max across ranks of the median); from the profile's figures alone the "
               f"simulator predicts {predicted_ms:.1f} ms ({100 * (predicted_ms / p.measured_step_ms - 1):+.1f}%), "
               "and `tune` solves its in-step parameters from the traced step")
    if p.outside_ms:
        click.echo(f"  measured: {p.outside_ms:.1f} ms a step of work outside the modules (the loss, zero_grad, "
                   "FSDP2's hooks, the loop), in every simulated step")
    for m in traced.missing:
        click.echo(f"  estimated: {m.line()}")


if __name__ == "__main__":
    main()
