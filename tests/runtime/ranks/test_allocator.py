"""``[launch] allocator``: the ranks' environment, the refusals, and jemalloc's promise of no page faults once warm."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from planner.artifacts.names import Allocator
from planner.errors import StudyConfigError
from runtime.ranks import allocator
from runtime.ranks.allocator import (
    JEMALLOC_CONF,
    check_rank_allocator,
    loaded_allocator,
    rank_environment,
    rank_environment_set,
)
from runtime.ranks.rank import check_runnable

ROOT = Path(__file__).parents[3]


@pytest.fixture
def jemalloc_installed(monkeypatch):
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: f"lib{name}.so.2")


@pytest.fixture
def jemalloc_missing(monkeypatch):
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)


@pytest.fixture
def real_jemalloc():
    """jemalloc installed on this machine; skipped where it is not, except under CI (``.ci/run`` installs it)."""
    import ctypes.util

    if ctypes.util.find_library("jemalloc") is None:
        if os.environ.get("CI"):
            pytest.fail("no jemalloc under CI: .ci/run installs libjemalloc2")
        pytest.skip("no jemalloc here (apt-get install libjemalloc2)")


def test_the_system_allocator_changes_nothing():
    assert rank_environment("system") == {}


def test_jemalloc_is_preloaded_before_what_the_user_preloads_and_keeps_their_malloc_conf(jemalloc_installed,
                                                                                          monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    assert rank_environment(Allocator.JEMALLOC) == {"LD_PRELOAD": "libjemalloc.so.2", "MALLOC_CONF": JEMALLOC_CONF}
    monkeypatch.setenv("LD_PRELOAD", "libmine.so")
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    assert rank_environment("jemalloc") == {"LD_PRELOAD": "libjemalloc.so.2 libmine.so", "MALLOC_CONF": "narenas:1"}


def test_the_environment_is_set_only_inside_the_block(jemalloc_installed, monkeypatch):
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "libmine.so")
    with rank_environment_set("jemalloc"):
        assert os.environ["LD_PRELOAD"] == "libjemalloc.so.2 libmine.so"
        assert os.environ["MALLOC_CONF"] == JEMALLOC_CONF
    assert os.environ["LD_PRELOAD"] == "libmine.so"
    assert "MALLOC_CONF" not in os.environ


def test_a_missing_jemalloc_is_refused_before_any_rank_starts(jemalloc_missing):
    with pytest.raises(StudyConfigError, match=r"allocator = 'jemalloc' needs jemalloc .* apt-get install "
                                               r"libjemalloc2.*or set allocator = 'system'"):
        check_runnable("gloo", 2, "jemalloc")
    check_runnable("gloo", 2, "system")


def test_the_allocator_a_process_runs_under_is_read_from_its_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 fd:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert loaded_allocator(maps) == Allocator.JEMALLOC
    maps.write_text("7f00-7f01 r-xp 0 fd:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert loaded_allocator(maps) == Allocator.SYSTEM
    assert loaded_allocator(tmp_path / "missing") == Allocator.SYSTEM


@pytest.mark.parametrize(("wanted", "running", "needle"), [
    ("jemalloc", Allocator.SYSTEM, r"runs without it: start torchrun with LD_PRELOAD=libjemalloc.so.2 MALLOC_CONF="),
    ("system", Allocator.JEMALLOC, r"runs with jemalloc preloaded .* set allocator = 'jemalloc'"),
])
def test_a_rank_under_another_allocator_is_refused(jemalloc_installed, monkeypatch, wanted, running, needle):
    monkeypatch.setattr(allocator, "loaded_allocator", lambda: running)
    with pytest.raises(StudyConfigError, match=needle):
        check_rank_allocator(wanted)
    check_rank_allocator(running)


_FAULTS_OF_A_FREED_BLOCK = textwrap.dedent("""
    import resource, torch
    from runtime.ranks.allocator import loaded_allocator
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = torch.empty(16 << 20).fill_(1.0)  # 64 MiB, above glibc's largest mmap threshold
        del block
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(loaded_allocator().value, *faults)
""")


def test_a_rank_under_jemalloc_takes_no_page_faults_for_a_block_it_freed_before(real_jemalloc):
    """What the setting is for: a 64 MiB tensor allocated, filled and freed again and again faults its 16384 pages
    once, not every time (as glibc's ``mmap``/``munmap`` of a block that large does)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with rank_environment_set("jemalloc"):
        env.update({k: os.environ[k] for k in ("LD_PRELOAD", "MALLOC_CONF")})
    out = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_FREED_BLOCK], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    name, faults = out[0], [int(f) for f in out[1:]]
    assert name == "jemalloc"
    assert faults[0] >= 16000  # the first time: every page is new
    assert max(faults[2:]) < 1000, faults  # then the same pages again
