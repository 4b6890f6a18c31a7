"""``prefetch-planner studies``: query the studies in a database (list, show, best, pareto, export), and forget one.
They never import torch."""

from __future__ import annotations

import json
from pathlib import Path

import click

from planner.artifacts.config import default_storage
from planner.errors import PlannerError
from planner.units import mib, ms


@click.group()
def studies() -> None:
    """Query studies in a database."""


def _storage_for(name: str, storage: str | None) -> str:
    return storage or default_storage(name)


@studies.command("list")
@click.option("--storage", help="SQLAlchemy URL (default: every studies/*.db).")
def studies_list(storage) -> None:
    """List studies: trials, the recommended plan and its confirmed ratio to FSDP2's default of the same job."""
    from planner.study import list_studies

    urls = [storage] if storage else [f"sqlite:///{p}" for p in sorted(Path("studies").glob("*.db"))]
    if not urls:
        raise PlannerError("no databases under studies/; pass --storage URL")
    click.echo(f"{'study':<24} {'measured':>8} {'simulated':>9} {'recommended':>11} {'confirmed ratio [95% CI]':>26}  "
               f"{'verdict (launches)':<34}  {'default ms (race)':>17}  storage")
    for url in urls:
        for s in list_studies(url):
            c = s.confirmation
            confirmed = f"{c.ratio:.3f} [{c.ci95[0]:.3f}, {c.ci95[1]:.3f}]" if c is not None else "-"
            recommended = "-" if s.recommended_trial is None else (
                f"trial {s.recommended_trial}" if c is not None and s.pending_trial is None else "default")
            verdict = "-"
            if c is not None:  # a median-based verdict is not a total-time one: never shown as plain "faster"
                verdict = f"{c.verdict}{'' if c.total_time else ', median'} ({c.launches})"
                verdict += f", trial {s.pending_trial} pending" if s.pending_trial is not None else ""
            click.echo(f"{s.name:<24} {s.measured_trial_count:>8} {s.simulated_trial_count:>9} {recommended:>11} "
                       f"{confirmed:>26}  {verdict:<34}  {ms(s.default_ms):>17}  {url}")


@studies.command("show")
@click.argument("name")
@click.option("--storage", help="SQLAlchemy URL (default: sqlite:///studies/NAME.db).")
@click.option("--top", default=10, show_default=True, help="Simulated trials to show (best first).")
def studies_show(name, storage, top) -> None:
    """Show a study's measured trials (predicted vs race median), every confirmation per plan, and its best
    simulated trials."""
    from planner.errors import StudyNotFoundError
    from planner.study import confirmation_history, study_trials
    from planner.study.predicted import predicted_plans

    try:
        trials = study_trials(_storage_for(name, storage), name)
    except StudyNotFoundError:
        if not predicted_plans(_storage_for(name, storage), name):
            raise
        click.echo(f"study {name}: nothing measured yet")
        _show_predicted(_storage_for(name, storage), name)
        return
    click.echo(f"study {name}: {len(trials.measured)} measured trials, {len(trials.simulated)} simulated trials")
    click.echo(
        f"\nmeasured stage (race medians; the confirmation on the plan it confirmed)\n  {'trial':>5} {'state':<8} "
        f"{'predicted ms':>12} {'race ms':>11} {'error %':>8}  params"
    )
    for r in trials.measured:
        err = ""
        if r.predicted_ms and r.race_ms:
            err = f"{100 * (r.predicted_ms - r.race_ms) / r.race_ms:+.1f}"
        tag = "yours (the plan the model arrived with), the baseline " if r.user_plan else (
            "default, the baseline " if r.is_default and r.is_baseline else "default " if r.is_default else "")
        if r.retry_of is not None:
            tag += f"retry of {r.retry_of} "
        if r.reconfirms is not None:
            tag += f"recommended by trial {r.reconfirms}, raced again "
        if r.predicted_for is not None:
            tag += f"predicted for {r.predicted_for.split(';')[0]}, raced first "
        if r.race is not None and r.race.dropped_after_round is not None:
            tag += f"dropped after {r.race.dropped_after_round} rounds "
        click.echo(f"  {r.number:>5} {r.state.name:<8} {ms(r.predicted_ms):>12} {ms(r.race_ms):>11} "
                   f"{err:>8}  {tag}{json.dumps(_short(r.params))}")
        if r.confirmation is not None:
            click.echo(f"  {'':>5} {'':<8} confirmed: {r.confirmation.line()}")
        elif r.confirm_rounds is not None:
            click.echo(f"  {'':>5} {'':<8} survived the race; its confirmation did not conclude "
                       f"({len(r.confirm_launches or [])} launch(es) measured)")
        if r.failure is not None:
            click.echo(f"  {'':>5} {'':<8} reason: {r.failure.reason}")
    history = {k: v for k, v in confirmation_history(trials.measured).items() if len(v) > 1}
    if history:
        click.echo("\nplans confirmed more than once (every confirmation, oldest first)")
        for records in history.values():
            click.echo("  " + "; ".join(f"trial {r.number} (job {r.job}): {r.confirmation.verdict} "
                                        f"{r.confirmation.ratio:.3f}" for r in records))
    _show_watches_and_clusters(_storage_for(name, storage), name)
    _show_predicted(_storage_for(name, storage), name)
    best = sorted((r for r in trials.simulated if r.predicted_ms is not None), key=lambda r: r.predicted_ms)[:top]
    click.echo(f"\nsimulated stage (best {len(best)})\n  {'trial':>5} {'predicted ms':>12}  params")
    for r in best:
        click.echo(f"  {r.number:>5} {ms(r.predicted_ms):>12}  {json.dumps(_short(r.params))}")


