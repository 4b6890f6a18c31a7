"""The two-ranks-on-one-GPU script's GPU-free parts: NCCL's route by version, the memory cap, the stages' order and
time limits, the files they run, the env stage's one-line failure and the summary. The whole script runs on CPU with
``--rehearse`` (bench/gpu_two_ranks.sh), by hand: it builds a 3 GB environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.shared_gpu import memory_fraction, shared_gpu_env
from planner.artifacts.config import load_study_config

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["env", "profile", "tune", "in-loop", "watch-cost", "trace", "peak", "hf", "torchtitan"]


def test_nccl_2_28_gets_a_host_id_per_rank_over_loopback():
    env = shared_gpu_env({"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (2, 28, 9))
    assert env["NCCL_HOSTID"] == "shared-gpu-rank-1" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert "NCCL_MULTI_RANK_GPU_ENABLE" not in env
    assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"  # each rank a one-GPU node: cuda:0
    other = shared_gpu_env({"RANK": "0", "LOCAL_RANK": "0"}, (2, 28, 9))
    assert other["NCCL_HOSTID"] != env["NCCL_HOSTID"]


def test_nccl_2_30_uses_its_own_multi_rank_switch():
    env = shared_gpu_env({"RANK": "1", "LOCAL_RANK": "1"}, (2, 30, 7))
    assert env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1" and "NCCL_HOSTID" not in env


def test_outside_torchrun_and_a_bad_memory_fraction_are_refused_in_one_line():
    with pytest.raises(ValueError, match="runs as a torchrun rank"):
        shared_gpu_env({}, (2, 28, 9))
    assert memory_fraction({}) == 0.45
    for bad in ("0.6", "0", "half"):
        with pytest.raises(ValueError, match=r"SHARED_GPU_MEMORY_FRACTION=.*\(0, 0.5\]"):
            memory_fraction({"SHARED_GPU_MEMORY_FRACTION": bad})


def _dry_run(tmp_path, budget: str = "360") -> list[tuple[str, int, str]]:
    out = subprocess.run(["bash", "bench/gpu_two_ranks.sh", "--dry-run", str(tmp_path)], cwd=ROOT, text=True,
                         capture_output=True, check=True, env={"PATH": "/usr/bin:/bin", "GPU_TWO_RANKS_BUDGET": budget})
    return [(m[1], int(m[2]), m[3]) for m in re.finditer(r"^stage (\S+) (-?\d+) (.*)$", out.stdout, re.M)]


def test_the_stages_run_in_a_fixed_order_within_six_minutes(tmp_path):
    stages = _dry_run(tmp_path)
    assert [s[0] for s in stages] == STAGES
    assert sum(s[1] for s in stages) <= 360
    assert all("bench.shared_gpu" in cmd for name, _, cmd in stages if name != "env")  # two ranks on the one GPU
    for _, _, cmd in stages:  # every file a stage runs is in the repository
        for path in re.findall(r"\b((?:bench|docs/examples)/[\w./-]+\.(?:py|toml))", cmd):
            assert (ROOT / path).is_file(), path
    # a smaller budget shortens the stages (the limits leave 5 s for the log)
    assert all(limit <= 55 for _, limit, _ in _dry_run(tmp_path, "60"))


def test_the_study_is_world_size_2_on_nccl_and_its_rehearsal_the_same_on_gloo():
    config = load_study_config(ROOT / "bench" / "llama-gpu-two-ranks.toml")
    assert config.launch.backend == "nccl" and config.launch.nproc_per_node == 2
    rehearsal = load_study_config(ROOT / "bench" / "llama-two-ranks-rehearsal.toml")
    assert rehearsal.launch.backend == "gloo" and rehearsal.launch.nproc_per_node == 2
    assert (rehearsal.search, rehearsal.measure) == (config.search, config.measure)
    assert rehearsal.workload.factory == config.workload.factory


def test_the_env_stage_names_what_is_missing_in_one_line(tmp_path, monkeypatch, capsys):
    """A module a later stage imports is missing (a wheel left out): one line naming it, exit 2, nothing else run."""
    import bench.gpu_env as gpu_env

    monkeypatch.setattr(gpu_env, "STAGE_IMPORTS", ("json", "no_such_dependency", "planner"))
    assert gpu_env.main(["--wheels", str(tmp_path), "--site", str(tmp_path / "site")]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no_such_dependency: ModuleNotFoundError"), lines
    assert "bench/gpu_wheels.sh" in lines[0]


def test_the_env_stage_reports_the_knobs_this_torch_lacks(tmp_path, capsys):
    import bench.gpu_env as gpu_env

    assert gpu_env.main(["--wheels", str(tmp_path), "--site", str(tmp_path / "site")]) == 0
    out = capsys.readouterr().out
    assert "knobs this torch lacks (unknown, never sampled here): none" in out  # the tested torch has them all
    assert "no GPU: gloo on CPU" in out or "NCCL" in out


def test_the_summary_says_what_each_stage_left(tmp_path):
    """From a stage table, a profile and a tune study whose survivor was confirmed faster: the figures it has, and
    the stages that left nothing said so."""
    import sqlite3

    from bench.gpu_summary import markdown, summarize
    from planner.testing import make_study_db, synthetic_profile
    from search_spaces import get_space

    (tmp_path / "stages.tsv").write_text("env\t0\t6\t20\nprofile\t124\t50\t50\n")
    profile = synthetic_profile(n_blocks=2)
    profile.to_json(tmp_path / "profile.json")
    (tmp_path / "study-name").write_text("s\n")
    (tmp_path / "made").mkdir()
    made = make_study_db(tmp_path / "made", profile, 10, get_space("uniform")).removeprefix("sqlite:///")
    with sqlite3.connect(made) as source, sqlite3.connect(tmp_path / "two-ranks.db") as target:
        source.backup(target)  # the study where the tune stage leaves it
    text = markdown(summarize(tmp_path))
    assert "| b0 | 5.000 | 3.000 |" in text
    assert "Verdict: faster; ratio 0.800 [" in text and "1 launch(es). The study: trial " in text
    assert "Step: predicted " in text and "measured 100.00 ms" in text and "Peak: no peak run." in text
    assert "No in-loop stage log." in text and "| profile | 124 | 50 | 50 |" in text
    assert "Watch cost: no `watch-cost.json`" in text
    (tmp_path / "watch-cost.json").write_text(json.dumps({
        "ratio": 1.004, "ci95": [0.991, 1.017], "stretches": 4, "steps_per_stretch": 32, "watch_every": 16,
        "blocks_read": 10, "device": "cuda", "world_size": 2}))
    assert ("Watch cost: watched / plain 1.004 [0.991, 1.017] over 4 stretches of 32 steps (10 blocks of 16 read; "
            "two ranks on one GPU test the mechanism, not the speed)." in markdown(summarize(tmp_path)))
    assert "Stages took 56 s in all." in text


@pytest.mark.slow
def test_the_wrapper_runs_a_job_as_two_one_rank_nodes(tmp_path):
    """``-m bench.shared_gpu jobs.cli profile`` on 2 ranks without a GPU (gloo): each rank a node of its own, the
    job run through the wrapper with its arguments, the profile of both ranks written."""
    from planner import Profile
    from tests.jobs.study import STUDY
    from tests.multirank import rank_env

    toml = tmp_path / "e2e.toml"
    toml.write_text(STUDY.format(space="per_module"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "bench.shared_gpu", "jobs.cli", "profile", str(toml), "-o", str(tmp_path / "p.json")],
                          cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    profile = Profile.load(tmp_path / "p.json")
    assert profile.fingerprint.world_size == 2 and len(profile.per_rank) == 2
