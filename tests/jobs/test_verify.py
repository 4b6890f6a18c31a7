"""``prefetch-planner verify`` end to end on 2 gloo ranks: fresh launches as a user's job runs, the rounds combined,
the claim checked, nothing of the tuner loaded; and under the user's own torchrun, one launch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from planner.artifacts.plan import ModulePlan, Plan
from runtime.fake_world import workload_fingerprint
from tests.jobs.study import STUDY
from tests.multirank import rank_env, run_cli

FACTORY, KWARGS = "runtime.reference_workloads:mlp", {"dim": 128, "layers": 4}  # the model of tests.jobs.study


def _claimed_plan(tmp_path) -> str:
    """Prefetch 1 with async unshard, with a confirmation's claim in its provenance."""
    fingerprint = workload_fingerprint(FACTORY, KWARGS, 2)
    order = fingerprint.module_fqns
    modules = {f: ModulePlan(forward_prefetch=(order[i + 1],) if 0 < i < len(order) - 1 else ()) for i, f in
               enumerate(order)}
    plan = Plan(fingerprint, modules).with_knobs(unshard_async_op=True)
    plan = plan.with_provenance(study="e2e", trial=1, verdict="faster", measured_ratio=0.9,
                                ratio_ci95=(0.8, 1.0), rounds=24, launches=2, ratio_of="total time")
    path = tmp_path / "plan.json"
    plan.to_json(path)
    return str(path)


@pytest.mark.slow
def test_verify_measures_fresh_launches_as_a_users_job(tmp_path):
    (tmp_path / "study.toml").write_text(STUDY.format(space="uniform"))
    plan = _claimed_plan(tmp_path)
    proc = run_cli("verify", plan, "study.toml", "--launches", "2", "--rounds", "6", "--json", "out.json",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["launches"]) == 2
    assert all(len(t["plan_ms"]) == len(t["default_ms"]) == 6 for t in out["launches"])
    assert all(t["tuner_modules"] == [] and t["world_size"] == 2 for t in out["launches"])
    assert out["claimed"] == 0.9 and out["agreement"] in ("AGREES", "ABOVE", "BELOW")
    low, high = out["verified_ci95"]
    assert low <= out["verified"] <= high
    assert "claimed total-time ratio 0.900" in proc.stdout
    assert proc.stdout.count("[verify ") == 2 and "verified: total-time ratio" in proc.stdout
    assert "loaded nothing of the tuner" in proc.stdout


@pytest.mark.slow
def test_verify_under_torchrun_is_one_launch(tmp_path):
    (tmp_path / "study.toml").write_text(STUDY.format(space="uniform"))
    plan = _claimed_plan(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "jobs.cli", "verify", plan, "study.toml", "--rounds", "6"],
        capture_output=True, text=True, env=rank_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("verified: total-time ratio") == 1  # rank 0 alone reports
    assert "over 6 fresh rounds in 1 launch" in proc.stdout


def test_a_plan_without_a_total_time_claim_is_reported_not_checked():
    from planner.presentation.verify_report import claim_line, verification

    fingerprint = workload_fingerprint(FACTORY, KWARGS, 2)
    plan = Plan(fingerprint, {})
    rounds = ([100.0, 101.0, 99.0, 100.0], [110.0, 111.0, 109.0, 110.0])
    assert verification(plan, [rounds]).check.agreement.name == "NO_CLAIM"
    assert "records no confirmed ratio" in claim_line(plan, "p.json")
    older = plan.with_provenance(measured_ratio=0.8, ratio_ci95=(0.7, 0.9))  # a median ratio, before total time
    assert verification(older, [rounds]).check.agreement.name == "NO_CLAIM"
    assert "not a total-time ratio" in claim_line(older, "p.json")
    claimed = older.with_provenance(ratio_of="total time")
    assert verification(claimed, [rounds]).check.agreement.name != "NO_CLAIM"


def test_the_study_model_a_plan_is_checked_against_is_built_on_the_studys_layout(tmp_path):
    """Before any rank starts, ``verify`` builds the study's model on a fake world on the mesh its ranks would start:
    under ``[launch] tensor_parallel = 2`` the (dp, tp) mesh, whose TP-local parameter counts a plan tuned there
    carries; a plan of the same model without TP differs from it in one line."""
    from jobs.verify import check_before_launch
    from planner.artifacts.config import load_study_config
    from planner.errors import PlanMismatchError

    llama = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 128, "seq_len": 16}
    tp = workload_fingerprint("runtime.reference_workloads:llama", llama, 4, tensor_parallel=2)
    whole = workload_fingerprint("runtime.reference_workloads:llama", llama, 4)
    assert tp.tensor_parallel == 2 and whole.tensor_parallel is None
    assert tp.param_numels[1] == (4 * 64 * 64 + 3 * 64 * 128) // 2 + 2 * 64  # the projections halved, norms whole
    toml = tmp_path / "tp.toml"
    toml.write_text(f'[study]\nname = "tp"\n[workload]\nfactory = "runtime.reference_workloads:llama"\n'
                    f'kwargs = {json.dumps(llama).replace(":", " =")}\n'
                    '[launch]\nnproc_per_node = 4\ntensor_parallel = 2\n')
    config = load_study_config(toml)
    for fingerprint, fits in ((tp, True), (whole, False)):
        path = tmp_path / "plan.json"
        Plan(fingerprint, {}).to_json(path)
        if fits:
            assert check_before_launch(config, str(path)).fingerprint == tp
        else:
            with pytest.raises(PlanMismatchError, match="parameter count of FSDP module 'model.layers.0'"):
                check_before_launch(config, str(path))
