"""Collective times from the bytes on the wire: the fit on the profile's own timings, and a profile re-timed for a
target link ([Note: Bytes on the wire], [Note: The per-call overhead, fitted])."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from planner.artifacts.plan import Plan
from planner.artifacts.target import Target
from planner.errors import TargetError
from planner.presentation.cli import main
from planner.simulation.link import (
    GLOO_ALL_GATHER_EFFICIENCY,
    LinkFit,
    fit_link,
    link_efficiency,
    retarget,
    ring_steps,
    wire_fraction,
)
from planner.simulation.parameters import profile_params, simulator_for
from planner.testing import synthetic_profile

OVERHEAD_MS, MS_PER_BYTE = 0.4, 2e-6  # the recorded link: 0.5 GB/s after a 0.4 ms per-call overhead


def law_profile(world_size: int = 2):
    """A gloo (CPU) profile whose collectives follow ``t = overhead + ms_per_byte * wire bytes`` exactly, over
    modules of different sizes."""
    p = synthetic_profile(n_blocks=4)
    p = dataclasses.replace(p, fingerprint=dataclasses.replace(p.fingerprint, world_size=world_size))
    modules = {}
    for k, (fqn, m) in enumerate(p.modules.items()):
        nbytes = (k + 1) * 1_000_000
        ag = OVERHEAD_MS + MS_PER_BYTE * wire_fraction("all_gather", world_size, "gloo") * nbytes
        rs = OVERHEAD_MS + MS_PER_BYTE * wire_fraction("reduce_scatter", world_size, "gloo") * nbytes
        modules[fqn] = dataclasses.replace(m, unsharded_bytes=nbytes, grad_bytes=nbytes * m.calls,
                                           sharded_bytes=nbytes // world_size, all_gather_ms=ag, reduce_scatter_ms=rs)
    return dataclasses.replace(p, modules=modules)


def target(bandwidth: str, backend: str = "gloo", latency: str = "0us", world_size: int = 2) -> Target:
    return Target(world_size=world_size, ranks_per_node=1, backend=backend,
                  link={"inter_node": {"bandwidth": bandwidth, "latency": latency}})


def test_what_each_collective_puts_on_the_wire():
    """A ring sends (W-1)/W of the bytes in W-1 steps; gloo's reduce-scatter is an all-reduce: twice both."""
    assert wire_fraction("all_gather", 4, "nccl") == wire_fraction("all_gather", 4, "gloo") == 0.75
    assert wire_fraction("reduce_scatter", 4, "nccl") == 0.75 and wire_fraction("reduce_scatter", 4, "gloo") == 1.5
    assert ring_steps("all_gather", 4, "gloo") == 3 and ring_steps("reduce_scatter", 4, "gloo") == 6
    assert wire_fraction("all_gather", 1, "nccl") == 0.0 and ring_steps("reduce_scatter", 1, "nccl") == 0


def test_the_fit_recovers_each_kinds_overhead_and_recorded_cost_per_byte():
    fits = fit_link(law_profile())
    assert set(fits) == {"all_gather", "reduce_scatter"}
    for kind, fit in fits.items():
        assert fit.kind == kind and fit.identifiable and fit.points == 5
        assert fit.overhead_ms == pytest.approx(OVERHEAD_MS) and fit.ms_per_byte == pytest.approx(MS_PER_BYTE)
        assert fit.bytes_per_s == pytest.approx(5e8)
    same_size = synthetic_profile(n_blocks=4)  # every block the same size: overhead and bytes not told apart
    for one in fit_link(same_size).values():
        assert one.overhead_ms == 0.0 and one.ms_per_byte > 0


