"""Studies that survive a cluster: concurrent jobs on one study, a rank that fails, SIGKILL, Ctrl-C.

Every job here is a real ``prefetch-planner tune`` process with its own two
gloo ranks (``torch.distributed.run``), on SQLite and on a PostgreSQL server
started by the tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

from planner.errors import FailKind
from planner.study.queries import best_plan
from planner.study.recommendation import job_verdicts
from planner.study.records import MeasuredTrialRecord
from tests.multirank import rank_env

STUDY = """
[study]
name = "shared"
storage = "{url}"
heartbeat_interval_s = 1
grace_period_s = {grace}
[workload]
factory = "{factory}"
kwargs = {{ dim = 64, layers = 4 }}
[launch]
timeout_s = {timeout}
[search]
space = "{space}"
sim_trials = {sim}
measured_trials = {measured}
[measure]
warmup_steps = 0
steps = 1
min_rounds = {rounds}
max_rounds = {rounds}
confirm_min_rounds = 6
confirm_max_rounds = 6
confirm_launches = 0
profile_repeats = 1
"""


def write_study(path: Path, url: str, factory: str = "runtime.reference_workloads:mlp", space: str = "per_module",
                sim: int = 40, measured: int = 9, rounds: int = 2, grace: int = 30, timeout: int = 120) -> Path:
    path.write_text(STUDY.format(url=url, factory=factory, space=space, sim=sim, measured=measured, rounds=rounds,
                                 grace=grace, timeout=timeout))
    return path


def start_tune(toml: Path, cwd: Path, *extra: str) -> subprocess.Popen:
    """``prefetch-planner tune`` in its own session (so a signal reaches the launcher and its ranks)."""
    return subprocess.Popen(
        [sys.executable, "-m", "jobs.cli", "tune", str(toml), "--no-progress", *extra],
        cwd=cwd, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _frozen(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    storage = optuna.storages.RDBStorage(url, skip_compatibility_check=True)
    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    finally:
        storage.engine.dispose()


def trials(url: str, name: str = "shared") -> list[MeasuredTrialRecord]:
    """The measured study's trials, as the planner reads them."""
    return [MeasuredTrialRecord.from_trial(t) for t in _frozen(url, name)]


def asked_trials(out: str) -> tuple[str, list[int]]:
    """The job and the trial numbers of its race, from the line ``tune`` logs at the start of the measured stage."""
    m = re.search(r"\[3/3\] measured stage: .*?trials ([0-9, ]+) \(job (\S+)\)", out)
    assert m, out
    return m.group(2), sorted(int(x) for x in m.group(1).split(", "))


