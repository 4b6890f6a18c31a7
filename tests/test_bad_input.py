"""Every kind of wrong input: one line ``error: ...`` and exit 2 at the CLI, a named exception in the API,
and the study database exactly as it was.

Each case runs against a real study database (measured and simulated trials,
our tables) and compares a full SQL dump of it before and after.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from jobs.cli import main
from jobs.predict import tune_for_target
from jobs.verify import check_before_launch
from planner.artifacts.config import load_study_config
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.artifacts.target import load_target
from planner.errors import (
    PlanFormatError,
    PlanMismatchError,
    ProfileFormatError,
    StorageError,
    StudyConfigError,
    TargetError,
    TraceFormatError,
    WorkloadError,
)
from planner.simulation.depth import deepen
from planner.simulation.link import retarget
from planner.simulation.what_if import WhatIf
from planner.storages import check_writable, open_storage
from planner.testing import assert_one_line_error, make_study_db, synthetic_profile
from planner.traces.trace_profile import profile_from_traces
from runtime.ranks.rank import check_runnable
from search_spaces import get_space
from tests.multirank import RANK_SCRIPTS, rank_env
from tests.planner.traces.synthetic_trace import write_traces

STUDIES = Path(__file__).parents[1] / "studies"
TRACES = Path(__file__).parent / "data" / "traces"
GOOD_TOML = '[study]\nname = "s"\n[workload]\nfactory = "{factory}"\nkwargs = {{ dim = 64, layers = 4 }}\n'


@pytest.fixture(scope="module")
def world_template(tmp_path_factory):
    """Built once for the module: a study database with results, a profile, its default plan, a good study TOML."""
    directory = tmp_path_factory.mktemp("world")
    profile = synthetic_profile(n_blocks=4)
    make_study_db(directory, profile, sim_trials=20, space=get_space("uniform"))
    profile.to_json(directory / "profile.json")
    Plan.default(profile).to_json(directory / "plan.json")
    (directory / "good.toml").write_text(GOOD_TOML.format(factory="runtime.reference_workloads:mlp"))
    return directory


@pytest.fixture
def world(world_template, tmp_path, monkeypatch):
    """A fresh copy of the template per test (each may write bad files beside the database)."""
    monkeypatch.syspath_prepend(str(RANK_SCRIPTS.parent))  # bad_factories, for the API cases
    shutil.copytree(world_template, tmp_path, dirs_exist_ok=True)
    return tmp_path


def dump(db: Path) -> str:
    con = sqlite3.connect(db)
    try:
        return "\n".join(con.iterdump())
    finally:
        con.close()


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def plan_json(world: Path, mutate: Callable[[dict], None]) -> str:
    d = json.loads((world / "plan.json").read_text())
    mutate(d)
    return write(world / "bad_plan.json", json.dumps(d))


def other_model_plan(world: Path) -> str:
    Plan.default(synthetic_profile(n_blocks=3)).to_json(world / "bad_plan.json")
    return str(world / "bad_plan.json")


def truncated(path: Path, out: Path) -> str:
    text = path.read_text()
    return write(out, text[: len(text) // 2])


def set_schema(d: dict) -> None:
    d["schema_version"] = 99


def non_fsdp_fqn(d: dict) -> None:
    d["modules"]["b0.fc1"] = d["modules"]["b0"]


def unknown_prefetch_target(d: dict) -> None:
    d["modules"]["b0"]["forward_prefetch"] = ["b9"]


def profile_schema(world: Path) -> str:
    d = json.loads((world / "profile.json").read_text())
    d["schema_version"] = 99
    return write(world / "bad_profile.json", json.dumps(d))


def trace_case(world: Path, kind: str) -> list[str]:
    """Trace files for ``profile --from-trace``: good synthetic FSDP2 GPU traces, then broken as ``kind`` says."""
    paths = write_traces(world)
    good = Path(paths[0]).read_bytes()
    if kind == "not json":
        Path(paths[0]).write_text("this is no trace")
    elif kind == "truncated json":
        Path(paths[0]).write_bytes(good[: len(good) // 2])
    elif kind == "truncated gzip":
        Path(paths[0]).unlink()
        paths[0] = str(world / "rank0_trace.json.gz")
        Path(paths[0]).write_bytes(gzip.compress(good)[:300])
    elif kind == "not kineto":
        Path(paths[0]).write_text('{"schemaVersion": 1, "events": []}')
    elif kind == "no fsdp2 labels":
        paths = [str(TRACES / "hta-a100-nccl.json.gz")]
    elif kind == "orders disagree":
        Path(paths[1]).write_text(Path(paths[1]).read_text().replace("layers.1", "layers.9"))
    return paths


def from_trace(kind: str) -> tuple[Callable[[Path], list[str]], Callable[[Path], Any]]:
    return ((lambda w: ["profile", "--from-trace", *trace_case(w, kind), "-o", str(w / "trace.profile.json")]),
            (lambda w: profile_from_traces(trace_case(w, kind))))


@dataclass
class Case:
    """``cli(world)`` gives the CLI arguments; ``api(world)`` must raise ``error``."""

    cli: Callable[[Path], list[str]]
    needle: str
    api: Callable[[Path], Any]
    error: type[Exception]


def simulate_with_plan(world: Path, plan: str) -> None:
    Plan.load(plan).check_matches(Profile.load(world / "profile.json"))


TARGET = 'world_size = 2\nranks_per_node = 1\nbackend = "gloo"\n[link.inter_node]\nbandwidth = "1Gbit/s"\n'


def target_case(world: Path, text: str) -> list[str]:
    return ["simulate", str(world / "profile.json"), "--target", write(world / "target.toml", text)]


def retarget_loaded(world: Path) -> None:
    retarget(Profile.load(world / "profile.json"), load_target(world / "target.toml"))


CASES = {
    "target with a bandwidth without its unit": Case(
        lambda w: target_case(w, TARGET.replace('"1Gbit/s"', '"1"')),
        "link.inter_node.bandwidth: bandwidth '1': write a positive number with its unit",
        lambda w: load_target(w / "target.toml"), TargetError),
    "target without the link its nodes need": Case(
        lambda w: target_case(w, TARGET.split("[link")[0]),
        "the shard group of 2 ranks on 2 nodes needs [link.inter_node] with its bandwidth",
        lambda w: load_target(w / "target.toml"), TargetError),
    "target mesh that does not multiply to the world size": Case(
        lambda w: target_case(w, "mesh = [2, 2]\n" + TARGET),
        "mesh [2, 2] has 4 ranks, world_size 2: write mesh = [replicate, shard] with replicate x shard = world_size",
        lambda w: load_target(w / "target.toml"), TargetError),
    "target world size not a whole number of nodes": Case(
        lambda w: target_case(w, TARGET.replace("world_size = 2", "world_size = 3").replace(
            "ranks_per_node = 1", "ranks_per_node = 2")),
        "world_size 3 is not a whole number of nodes of 2 ranks", lambda w: load_target(w / "target.toml"),
        TargetError),
    "target preset that does not exist": Case(
        lambda w: ["simulate", str(w / "profile.json"), "--target", "h100-ib999"],
        "no preset 'h100-ib999'; presets are", lambda w: load_target("h100-ib999"), TargetError),
    "target file starting from an unknown preset": Case(
        lambda w: target_case(w, 'preset = "dgx-9000"\n' + TARGET),
        "no preset 'dgx-9000'; presets are", lambda w: load_target(w / "target.toml"), TargetError),
    "target mesh not written REPLICATExSHARD": Case(
        lambda w: ["simulate", str(w / "profile.json"), "--target", "cpu-emulated-1gbit", "--mesh", "4"],
        "--mesh '4': write REPLICATExSHARD", lambda w: WhatIf("cpu-emulated-1gbit", mesh="4").load_target(),
        TargetError),
    "link nccl-tests file that does not exist": Case(
        lambda w: target_case(w, TARGET.replace('bandwidth = "1Gbit/s"', 'nccl_tests = "missing.txt"')),
        "nccl_tests file", lambda w: load_target(w / "target.toml"), TargetError),
    "link nccl-tests file with wrong results": Case(
        lambda w: target_case(w, TARGET.replace('bandwidth = "1Gbit/s"', 'nccl_tests = "{}"'.format(write(
            w / "wrong.txt", "  1048576  16384  float  none  -1  95.31  11.00  10.31  3  94.87  11.05  10.36  3\n")))),
        "#wrong is 3: that run gave wrong results", lambda w: load_target(w / "target.toml"), TargetError),
    "link nccl-tests file that is not nccl-tests output": Case(
        lambda w: target_case(w, TARGET.replace('bandwidth = "1Gbit/s"', 'nccl_tests = "{}"'.format(write(
            w / "prose.txt", "all_gather went fine, about 190 GB/s\n")))),
        "has no result row", lambda w: load_target(w / "target.toml"), TargetError),
    "link with both a bandwidth and an nccl-tests file": Case(
        lambda w: target_case(w, TARGET + 'nccl_tests = "x.txt"\n'),
        "give the link's bandwidth", lambda w: load_target(w / "target.toml"), TargetError),
    "tune --target without a profile to predict from": Case(
        lambda w: ["tune", write(w / "np.toml", GOOD_TOML.format(factory="runtime.reference_workloads:mlp")
                                 .replace('name = "s"', 'name = "np"')), "--target", "cpu-emulated-1gbit"],
        "no profile at", lambda w: tune_for_target(load_study_config(w / "np.toml"),
                                                   WhatIf(target="cpu-emulated-1gbit"), str(w / "none.json"),
                                                   str(w / "p.json"), False), ProfileFormatError),
    "depth below the profile's blocks": Case(
        lambda w: ["simulate", str(w / "profile.json"), "--depth", "2", "--blocks", "b*"],
        "--depth 2 is below the profile's 4 blocks", lambda w: deepen(Profile.load(w / "profile.json"), 2, "b*"),
        ProfileFormatError),
    "depth with a blocks pattern that matches no module": Case(
        lambda w: ["simulate", str(w / "profile.json"), "--depth", "32"],
        "--blocks 'layers.*' matches no FSDP module of the profile",
        lambda w: deepen(Profile.load(w / "profile.json"), 32), ProfileFormatError),
    "target on nccl from a cpu profile": Case(
        lambda w: target_case(w, TARGET.replace('"gloo"', '"nccl"')),
        "target backend 'nccl', but the profile's collectives ran on gloo (cpu): their costs cannot be re-timed",
        retarget_loaded, TargetError),
    "malformed toml": Case(
        lambda w: ["tune", write(w / "bad.toml", "[study\nname = 's'\n")], "is not valid TOML",
        lambda w: load_study_config(w / "bad.toml"), StudyConfigError),
    "truncated toml": Case(
        lambda w: ["tune", write(w / "bad.toml", GOOD_TOML.format(factory="runtime.reference_workloads:mlp")[:40])],
        "is not valid TOML", lambda w: load_study_config(w / "bad.toml"), StudyConfigError),
    "malformed plan json": Case(
        lambda w: ["simulate", str(w / "profile.json"), write(w / "bad_plan.json", "{plan: yes")],
        "plan is not valid JSON", lambda w: Plan.load(w / "bad_plan.json"), PlanFormatError),
    "truncated plan json": Case(
        lambda w: ["simulate", str(w / "profile.json"), truncated(w / "plan.json", w / "bad_plan.json")],
        "plan is not valid JSON", lambda w: Plan.load(w / "bad_plan.json"), PlanFormatError),
    "truncated profile json": Case(
        lambda w: ["simulate", truncated(w / "profile.json", w / "bad_profile.json")],
        "profile is not valid JSON", lambda w: Profile.load(w / "bad_profile.json"), ProfileFormatError),
    "tune from a truncated profile": Case(
        lambda w: ["tune", str(w / "good.toml"), "--from-profile",
                   truncated(w / "profile.json", w / "bad_profile.json")],
        "profile is not valid JSON", lambda w: Profile.load(w / "bad_profile.json"), ProfileFormatError),
    "unknown plan schema": Case(
        lambda w: ["simulate", str(w / "profile.json"), plan_json(w, set_schema)],
        "schema_version 99", lambda w: Plan.load(w / "bad_plan.json"), PlanFormatError),
    "unknown profile schema": Case(
        lambda w: ["simulate", profile_schema(w)],
        "schema_version 99", lambda w: Profile.load(w / "bad_profile.json"), ProfileFormatError),
    "plan for another model": Case(
        lambda w: ["simulate", str(w / "profile.json"), other_model_plan(w)], "FSDP module count",
        lambda w: simulate_with_plan(w, str(w / "bad_plan.json")), PlanMismatchError),
    "verify a plan for another model": Case(
        lambda w: ["verify", other_model_plan(w), str(w / "good.toml")], "is not for this study's model",
        lambda w: check_before_launch(load_study_config(w / "good.toml"), other_model_plan(w)), PlanMismatchError),
    "verify a missing plan file": Case(
        lambda w: ["verify", str(w / "missing.json"), str(w / "good.toml")], "cannot read plan",
        lambda w: check_before_launch(load_study_config(w / "good.toml"), str(w / "missing.json")), PlanFormatError),
    "fqn that is not an fsdp module": Case(
        lambda w: ["simulate", str(w / "profile.json"), plan_json(w, non_fsdp_fqn)],
        "plan sets module 'b0.fc1', which is not an FSDP module",
        lambda w: Plan.load(w / "bad_plan.json"), PlanFormatError),
    "prefetch of a module that does not exist": Case(
        lambda w: ["simulate", str(w / "profile.json"), plan_json(w, unknown_prefetch_target)],
        "module 'b0' prefetches 'b9', which is not an FSDP module",
        lambda w: Plan.load(w / "bad_plan.json"), PlanFormatError),
    "unreachable storage (tune)": Case(
        lambda w: ["tune", str(w / "good.toml"), "--storage", "postgresql+psycopg2://planner@127.0.0.1:9/x"],
        "cannot open storage 'postgresql+psycopg2://planner@127.0.0.1:9/x'",
        lambda w: check_writable("postgresql+psycopg2://planner@127.0.0.1:9/x"), StorageError),
    "unreachable storage (studies list)": Case(
        lambda w: ["studies", "list", "--storage", "postgresql+psycopg2://planner@127.0.0.1:9/x"],
        "cannot open storage", lambda w: open_storage("postgresql+psycopg2://planner@127.0.0.1:9/x"),
        StorageError),
    "unknown storage dialect": Case(
        lambda w: ["tune", str(w / "good.toml"), "--storage", "nosuchdb://x"], "cannot open storage 'nosuchdb://x'",
        lambda w: check_writable("nosuchdb://x"), StorageError),
    "trace that is not json": Case(from_trace("not json")[0], "is not JSON, or is truncated", from_trace("not json")[1],
                                   TraceFormatError),
    "truncated trace": Case(from_trace("truncated json")[0], "is not JSON, or is truncated",
                            from_trace("truncated json")[1], TraceFormatError),
    "truncated gzip trace": Case(from_trace("truncated gzip")[0], "is a truncated or damaged gzip file",
                                 from_trace("truncated gzip")[1], TraceFormatError),
    "json that is not a kineto trace": Case(from_trace("not kineto")[0], "is not a Kineto trace: no 'traceEvents'",
                                            from_trace("not kineto")[1], TraceFormatError),
    "trace without fsdp2 labels": Case(from_trace("no fsdp2 labels")[0], "has no FSDP2 labels",
                                       from_trace("no fsdp2 labels")[1], TraceFormatError),
    "launch mesh that does not hold the job's ranks": Case(
        lambda w: ["tune", write(w / "bad.toml", GOOD_TOML.format(factory="runtime.reference_workloads:mlp")
                                 + "[launch]\nnproc_per_node = 2\nmesh = [2, 3]\n")],
        "[launch] mesh [2, 3] has 6 ranks, this job has 2; write mesh = [replicate, shard]",
        lambda w: check_runnable("gloo", 2, mesh=(2, 3)), StudyConfigError),
    "hsdp with tensor parallelism": Case(
        lambda w: ["tune", write(w / "bad.toml", GOOD_TOML.format(factory="runtime.reference_workloads:mlp")
                                 + "[launch]\nnproc_per_node = 4\nmesh = [2, 2]\ntensor_parallel = 2\n")],
        "mesh (HSDP) with tensor_parallel > 1 is HSDP + TP, which is not tuned yet",
        lambda w: load_study_config(w / "bad.toml"), StudyConfigError),
    "tensor parallel degree that does not divide the ranks": Case(
        lambda w: ["tune", write(w / "bad.toml", GOOD_TOML.format(factory="runtime.reference_workloads:mlp")
                                 + "[launch]\nnproc_per_node = 2\ntensor_parallel = 4\n")],
        "[launch] tensor_parallel = 4 does not divide this job's 2 ranks",
        lambda w: check_runnable("gloo", 2, tensor_parallel=4), StudyConfigError),
    "traces whose ranks disagree on the order": Case(from_trace("orders disagree")[0],
                                                     "ranks disagree on the post-forward order",
                                                     from_trace("orders disagree")[1], TraceFormatError),
}
if not torch.cuda.is_available():  # the machine decides: a GPU study is bad input only where there is no GPU
    CASES["a study this machine cannot run"] = Case(
        lambda w: ["tune", str(STUDIES / "llama-gpu.toml")], "[launch] backend = 'nccl' needs CUDA GPUs",
        lambda w: check_runnable("nccl", 1), StudyConfigError)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(world, name):
    case = CASES[name]
    before = dump(world / "s.db")
    args = case.cli(world)
    if args[0] == "tune" and "--storage" not in args:
        args += ["--storage", f"sqlite:///{world / 's.db'}"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert_one_line_error(result.exit_code, result.stderr, case.needle)
    with pytest.raises(case.error) as info:
        case.api(world)
    assert case.needle.split(" '")[0] in str(info.value)
    assert dump(world / "s.db") == before
    assert not (world / "trace.profile.json").exists()  # a refused trace writes no profile


def test_locked_sqlite_file(world, monkeypatch):
    """Another process holds the write lock: a bounded wait, then one line naming the lock and the fix."""
    monkeypatch.setenv("PREFETCH_PLANNER_SQLITE_TIMEOUT_S", "1")
    db = world / "s.db"
    before = dump(db)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        url = f"sqlite:///{db}"
        result = CliRunner().invoke(main, ["tune", str(world / "good.toml"), "--storage", url],
                                    catch_exceptions=False)
        assert_one_line_error(result.exit_code, result.stderr, f"storage '{url}' is locked")
        assert "PREFETCH_PLANNER_SQLITE_TIMEOUT_S" in result.stderr
        with pytest.raises(StorageError, match="is locked"):
            check_writable(url)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert dump(db) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "factory, needle",
    [
        ("bad_factories:raises", "workload factory 'bad_factories:raises' raised RuntimeError: out of coffee"),
        ("bad_factories:unwrapped", "not wrapped with fully_shard"),
    ],
)
def test_bad_workload_factory(world, factory, needle):
    """Found on the ranks: rank 0 prints the one line, every rank exits 2, the database is untouched."""
    before = dump(world / "s.db")
    toml = write(world / "bad.toml", GOOD_TOML.format(factory=factory))
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "tune", toml, "--storage",
                           f"sqlite:///{world / 's.db'}", "--no-progress"],
                          capture_output=True, text=True, env=rank_env(), cwd=world, timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, needle)
    from runtime.workload import build_workload

    with pytest.raises(WorkloadError, match=needle.split(":")[0]):
        build_workload(factory, None, {})
    assert dump(world / "s.db") == before
    assert not list(world.glob("s.*.json"))  # no plan or profile written either