def test_the_slower_of_host_and_wire_sets_the_pace_at_the_algorithms_share_of_the_rate():
    """[Note: Host work and the wire]: gloo's all-gather reaches part of the link's rate; its all-reduce and NCCL's
    collectives (whose bus bandwidth includes it) reach all of it."""
    assert link_efficiency("all_gather", "gloo") == GLOO_ALL_GATHER_EFFICIENCY < 1
    assert GLOO_ALL_GATHER_EFFICIENCY < link_efficiency("all_gather", "gloo", ranks_per_node=2) < 1
    assert link_efficiency("all_gather", "nccl", ranks_per_node=2) == 1.0
    assert link_efficiency("reduce_scatter", "gloo") == link_efficiency("all_gather", "nccl") == 1.0
    fit = LinkFit("reduce_scatter", overhead_ms=1.0, ms_per_byte=1e-6, points=4, identifiable=True)
    assert fit.ms(1e6, 1e9, "gloo") == pytest.approx(1.0 + 1.0)  # host 1 ms, wire 1 ms: together
    assert fit.ms(1e6, 0.5e9, "gloo") == pytest.approx(1.0 + 2.0)  # the wire is the slower
    assert fit.ms(1e6, 1e12, "gloo") == pytest.approx(2.0)  # a faster link than the hosts changes nothing
    assert fit.ms(1e6, None, "gloo") == pytest.approx(2.0)  # the recorded link
    gather = dataclasses.replace(fit, kind="all_gather")
    assert gather.ms(1e6, 1e9, "gloo") == pytest.approx(1.0 + 1.0 / GLOO_ALL_GATHER_EFFICIENCY)
    assert gather.ms(1e6, 1e9, "nccl") == pytest.approx(2.0)


def test_a_slower_link_retimes_each_collective_from_its_bytes():
    p = law_profile()
    same = retarget(p, target("4Gbit/s")).profile  # 0.5 GB/s: the recorded cost per byte
    e = GLOO_ALL_GATHER_EFFICIENCY
    for fqn, m in p.modules.items():  # the reduce-scatter as recorded; the all-gather at its share of the rate
        assert same.modules[fqn].reduce_scatter_ms == pytest.approx(m.reduce_scatter_ms)
        assert same.modules[fqn].all_gather_ms == pytest.approx(OVERHEAD_MS + 0.5 * m.unsharded_bytes * 2e-6 / e)
    slow = retarget(p, target("1Gbit/s", latency="50us")).profile  # 0.125 GB/s, 4x slower than recorded
    for fqn, m in p.modules.items():
        w = 0.5 * m.unsharded_bytes
        assert slow.modules[fqn].all_gather_ms == pytest.approx(OVERHEAD_MS + w * 8e-6 / e + 0.05)
        assert slow.modules[fqn].reduce_scatter_ms == pytest.approx(OVERHEAD_MS + 2 * w * 8e-6 + 2 * 0.05)
        assert slow.modules[fqn].fwd_ms == m.fwd_ms  # compute stays as recorded
    fqn = "b0"
    fast = retarget(p, target("400GB/s")).profile  # faster than the hosts recorded: the recorded per-byte cost stays
    assert fast.modules[fqn].reduce_scatter_ms == pytest.approx(p.modules[fqn].reduce_scatter_ms)
    assert fast.modules[fqn].all_gather_ms == pytest.approx(p.modules[fqn].all_gather_ms)
    params = profile_params(p)
    steps = [simulator_for(q, params).run(Plan.default(p)).step_ms for q in (same, slow)]
    assert steps[1] > steps[0]


