"""``prefetch-planner tune --target``: the best plan for a cluster not yet rented, predicted from the study's profile.

No ranks run: the profile (recorded by ``profile`` or an earlier ``tune``) is
re-timed for the target, extended to the model's depth when asked, searched in
memory, and the best plan written with provenance ``predicted``
([Note: Predicted plans are raced, never recommended] in
``planner.study.predicted``).
"""

from __future__ import annotations

from pathlib import Path

from planner.artifacts.config import StudyConfig
from planner.artifacts.profile import Profile
from planner.errors import PlannerError
from planner.simulation.what_if import WhatIf
from planner.units import mib


def tune_for_target(config: StudyConfig, ask: WhatIf, profile_path: str, plan_out: str, progress: bool) -> list[str]:
    """Predict, store and write the target's plan; the report's lines.

    Args:
        config: the study.
        ask: the target and the depth (``--target``, ``--world-size``, ``--mesh``, ``--depth``, ``--blocks``).
        profile_path: the study's profile.
        plan_out: where the predicted plan goes.
        progress: Optuna's progress bar.

    Raises:
        ProfileFormatError: no profile at ``profile_path`` (one line: how to record one), or a bad ``--depth``.
        TargetError: a bad target.
        MemoryBudgetError: a relative budget, or one nothing fits.
        StorageError: the study's storage cannot be written.
        PlannerError: the plan cannot be written.
    """
    from planner.errors import ProfileFormatError
    from planner.study.predicted import predict_for_target, store_predicted
    from search_spaces import get_space
    from search_spaces.session import optuna_quiet

    if not Path(profile_path).is_file():
        raise ProfileFormatError(f"no profile at {profile_path!r}: tune --target predicts from the study's profile; "
                                 "record one (`prefetch-planner profile STUDY_TOML`) or pass --from-profile FILE")
    scenario = ask.apply(Profile.load(profile_path))
    recorded, profile, target = scenario.recorded, scenario.profile, scenario.target
    lines = [f"depth       {scenario.deepened.report.describe()}"] if scenario.deepened is not None else []
    with optuna_quiet():  # not a line per simulated trial
        predicted = predict_for_target(config, scenario, get_space(config.search.space), progress)
        number = store_predicted(config.storage_url, config.name, predicted)
    plan = predicted.plan
    try:
        plan.to_json(plan_out)
    except OSError as e:
        raise PlannerError(f"cannot write {plan_out!r}: {e.strerror}") from None
    pv = plan.provenance
    low, high = pv.band_ms
    dlow, dhigh = predicted.default_band_ms
    same = plan.is_default_for(profile) if plan.fingerprint == profile.fingerprint else False
    return lines + [
        f"target      {target.describe()}",
        f"profile     {profile_path} ({recorded.fingerprint.world_size} rank(s), "
        f"{recorded.fingerprint.device_type}); {predicted.trials} simulated trials on the target",
        f"FSDP2 default   {predicted.default_ms:9.1f} ms  band [{dlow:.1f}, {dhigh:.1f}]",
        f"predicted plan  {pv.predicted_ms:9.1f} ms  band [{low:.1f}, {high:.1f}]  ratio "
        f"{pv.predicted_ms / predicted.default_ms:.3f}; the band's largest part: {predicted.band_dominant}; "
        f"peak {mib(pv.predicted_peak_bytes)} per rank" + ("  (no plan beats FSDP2's default here)" if same else ""),
        f"wrote {plan_out}: provenance 'predicted' (trial {number} of study {config.name}.predicted); not measured, "
        "so never the study's recommendation",
        f"confirm it on the cluster: AutoTuner(model, {config.name!r}, start_from={plan_out!r}) races it first "
        "against FSDP2's default on your steps, and keeps it only if it is confirmed faster",
    ]
