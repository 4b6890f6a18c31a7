"""``prefetch-planner profile --from-trace`` on real traces: a user's plain loop on 2 gloo CPU ranks, traced with
torch.profiler (``tests/runtime/rank_scripts/trace_loop.py``), read back into a profile the simulator and a plan
accept."""

from __future__ import annotations

import json

import pytest

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import Profile
from planner.simulation.parameters import simulate
from search_spaces import uniform
from tests.multirank import run_cli, run_ranks

MLP = "runtime.reference_workloads:mlp"
KWARGS = {"dim": 64, "layers": 4}
BLOCKS = tuple(f"blocks.{i}" for i in range(4))


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, 2])
def test_profile_from_a_users_cpu_traces(tmp_path, microbatches):
    run_ranks("trace_loop.py", MLP, json.dumps(KWARGS), str(microbatches), "2", str(tmp_path))
    own = Fingerprint(**{k: tuple(v) if isinstance(v, list) else v
                         for k, v in json.loads((tmp_path / "fingerprint.json").read_text()).items()})
    out = tmp_path / "profile.json"
    proc = run_cli("profile", "--from-trace", str(tmp_path / "traces"), "-o", str(out), "--model", MLP,
                   "--model-kwargs", json.dumps(KWARGS), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "from 2 trace(s) (ranks 0, 1; 2 step(s) each)" in proc.stdout, proc.stdout
    assert "of work outside the modules" in proc.stdout, proc.stdout
    profile = Profile.load(out)
    assert profile.fingerprint == own  # the fake world's model is the ranks' model
    assert profile.source == "trace" and "fingerprint" not in profile.estimated
    assert profile.post_forward_order == (*BLOCKS, "") and profile.pre_forward_order == ("", *BLOCKS)
    assert profile.microbatches == microbatches
    for fqn, nbytes in zip(own.module_fqns, own.param_bytes, strict=True):
        m = profile.modules[fqn]
        assert m.reshard_after_forward == (fqn != "")  # FSDP2 keeps the root unsharded after forward
        assert m.fwd_ms > 0 and m.bwd_ms > 0 and m.all_gather_ms > 0 and m.reduce_scatter_ms > 0
        assert m.unsharded_bytes == nbytes and m.grad_bytes == nbytes  # the reduce-scatter input, unpadded here
    assert profile.measured_step_ms > profile.optimizer_ms > 0 and profile.measured_peak_bytes > sum(own.param_bytes)
    # a CPU step is one thread: what no module, collective or optimizer holds is measured and simulated
    assert 0 < profile.outside_ms < profile.measured_step_ms
    plan = uniform.build(profile, 1, 1).with_knobs(unshard_async_op=True)
    plan.check_matches(profile)  # a plan made on it names the model's modules and counts
    assert simulate(profile, plan).step_ms > 0

    # Without --model the parameter counts are the all-gathers' (padded to the world size), and it says so.
    proc = run_cli("profile", "--from-trace", str(tmp_path / "traces"), "-o", str(tmp_path / "estimated.json"),
                   cwd=tmp_path)
    assert proc.returncode == 0 and "estimated: parameter counts: all-gather sizes" in proc.stdout, proc.stdout
    estimated = Profile.load(tmp_path / "estimated.json")
    assert "fingerprint" in estimated.estimated
    assert all(e >= n for e, n in zip(estimated.fingerprint.param_numels, own.param_numels, strict=True))


@pytest.mark.slow
def test_a_checkpointed_models_trace_shows_its_recompute(tmp_path):
    """Every other block checkpointed: its forward ops run again inside its backward stretch, and the trace
    profile names those blocks, with a recompute inside their backward and the memory it held."""
    from planner.traces.trace_profile import profile_from_traces

    kwargs = {**KWARGS, "activation_checkpointing": "selective"}
    run_ranks("trace_loop.py", MLP, json.dumps(kwargs), "1", "2", str(tmp_path))
    profile = profile_from_traces([str(tmp_path / "traces")]).profile
    recomputes = {fqn for fqn, m in profile.modules.items() if m.recompute_ms > 0}
    assert recomputes == {"blocks.1", "blocks.3"}
    for fqn in recomputes:
        m = profile.modules[fqn]
        assert m.recompute_ms < m.bwd_ms
        assert m.recompute_activation_bytes >= 8 * 4 * 64 * 4  # at least fc1's output (batch 8, fp32)
        assert m.activation_bytes < profile.modules["blocks.0"].activation_bytes  # it kept only its input


@pytest.mark.slow
def test_a_study_tunes_from_a_trace_profile(tmp_path):
    """``tune --from-profile`` skips recording: the trace profile (built with --model) drives the search, the
    race runs on the real ranks; a profile of another model is refused, one line, exit 2, before any step."""
    from tests.runtime.ranks.test_cluster import finish, start_tune, write_study

    run_ranks("trace_loop.py", MLP, json.dumps(KWARGS), "1", "2", str(tmp_path))
    traced = tmp_path / "trace.profile.json"
    proc = run_cli("profile", "--from-trace", str(tmp_path / "traces"), "-o", str(traced), "--model", MLP,
                   "--model-kwargs", json.dumps(KWARGS), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    toml = write_study(tmp_path / "s.toml", f"sqlite:///{tmp_path}/s.db", measured=3, rounds=2)
    code, out, err = finish(start_tune(toml, tmp_path, "--from-profile", str(traced), "--profile-out",
                                       str(tmp_path / "tuned.profile.json")))
    assert code == 0, out + err
    assert f"tuning from the profile {traced} (trace" in out + err and "recording a profile" not in out + err
    assert "best plan: " in out
    assert Profile.load(tmp_path / "tuned.profile.json").source == "trace"  # the study's profile is the trace's

    other = tmp_path / "other.toml"  # the study's model with 3 blocks, the traced one with 4
    other.write_text(toml.read_text().replace("layers = 4", "layers = 3").replace('name = "shared"', 'name = "o"'))
    code, out, err = finish(start_tune(other, tmp_path, "--from-profile", str(traced)))
    assert code == 2 and "is not of this study's model" in err and "--model" in err, out + err
