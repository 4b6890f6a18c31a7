"""``prefetch-planner profile`` end to end: a Profile JSON and a torch.profiler trace from 2 gloo ranks."""

from __future__ import annotations

import json

import pytest

from planner import Profile
from tests.jobs.study import STUDY


@pytest.mark.slow
def test_profile_command_with_torch_trace(cli, tmp_path):
    """The profile with its collectives read inside traced steps (``[measure] collectives = "in-step"``, what a GPU
    does by default: [Note: Collectives on NCCL's clock]), and the job's own trace of one more step after it."""
    (tmp_path / "s.toml").write_text(STUDY.format(space="uniform").replace("[measure]\n",
                                                                            '[measure]\ncollectives = "in-step"\n'))
    proc = cli("profile", "s.toml", "-o", "p.json", "--torch-trace", "torch.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    profile = Profile.load(tmp_path / "p.json")
    assert profile.post_forward_order[-1] == "" and len(profile.per_rank) == 2
    assert profile.in_step.collective_steps == 2  # the transfer of every traced call, the least across ranks
    blocks = [m for fqn, m in profile.modules.items() if fqn]
    assert blocks and all(m.all_gather_ms > 0 and m.reduce_scatter_ms > 0 for m in blocks)
    assert all(m.all_gather_wait_ms >= 0 and m.reduce_scatter_wait_ms >= 0 for m in blocks)
    isolated = [r.isolated.modules[fqn].collectives.all_gather_ms for r in profile.per_rank for fqn in profile.modules
                if fqn]
    assert [m.all_gather_ms for m in blocks] != isolated[:len(blocks)]  # not the isolated figures
    trace = json.loads((tmp_path / "torch.json").read_text())
    assert any("FSDP::all_gather" in e.get("name", "") for e in trace["traceEvents"])


class _Stop(Exception):
    pass


def test_the_profile_job_records_after_importing_what_tune_imports(monkeypatch):
    """[Note: Record in tune's process state]: the ranks load what ``tune``'s have loaded
    (``jobs.process_state.load_tune_modules``, whose list ``tests/jobs/test_process_state.py`` checks) before they
    start recording."""
    from types import SimpleNamespace

    import jobs.profile

    order = []

    def job_rank(launch):
        order.append("init_rank")
        raise _Stop

    monkeypatch.setattr(jobs.profile, "load_tune_modules", lambda: order.append("load_tune_modules"))
    monkeypatch.setattr(jobs.profile, "job_rank", job_rank)
    launch = SimpleNamespace(backend="gloo", allocator="system", mesh=None)
    job = jobs.profile.ProfileJob(SimpleNamespace(launch=launch), "unused.json")
    with pytest.raises(_Stop):
        job.run()
    assert order == ["load_tune_modules", "init_rank"]