def test_the_in_step_scale_stretches_the_hosts_work_and_not_what_a_slower_link_adds():
    """[Note: The in-step scale is the hosts']: on a target's link each call keeps apart what the link adds beyond
    the recorded hosts' work (its ring latency included); a step scales the rest by ``comm_scale`` alone."""
    p = law_profile()
    e = GLOO_ALL_GATHER_EFFICIENCY
    recorded_link = retarget(p, target("4Gbit/s")).profile  # the reduce-scatter's wire time is its host time
    slow = retarget(p, target("1Gbit/s", latency="50us")).profile
    for fqn, m in p.modules.items():
        w = 0.5 * m.unsharded_bytes
        assert recorded_link.modules[fqn].reduce_scatter_link_ms == pytest.approx(0.0)
        assert slow.modules[fqn].all_gather_link_ms == pytest.approx(w * 8e-6 / e - w * MS_PER_BYTE + 0.05)
        assert slow.modules[fqn].reduce_scatter_link_ms == pytest.approx(2 * w * (8e-6 - MS_PER_BYTE) + 2 * 0.05)
        assert p.modules[fqn].all_gather_link_ms == p.modules[fqn].reduce_scatter_link_ms == 0.0  # as recorded
    on_a_gpu = dataclasses.replace(slow, fingerprint=dataclasses.replace(slow.fingerprint, device_type="cuda"))
    hosts = dataclasses.replace(on_a_gpu, modules={  # the hosts' share alone
        f: dataclasses.replace(m, all_gather_ms=m.all_gather_ms - m.all_gather_link_ms, all_gather_link_ms=0.0,
                               reduce_scatter_ms=m.reduce_scatter_ms - m.reduce_scatter_link_ms,
                               reduce_scatter_link_ms=0.0) for f, m in slow.modules.items()})

    def comm(profile, scale: float) -> float:
        params = dataclasses.replace(profile_params(p), comm_scale=scale)
        return simulator_for(profile, params).run(Plan.default(p)).comm_ms

    assert comm(on_a_gpu, 1.5) == pytest.approx(comm(on_a_gpu, 1.0) + 0.5 * comm(hosts, 1.0))
    assert comm(hosts, 1.0) < comm(on_a_gpu, 1.0) < comm(on_a_gpu, 1.5) < 1.5 * comm(on_a_gpu, 1.0)
    written = json.loads(slow.to_json())["modules"][0]  # kept in the profile's JSON, read back the same
    assert written["all_gather_link_ms"] > 0 and type(slow).from_json(slow.to_json()) == slow
    assert "all_gather_link_ms" not in json.loads(p.to_json())["modules"][0]  # a recorded profile: as release 0.1.0


def test_a_target_on_another_backend_or_a_profile_without_collectives_is_refused():
    """A gloo profile's host costs were fitted on gloo's algorithms: re-timing them for NCCL would only relabel
    them."""
    with pytest.raises(TargetError, match="target backend 'nccl', but the profile's collectives ran on gloo"):
        retarget(law_profile(), target("1Gbit/s", backend="nccl"))
    alone = law_profile(world_size=1)
    with pytest.raises(TargetError, match="no collective with bytes on the wire"):
        retarget(alone, Target(world_size=1, ranks_per_node=1, backend="gloo"))


def test_simulate_predicts_for_a_target(tmp_path):
    p = law_profile()
    p.to_json(tmp_path / "p.json")
    (tmp_path / "t.toml").write_text('world_size = 2\nranks_per_node = 1\nbackend = "gloo"\n'
                                     '[link.inter_node]\nbandwidth = "1Gbit/s"\n')
    runner = CliRunner()
    here = json.loads(runner.invoke(main, ["simulate", str(tmp_path / "p.json"), "--json"]).output)
    there = runner.invoke(main, ["simulate", str(tmp_path / "p.json"), "--target", str(tmp_path / "t.toml"), "--json"])
    figures = json.loads(there.output)
    assert figures["step_ms"] > here["step_ms"] and figures["target"]["backend"] == "gloo"
    assert figures["link_fit"]["all_gather"]["overhead_ms"] == pytest.approx(OVERHEAD_MS)
    assert figures["link_fit"]["reduce_scatter"]["ms_per_byte"] == pytest.approx(MS_PER_BYTE)
    text = runner.invoke(main, ["simulate", str(tmp_path / "p.json"), "--target", str(tmp_path / "t.toml")]).output
    assert text.startswith("target        2 ranks (1 per node), gloo; shard group of 2 across 2 nodes (inter-node "
                           "1Gbit/s)\ndistance      from a profile of 2 ranks to 2 on 2 nodes (x1)")
    assert ("all-gather      per-call overhead 0.40 ms, recorded 4.00 Gbit/s effective (fitted on 5 recorded "
            "calls); on the target at 63% of the link's rate") in text
    assert "reduce-scatter  per-call overhead 0.40 ms" in text and "at 100% of the link's rate" in text