def wait_for_running(url: str, proc: subprocess.Popen, timeout: float = 300) -> list[int]:
    """Poll the study until the job has measured trials RUNNING; return their numbers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, finish(proc)
        try:
            running = [t.number for t in trials(url) if t.state.name == "RUNNING"]
        except KeyError:  # the study does not exist yet
            running = []
        if running:
            return running
        time.sleep(0.2)
    raise AssertionError("no measured trial started in time")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


@pytest.fixture(params=["sqlite", "postgresql"])
def storage_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/shared.db"
    return request.getfixturevalue("postgres")()


@pytest.mark.slow
def test_three_concurrent_jobs_share_one_study(storage_url, tmp_path):
    """3 jobs x 10 measured trials each on one study: every trial accounted for, one best plan for all readers."""
    toml = write_study(tmp_path / "shared.toml", storage_url)
    jobs = [start_tune(toml, tmp_path, "--plan-out", f"plan{i}.json", "--profile-out", f"profile{i}.json")
            for i in range(3)]
    results = [finish(p) for p in jobs]
    for code, out, err in results:
        assert code == 0, out + err
        # a confirmation, or a race that dropped every candidate: both are valid ends of a job
        assert "best plan: " in out and ("confirmation: trial" in out or "significantly slower" in out), out

    # Every trial a job said it asked for is in the study, under that job, and nothing else is. How many a job
    # asks depends on when it starts: a plan another job measured or is measuring is not raced again, and this
    # simulated stage finds 26 plans besides the default for this model, fewer than 3 jobs x 9: a late job gets fewer.
    asked = dict(asked_trials(out) for _, out, _ in results)
    measured = trials(storage_url)
    n = len(measured)
    per_job: dict[str, list[int]] = {}
    for t in measured:
        per_job.setdefault(t.job, []).append(t.number)
    assert per_job == asked and len(asked) == 3
    assert all(2 <= len(numbers) <= 11 for numbers in asked.values()), asked  # the default, 1-9 plans, a re-race
    assert Counter(t.state.name for t in measured) == {"COMPLETE": n}
    assert sum(t.is_default for t in measured) == 3  # every job measured its own baseline
    assert all(c <= 1 for c in Counter(t.job for t in measured if t.reconfirms is not None).values())
    assert len({t.number for t in measured}) == n
    # our rows: one plan row and one run row per measured trial, no duplicate
    engine = sa.create_engine(storage_url)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("select trial_number from planner_plans where study_name = 'shared'").all()
        runs = conn.exec_driver_sql("select count(*) from planner_measured_runs").scalar()
        profiles = conn.exec_driver_sql("select count(*) from planner_profiles").scalar()
    engine.dispose()
    assert sorted(r[0] for r in rows) == sorted(t.number for t in measured)
    assert runs == n and profiles == 3
    assert len(_frozen(storage_url, "shared.sim")) == 3 * 40

    # The best plan is the same whichever job (process) reads it.
    readers = [subprocess.Popen([sys.executable, "-m", "jobs.cli", "studies", "best", "shared", "--storage",
                                 storage_url], cwd=tmp_path, env=rank_env(), stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    answers = [r.communicate(timeout=120)[0] for r in readers]
    assert all(r.returncode == 0 for r in readers)
    assert answers[0] and answers.count(answers[0]) == 3
    # ... and it is what the latest job concluded (planner.study.recommendation), the line each job printed last
    latest = max(job_verdicts(measured), key=lambda v: v.last_trial)
    expected = latest.recommended.number if latest.recommended is not None else None  # faster across processes
    best = best_plan(storage_url, "shared")
    assert (None if best.keeps_baseline else best.plan.provenance.trial) == expected
    assert answers[0].startswith(f"study shared: {best.line('shared')}")


@pytest.mark.slow
def test_rank_failure_fails_the_trial_on_every_rank(tmp_path):
    """Rank 1 raises mid-step: no hang, the trial is FAIL with the reason, the study goes on in the next job."""
    url = f"sqlite:///{tmp_path}/shared.db"
    bad = write_study(tmp_path / "bad.toml", url, factory="bad_factories:deep_prefetch_fails_on_rank1",
                      space="uniform", sim=30, measured=3, rounds=2, timeout=5)
    code, out, err = finish(start_tune(bad, tmp_path))  # finish() bounds the wait: a hang fails the test
    assert code == 3, out + err
    line = one_error_line(err)
    assert "failed on rank 1: RuntimeError: CUDA out of memory (simulated on rank 1)" in line, line
    assert "run `prefetch-planner tune` again" in line
    first = trials(url)
    assert "RUNNING" not in {t.state.name for t in first}
    [failed] = [t for t in first if t.failure is not None and t.failure.kind == FailKind.ERROR]
    assert "rank 1: RuntimeError: CUDA out of memory" in failed.failure.reason
    assert failed.params["forward_depth"] >= 1 or not failed.params["reshard_after_forward"]
    show = subprocess.run([sys.executable, "-m", "jobs.cli", "studies", "show", "shared", "--storage", url],
                          capture_output=True, text=True, env=rank_env(), cwd=tmp_path, timeout=120)
    assert "reason: rank 1: RuntimeError: CUDA out of memory" in show.stdout, show.stdout + show.stderr

    # The study goes on: the next job (a healthy model, same study) resumes, skipping the failed plan.
    good = write_study(tmp_path / "good.toml", url, space="uniform", sim=30, measured=3, rounds=2)
    code, out, err = finish(start_tune(good, tmp_path))
    assert code == 0, out + err
    second = [t for t in trials(url) if t.number >= len(first)]
    assert second and all(t.state.name == "COMPLETE" for t in second)
    assert failed.plan_key not in {t.plan_key for t in second}


@pytest.mark.slow
def test_a_rank_stuck_in_a_collective_is_stopped_within_its_bound(tmp_path):
    """Rank 1 raises mid-step; rank 0 waits at the same place in a fake collective that never returns, past any
    timeout of gloo's (120 s): its watcher records the trial FAIL with rank 1's cause from the c10d store, fails the
    rest, and ends rank 0 ``stuck_after_s`` (3 s) after the post. The next job does not race the plan."""
    url = f"sqlite:///{tmp_path}/shared.db"
    bad = write_study(tmp_path / "bad.toml", url, factory="bad_factories:deep_prefetch_fails_on_rank1",
                      space="uniform", sim=30, measured=3, rounds=2, timeout=120)
    bad.write_text(bad.read_text().replace("layers = 4 }", "layers = 4, survivor_hangs = true }")
                   .replace("timeout_s = 120", "timeout_s = 120\nstuck_after_s = 3"))
    started = time.monotonic()
    code, out, err = finish(start_tune(bad, tmp_path), timeout=110)  # below gloo's 120 s: the bound ended it
    assert code != 0 and time.monotonic() - started < 110, out + err
    assert "rank 0 stopped: it stayed inside a step 3 s after rank 1's step raised" in err, err[-3000:]
    first = trials(url)
    assert "RUNNING" not in {t.state.name for t in first}
    [failed] = [t for t in first if t.failure is not None and t.failure.kind == FailKind.ERROR]
    assert failed.failure.reason == "rank 1: RuntimeError: CUDA out of memory (simulated on rank 1)"

    good = write_study(tmp_path / "good.toml", url, space="uniform", sim=30, measured=3, rounds=2)
    code, out, err = finish(start_tune(good, tmp_path))
    assert code == 0, out + err
    second = [t for t in trials(url) if t.number >= len(first)]
    assert second and failed.plan_key not in {t.plan_key for t in second}


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_the_study(tmp_path):
    """A transient rank failure under `torchrun --max-restarts 1`: the restarted ranks go on with the study."""
    url = f"sqlite:///{tmp_path}/shared.db"
    toml = write_study(tmp_path / "shared.toml", url, factory="bad_factories:deep_prefetch_fails_on_rank1",
                       space="uniform", sim=30, measured=3, rounds=2, timeout=5)
    toml.write_text(toml.read_text().replace("layers = 4 }", "layers = 4, first_attempt_only = true }"))
    # torchrun shares its rendezvous store with the restarted ranks' process group, which then can read
    # the previous attempt's addresses (pytorch/pytorch#135712); docs/clusters.md says to set this with --max-restarts.
    env = dict(rank_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
         "-m", "jobs.cli", "tune", str(toml), "--no-progress"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = trials(url)
    assert "RUNNING" not in {t.state.name for t in got}
    [failed] = [t for t in got if t.failure is not None and t.failure.kind == FailKind.ERROR]  # the first attempt's
    done = [t for t in got if t.state.name == "COMPLETE"]
    assert len(done) == 4 and all(t.number > failed.number for t in done)
    assert failed.plan_key not in {t.plan_key for t in done}
    assert (tmp_path / "shared.plan.json").exists()


@pytest.mark.slow
def test_sigkill_then_resume_leaves_no_trial_running(tmp_path):
    """SIGKILL mid-trial leaves trials RUNNING; the next job fails them (stale heartbeat) and measures them again."""
    url = f"sqlite:///{tmp_path}/shared.db"
    toml = write_study(tmp_path / "shared.toml", url, measured=3, rounds=200, grace=3)
    job = start_tune(toml, tmp_path)
    running = wait_for_running(url, job)
    for pid in process_tree(job.pid):  # the node dies: launcher and ranks at once
        os.kill(pid, signal.SIGKILL)
    job.wait(timeout=60)
    assert {t.number for t in trials(url) if t.state.name == "RUNNING"} >= set(running)

    resumed = write_study(tmp_path / "resume.toml", url, measured=3, rounds=2, grace=3)
    code, out, err = finish(start_tune(resumed, tmp_path))
    assert code == 0, out + err
    assert "resuming:" in out
    after = trials(url)
    assert "RUNNING" not in {t.state.name for t in after}
    assert all(after[n].state.name == "FAIL" for n in running)
    retried = {t.retry_of for t in after if t.state.name == "COMPLETE"}
    assert set(running) <= retried  # every killed trial's plan was measured again


@pytest.mark.slow
def test_ctrl_c_fails_the_running_trials_cleanly(tmp_path):
    url = f"sqlite:///{tmp_path}/shared.db"
    toml = write_study(tmp_path / "shared.toml", url, measured=3, rounds=200)
    job = start_tune(toml, tmp_path)
    running = wait_for_running(url, job)
    os.killpg(job.pid, signal.SIGINT)  # Ctrl-C: the launcher's process group; torchrun forwards it to the ranks
    code, out, err = finish(job, timeout=120)
    assert code == 130, out + err
    assert "interrupted (SIGINT)" in one_error_line(err)
    after = trials(url)
    assert "RUNNING" not in {t.state.name for t in after}
    for n in running:
        assert after[n].state.name == "FAIL" and after[n].failure.kind == FailKind.INTERRUPTED
