"""``prefetch-planner check``: the plan a model arrives with, read back, matched against the known-bad patterns
and priced against FSDP2's default and the study's recommendation (``planner.study.check``).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

import click

from jobs.launching import exit_with_ranks, handed_over, study_config
from jobs.outputs import check_before_launch
from planner.artifacts.config import StudyConfig, default_storage


@click.command()
@click.argument("inputs", nargs=-1, required=True, metavar="STUDY_TOML | PROFILE_JSON PLAN_JSON")
@click.option("--study", "study_name", help="With a profile and a plan: the study whose recommendation is priced "
                                            "beside (default: none).")
@click.option("--storage", help="The study's SQLAlchemy URL (default: [study] storage, else "
                                "sqlite:///studies/<name>.db).")
@click.option("--memory-budget", help='Peak per rank a prefetch depth is checked against: "1.5GiB", or above '
                                     'FSDP2\'s default\'s measured peak, "+150MiB", "+10%" (default: [search] '
                                     "memory_budget; none).")
@click.option("--reentrant", is_flag=True, help="The model checkpoints with use_reentrant=True.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--validated-config", hidden=True, help="The study, validated (set by the launching process).")
def check(inputs, study_name, storage, memory_budget, reentrant, as_json, validated_config) -> None:
    """Check the plan a model arrives with: its configuration read back per module, the known-bad patterns it
    matches (each with its source and fix), and its simulated step and peak against FSDP2's default and the study's
    recommendation. With a study TOML, the study's ranks record a profile under FSDP2's default and read the plan
    the factory's model has; with a profile and a plan JSON (`profile --own-plan-out`'s), no rank runs."""
    import json as json_module

    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.study.check import check_plan

    if len(inputs) == 1:
        config: StudyConfig = study_config(inputs[0], validated_config)
        profile_json, plan_json = _profile_and_own_plan(inputs[0], config)
        study_name, storage = study_name or config.name, storage or config.storage_url
        memory_budget = memory_budget or config.search.memory_budget
    elif len(inputs) == 2:
        profile_json, plan_json = inputs
        storage = storage or (default_storage(study_name) if study_name else None)
    else:
        raise click.UsageError("give a study TOML, or a profile JSON and a plan JSON")
    profile, plan = Profile.load(profile_json), Plan.load(plan_json)
    budget = None
    if memory_budget:
        from planner.artifacts.memory_budget import MemoryBudget

        budget = MemoryBudget.parse(memory_budget).resolve(profile.measured_peak_bytes)
    recommended, label = _recommendation(study_name, storage, profile) if study_name else (None, None)
    report = check_plan(plan, profile, recommended, label, budget, reentrant)
    if as_json:
        click.echo(json_module.dumps(report.to_dict(), indent=1))
        return
    for line in report.lines():
        click.echo(line)


def _profile_and_own_plan(study_toml: str, config: StudyConfig) -> tuple[str, str]:
    """``check STUDY_TOML``: the study's ranks record a profile under FSDP2's default and read back the plan the
    model arrives with; both are written beside the study (``NAME.profile.json``, ``NAME.own.plan.json``)."""
    from runtime.ranks.launch import launch_ranks

    profile_json = config.default_output(".profile.json")
    plan_json = config.default_output(".own.plan.json")
    check_before_launch(config, profile_json, plan_json, storage=False)
    with handed_over(config) as handover:
        code = launch_ranks(["profile", study_toml, *handover, "-o", profile_json, "--own-plan-out", plan_json],
                            config.launch)
    exit_with_ranks(code, "profiling", (2,))
    return profile_json, plan_json


def _recommendation(study_name: str, storage: str, profile: Any) -> tuple[Any, str | None]:
    """The study's recommendation for the profile's model (``None`` when it has none, or no such study)."""
    from planner.errors import StudyNotFoundError
    from planner.study.queries import recommendation_for

    try:
        best = recommendation_for(storage, study_name, profile.fingerprint)
    except StudyNotFoundError:
        return None, None
    if best is None or best.keeps_baseline:
        return None, None
    return best.plan, f"study {study_name!r}'s recommendation (trial {best.plan.provenance.trial})"
