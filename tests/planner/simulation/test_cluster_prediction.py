"""Predicting a cluster before renting it: presets, nccl-tests curves, the band on a predicted step, and a profile of
a slice extended to the model's depth ([Note: Reading nccl-tests], [Note: The band on a predicted step],
[Note: Repeating measured blocks], [Note: A profile of one GPU])."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.artifacts.nccl_tests import read_nccl_tests
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.artifacts.target import Target, load_target, presets
from planner.presentation.cli import main
from planner.simulation.band import blom_score, step_band
from planner.simulation.depth import deepen
from planner.simulation.link import fit_link, retarget
from planner.simulation.parameters import profile_params, simulator_for
from planner.statistics.launches import prior_for
from tests.planner.simulation.test_link import law_profile

DATA = Path(__file__).parents[2] / "data"
SAMPLE = DATA / "nccl_tests" / "all_gather_sample.txt"
GPU_PROFILE = DATA / "traces" / "fsdp2-llama-h100-ws1.recorder.json"


def test_every_preset_loads_and_cites_where_its_figures_come_from():
    names = presets()
    assert {"h100-ib400", "h200-ib400", "a100-ib200", "cpu-emulated-1gbit", "cpu-emulated-4gbit"} <= names.keys()
    for name in names:
        t = load_target(name)
        assert t.preset == name and t.source and ("https://" in t.source or "bench/results/" in t.source)
        inter = t.link.inter_node
        assert t.nodes >= 2 and inter is not None and inter.bytes_per_s > 0 and inter.spread_fraction > 0
    h100, a100 = load_target("h100-ib400"), load_target("a100-ib200")
    assert h100.backend == "nccl" and h100.ranks_per_node == 8
    assert a100.link.inter_node.bytes_per_s == pytest.approx(h100.link.inter_node.bytes_per_s / 2)  # HDR vs NDR


def test_a_file_overrides_a_presets_fields_and_keeps_the_rest(tmp_path):
    (tmp_path / "t.toml").write_text('preset = "h100-ib400"\nworld_size = 64\nmesh = [8, 8]\n'
                                     '[link.inter_node]\nbandwidth = "300GB/s"\n')
    t = load_target(tmp_path / "t.toml")
    preset = load_target("h100-ib400")
    assert (t.world_size, t.mesh, t.nodes) == (64, (8, 8), 8)
    assert t.link.inter_node.bytes_per_s == 300e9
    assert t.link.inter_node.latency == preset.link.inter_node.latency  # the preset's latency kept
    assert t.link.intra_node == preset.link.intra_node
    assert load_target("h100-ib400", world_size=32).world_size == 32


def test_an_nccl_tests_file_gives_the_bandwidth_by_message_size(tmp_path):
    curve = read_nccl_tests(SAMPLE)
    assert curve.sizes[0] == 1048576 and curve.bytes_per_s[-1] == pytest.approx(190.29e9)
    assert curve.at(1048576) == pytest.approx(10.31e9) and curve.at(10e9) == curve.bytes_per_s[-1]  # held at ends
    mid = curve.at(1.5 * 1048576)
    assert curve.bytes_per_s[0] < mid < curve.bytes_per_s[1]
    # A link given by the file: small messages get the small-message bandwidth, not the peak.
    (tmp_path / "t.toml").write_text(f'world_size = 2\nranks_per_node = 1\nbackend = "gloo"\n[link.inter_node]\n'
                                     f'nccl_tests = "{SAMPLE}"\n')
    link = load_target(tmp_path / "t.toml").link.inter_node
    assert link.bytes_per_s_at(1048576) == pytest.approx(10.31e9) and link.bytes_per_s == curve.peak


def test_a_curve_times_collectives_below_its_peak_slower(tmp_path):
    """A one-GPU profile on 16 ranks: timed by the link alone, each all-gather on the curve takes at least as long
    as on a link of the curve's peak, and longer where its size sits below the peak's."""
    p = Profile.load(GPU_PROFILE)
    (tmp_path / "curve.toml").write_text(f'world_size = 16\nranks_per_node = 8\nbackend = "nccl"\n'
                                         f'[link.intra_node]\nbandwidth = "400GB/s"\n'
                                         f'[link.inter_node]\nnccl_tests = "{SAMPLE}"\n')
    peak = Target(world_size=16, ranks_per_node=8, backend="nccl",
                  link={"inter_node": {"bandwidth": f"{read_nccl_tests(SAMPLE).peak / 1e9}GB/s"},
                        "intra_node": {"bandwidth": "400GB/s"}})
    slow = retarget(p, load_target(tmp_path / "curve.toml")).profile
    fast = retarget(p, peak).profile
    assert all(slow.modules[f].all_gather_ms >= fast.modules[f].all_gather_ms for f in p.modules)
    assert any(slow.modules[f].all_gather_ms > 1.01 * fast.modules[f].all_gather_ms for f in p.modules)


def test_the_band_holds_the_step_and_names_what_moves_it_most():
    p = law_profile()
    slow = Target(world_size=2, ranks_per_node=1, backend="gloo",
                  link={"inter_node": {"bandwidth": "0.1Gbit/s", "spread": "20%"}})
    band = step_band(p, slow)
    step = simulator_for(retarget(p, slow).profile, profile_params(p)).run(Plan.default(p)).step_ms
    assert band.step_ms == pytest.approx(step) and band.low_ms < step < band.high_ms
    assert band.dominant.name == "link"  # a wire-bound link: its spread, not the fit (exact here), moves the step
    exact = Target(world_size=2, ranks_per_node=1, backend="gloo", link={"inter_node": {"bandwidth": "0.1Gbit/s"}})
    alone = step_band(p, exact)  # no spread stated, a fit without error: the level between processes alone
    tau = prior_for(p.fingerprint.device_type).spread.tau
    assert [(x.name, x.width_ms > 0) for x in alone.parts] == [
        ("fit", False), ("link", False), ("rank skew", False), ("level", True)]
    assert (alone.low_ms, alone.high_ms) == (pytest.approx(step * (1 - tau)), pytest.approx(step * (1 + tau)))
    gpu = dataclasses.replace(p, fingerprint=dataclasses.replace(p.fingerprint, device_type="cuda"))
    assert next(x for x in step_band(gpu, exact.model_copy(update={"backend": "nccl"})).parts
                if x.name == "level").high_ms < next(x for x in alone.parts if x.name == "level").high_ms


def test_rank_skew_widens_the_band_with_the_world_size():
    assert blom_score(1) == 0 and 0 < blom_score(2) < blom_score(8) < blom_score(512)
    p = Profile.load(GPU_PROFILE)
    ranks = [dataclasses.replace(r, rank=k) for k, r in enumerate(p.per_rank * 2)]
    first = ranks[0].isolated
    fast = {f: dataclasses.replace(m, compute=dataclasses.replace(m.compute, fwd_ms=m.compute.fwd_ms * 0.9))
            if m.compute is not None else m for f, m in first.modules.items()}
    ranks[1] = dataclasses.replace(ranks[1], isolated=dataclasses.replace(first, modules=fast))
    skewed = dataclasses.replace(p, per_rank=ranks)
    small = step_band(skewed, load_target("h100-ib400", world_size=8, ranks_per_node=8))
    large = step_band(skewed, load_target("h100-ib400", world_size=512))
    skew = {b: next(x for x in b.parts if x.name == "rank skew") for b in (small, large)}
    assert 0 < skew[small].high_ms < skew[large].high_ms


def test_a_one_gpu_profile_predicts_a_preset_from_the_link_alone():
    p = Profile.load(GPU_PROFILE)
    assert all(f.points == 0 for f in fit_link(p).values())
    result = CliRunner().invoke(main, ["simulate", str(GPU_PROFILE), "--target", "h100-ib400", "--world-size", "64",
                                       "--json"])
    figures = json.loads(result.output)
    low, high = figures["band_ms"]
    assert figures["target"]["world_size"] == 64 and low <= figures["step_ms"] <= high
    assert figures["band_dominant"] in ("fit", "link", "rank skew", "level")


def test_a_slice_extends_to_the_full_depth_by_repeating_its_blocks():
    p = Profile.load(GPU_PROFILE)
    measured = [f for f in p.fingerprint.module_fqns if f.startswith("model.layers.")]
    deep = deepen(p, 32, "layers.*")
    fqns = deep.profile.fingerprint.module_fqns
    assert len([f for f in fqns if f.startswith("model.layers.")]) == 32 and fqns[-1] == "model.layers.31"
    assert deep.report.added[0] == f"model.layers.{len(measured)}"
    assert deep.profile.modules["model.layers.12"].fwd_ms == p.modules["model.layers.0"].fwd_ms
    assert deep.profile.post_forward_order[-1] == p.post_forward_order[-1]  # the root still last
    assert deep.profile.measured_step_ms is None and "repeated to 32" in deep.report.describe()
    params = profile_params(p)
    steps = [simulator_for(deepen(p, d).profile, params).run(Plan.default(deepen(p, d).profile)).step_ms
             for d in (12, 22, 32)]
    assert steps[0] == pytest.approx(simulator_for(p, params).run(Plan.default(p)).step_ms)
    assert steps[2] - steps[1] == pytest.approx(steps[1] - steps[0], rel=0.05)  # each 10 blocks cost alike
    assert deepen(p, len(measured)).report.added == ()