def _show_watches_and_clusters(url: str, name: str) -> None:
    """The plans applied in the process that measured them and how their watch ended; the calibrated clusters of the
    storage. Nothing is printed where there is none."""
    import sqlalchemy as sa

    from planner.storages import open_storage_read_only
    from planner.storages.archive import watch_rows
    from planner.study.cluster_spread import stored_clusters

    storage = open_storage_read_only(url)
    try:
        watches, clusters = watch_rows(storage.engine, name), stored_clusters(storage.engine)
    except sa.exc.SQLAlchemyError:  # a storage written before these tables
        return
    finally:
        storage.engine.dispose()
    if watches:
        click.echo("\napplied in the process that measured them (faster on its fresh rounds; the study keeps them "
                   "provisional), watched against FSDP2's default")
        for trial, w in watches.items():
            ratio = f"{w.ratio:.3f}" if w.ratio is not None else "-"
            end = "reverted to FSDP2's default: slower in total" if w.reverted else "kept"
            click.echo(f"  trial {trial} (job {w.job}): ratio {ratio} over {w.checks} checks ({w.steps} steps); "
                       f"{end}")
    if clusters:
        click.echo("\nspread between launches of the clusters in this storage (the floor of their verdicts)")
        for c in clusters:
            click.echo(f"  {c.key.text}: {c.line()}")


def _show_predicted(url: str, name: str) -> None:
    """The plans ``tune --target`` predicted, apart: never measured, never the recommendation."""
    from planner.study.predicted import predicted_plans

    records = predicted_plans(url, name)
    if not records:
        return
    click.echo(f"\npredicted plans (tune --target; not measured, never recommended: AutoTuner(..., start_from=...) "
               f"races one first on the cluster)\n  {'trial':>5} {'predicted ms':>12} {'band ms':>19} {'ratio':>6}  "
               "target")
    for r in records:
        pv = r.plan.provenance
        band = f"[{pv.band_ms[0]:.1f}, {pv.band_ms[1]:.1f}]" if pv.band_ms else "-"
        click.echo(f"  {r.number:>5} {ms(pv.predicted_ms):>12} {band:>19} {pv.predicted_ms / r.default_ms:>6.3f}  "
                   f"{pv.target}")


def _short(params: dict) -> dict:
    """Collapse per-module parameters to their distinct values."""
    if len(params) <= 4:
        return params
    out: dict = {}
    for k, v in params.items():
        prefix = k.split(":")[0]
        out.setdefault(prefix, set()).add(v) if ":" in k else out.__setitem__(k, v)
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


@studies.command("best")
@click.argument("name")
@click.option("--storage", help="SQLAlchemy URL (default: sqlite:///studies/NAME.db).")
def studies_best(name, storage) -> None:
    """The plan the study recommends: its latest tuning job's plan confirmed faster than FSDP2's default of the
    same job, else the default."""
    from planner.study import best_plan

    best = best_plan(_storage_for(name, storage), name)
    plan, pv, r = best.plan, best.plan.provenance, best.recommendation
    click.echo(f"study {name}: {best.line(name)}")
    if not best.keeps_baseline:
        click.echo(f"  race (not confirmed): median {pv.measured_ms:.1f} ms, FSDP2's default {ms(r.baseline_ms)} ms "
                   "in the same race")
    click.echo(f"  predicted  {ms(pv.predicted_ms)} ms")
    click.echo("  " + "  ".join(f"{k} {v}" for k, v in plan.knobs.items()))
    for fqn, m in plan.modules.items():
        click.echo(f"  {fqn or '<root>':<28} forward {list(m.forward_prefetch) or 'implicit'}  "
                   f"backward {list(m.backward_prefetch) or 'default'}  reshard_after_forward {m.reshard_after_forward}"
                   + "".join(f"  {k} {v}" for k, v in m.knobs.changed.items()))


@studies.command("pareto")
@click.argument("name")
@click.option("--storage", help="SQLAlchemy URL (default: sqlite:///studies/NAME.db).")
@click.option("--png", help="Also draw the front and the measured points to this PNG.")
def studies_pareto(name, storage, png) -> None:
    """The predicted time/memory Pareto front of the simulated stage, and the measured points."""
    from planner.study import pareto_front, study_trials

    trials = study_trials(_storage_for(name, storage), name)
    simulated = [t for t in trials.simulated if t.predicted_peak_bytes is not None and t.predicted_ms is not None]
    measured = [t for t in trials.measured if t.measured_peak_bytes is not None]
    front = pareto_front(simulated)
    click.echo(f"study {name}: predicted Pareto front, {len(front)} plans of {len(simulated)} simulated trials "
               "(peak per rank; faster needs more memory)")
    click.echo(f"  {'peak MiB':>9} {'predicted ms':>12} {'trial':>6}  plan")
    for t in front:
        click.echo(f"  {mib(t.predicted_peak_bytes, unit=False):>9} {t.predicted_ms:>12.1f} {t.number:>6}  "
                   f"{_plan_line(t.params)}")
    click.echo(f"measured points ({len(measured)}): peak per rank (max across ranks), race median")
    click.echo(f"  {'peak MiB':>9} {'predicted':>9} {'measured ms':>11} {'trial':>6}  outcome")
    for t in measured:
        outcome = "yours" if t.user_plan else "FSDP2 default" if t.is_default else (t.verdict or t.state.name)
        if t.failure is not None:
            outcome = f"FAIL: {t.failure.reason}"
        click.echo(f"  {mib(t.measured_peak_bytes, unit=False):>9} {mib(t.predicted_peak_bytes, unit=False):>9} "
                   f"{ms(t.race_ms):>11} {t.number:>6}  {outcome}")
    if png:
        from planner.presentation.pareto_plot import plot_pareto

        plot_pareto(name, simulated, front, measured, png)
        click.echo(f"wrote {png}")


def _plan_line(params: dict) -> str:
    """A plan's parameters on one line; per-module reshard flags as "k of n groups kept unsharded after forward"."""
    resharding = [v for k, v in params.items() if k.startswith("raf:")]
    line = json.dumps(_short({k: v for k, v in params.items() if not k.startswith("raf:")}))
    if resharding:
        line += f", {sum(not v for v in resharding)} of {len(resharding)} module groups kept unsharded after forward"
    return line


@studies.command("export")
@click.argument("name")
@click.option("-o", "--output", required=True, help="Plan JSON to write.")
@click.option("--storage", help="SQLAlchemy URL (default: sqlite:///studies/NAME.db).")
def studies_export(name, output, storage) -> None:
    """Write the plan the study recommends (as `studies best` names it) as Plan JSON."""
    from planner.study import best_plan

    plan = best_plan(_storage_for(name, storage), name).plan
    try:
        plan.to_json(output)
    except OSError as e:
        raise PlannerError(f"cannot write {output!r}: {e.strerror}") from None
    click.echo(f"wrote {output} (trial {plan.provenance.trial}, race median {ms(plan.provenance.measured_ms)} ms)")


@studies.command("forget")
@click.argument("name")
@click.option("--storage", help="SQLAlchemy URL (default: sqlite:///studies/NAME.db).")
@click.option("--yes", is_flag=True, help="Remove it (without: say what would go, remove nothing, exit 2).")
def studies_forget(name, storage, yes) -> None:
    """Forget a study, so that no later start applies its recommendation: its measured and simulated trials, its
    predicted plans and the planner's rows of them go; the cluster's calibration launches stay. The next
    AutoTuner tunes afresh; PREFETCH_PLANNER=off runs the model's own plan without tuning."""
    from planner.study import forget_study

    forgotten = forget_study(_storage_for(name, storage), name, dry_run=not yes)
    if not yes:
        raise PlannerError(forgotten.line(done=False))
    click.echo(forgotten.line(done=True))
