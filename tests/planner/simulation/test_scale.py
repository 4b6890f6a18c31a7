"""A profile predicted at another world size and on an HSDP mesh ([Note: What re-sharding changes], [Note: HSDP's
all-reduce], [Note: Latency per ring step])."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from planner.artifacts.plan import Plan
from planner.artifacts.target import Target
from planner.errors import PlanMismatchError
from planner.presentation.cli import main
from planner.simulation.link import fit_link, inter_node_steps, retarget, ring_latency_ms, ring_steps, wire_fraction
from planner.simulation.parameters import profile_params, simulator_for
from planner.simulation.resharding import collective_bytes, reshard, shard_bytes
from tests.planner.simulation.test_link import MS_PER_BYTE, OVERHEAD_MS, law_profile

ROWS = ((37, 32_000), (13, 4_000), (1, 4_000))  # an embedding-like, a linear's 13-row weight, a one-row bias


def rows_profile(world_size: int = 2):
    """:func:`law_profile` whose modules record their parameter rows, its shards and optimizer state with them."""
    p = law_profile(world_size)
    modules = {}
    for k, (fqn, m) in enumerate(p.modules.items()):
        rows = tuple((d0 * (k + 1) if d0 > 1 else d0, row) for d0, row in ROWS)
        m = dataclasses.replace(m, parameter_rows=rows, unsharded_bytes=sum(d0 * r for d0, r in rows))
        nbytes = collective_bytes(m, world_size)
        modules[fqn] = dataclasses.replace(
            m, sharded_bytes=shard_bytes(m, world_size), grad_bytes=m.unsharded_bytes * m.calls,
            all_gather_ms=OVERHEAD_MS + MS_PER_BYTE * wire_fraction("all_gather", world_size, "gloo") * nbytes,
            reduce_scatter_ms=OVERHEAD_MS + MS_PER_BYTE * wire_fraction("reduce_scatter", world_size, "gloo") * nbytes)
    shards = sum(m.sharded_bytes for m in modules.values())
    return dataclasses.replace(p, modules=modules, optimizer_state_bytes=2 * shards, optimizer_temp_bytes=shards,
                               optimizer_ms=8.0)


def cluster(world_size: int, per_node: int, mesh=None, inter: str = "1Gbit/s", latency: str = "0us",
            intra: str = "recorded", backend: str = "gloo") -> Target:
    return Target(world_size=world_size, ranks_per_node=per_node, backend=backend, mesh=mesh,
                  link={"inter_node": {"bandwidth": inter, "latency": latency},
                        "intra_node": {"bandwidth": intra, "latency": "0us" if intra == "recorded" else "2us"}})


def test_a_shard_is_padded_as_fsdp2_pads_dim_0():
    """ceil(dim0 / S) rows per rank, S of them in the all-gather; without rows the unsharded bytes over S."""
    m = rows_profile().modules[""]
    assert shard_bytes(m, 4) == 10 * 32_000 + 4 * 4_000 + 1 * 4_000  # 37 -> 10 rows, 13 -> 4, 1 -> 1
    assert collective_bytes(m, 4) == 4 * shard_bytes(m, 4) > m.unsharded_bytes
    assert shard_bytes(m, 1) == m.unsharded_bytes == collective_bytes(m, 1)
    bare = dataclasses.replace(m, parameter_rows=())
    assert shard_bytes(bare, 4) == -(-m.unsharded_bytes // 4) and collective_bytes(bare, 4) == m.unsharded_bytes


def test_resharding_moves_the_shards_and_the_optimizer_with_them_and_keeps_the_rest():
    p = rows_profile()
    q = reshard(p, shard=8, world_size=8)
    ratio = sum(m.sharded_bytes for m in q.modules.values()) / sum(m.sharded_bytes for m in p.modules.values())
    assert 0.25 < ratio < 0.4  # a quarter of the shard, and the padding of small dim 0s
    assert q.optimizer_state_bytes == pytest.approx(p.optimizer_state_bytes * ratio, abs=1)
    assert q.optimizer_ms == pytest.approx(p.optimizer_ms * ratio) and q.fingerprint.world_size == 8
    for fqn, m in p.modules.items():
        assert (q.modules[fqn].unsharded_bytes, q.modules[fqn].activation_bytes, q.modules[fqn].fwd_ms) == (
            m.unsharded_bytes, m.activation_bytes, m.fwd_ms)
    assert q.measured_peak_bytes is None and q.per_rank == []
    assert reshard(p, shard=2, world_size=4).modules == p.modules  # HSDP [2, 2]: the shard of the profile's 2 ranks
    with pytest.raises(ValueError, match="shard size 3 does not divide world size 4"):
        reshard(p, shard=3, world_size=4)


def test_the_predicted_peak_at_4_ranks_drops_by_the_shards_and_the_optimizer_state():
    p = rows_profile()
    p = dataclasses.replace(p, optimizer_temp_bytes=20 * p.optimizer_temp_bytes)  # the peak: the optimizer step
    params = profile_params(p)
    here = simulator_for(p, params).run(Plan.default(p))
    there = retarget(p, cluster(4, 2, intra="recorded")).profile
    four = simulator_for(there, params).run(Plan.default(p))
    saved = sum(m.sharded_bytes for m in p.modules.values()) - sum(m.sharded_bytes for m in there.modules.values())
    state = p.optimizer_state_bytes - there.optimizer_state_bytes
    temp = p.optimizer_temp_bytes - there.optimizer_temp_bytes
    assert saved > 0 and state > 0 and temp > 0
    # at the optimizer step: the parameters' shards, the sharded gradients, the state and the temporaries
    assert here.peak_bytes - four.peak_bytes == 2 * saved + state + temp


def test_nccl_charges_only_the_steps_that_cross_nodes_at_the_inter_node_latency():
    """tuning.cc: nInterSteps = nNodes - 1 of a ring all-gather's nRanks - 1 steps; twice both for an
    all-reduce."""
    assert (ring_steps("all_gather", 128, "nccl"), inter_node_steps("all_gather", 16, "nccl")) == (127, 15)
    assert (ring_steps("all_reduce", 128, "nccl"), inter_node_steps("all_reduce", 16, "nccl")) == (254, 30)
    assert inter_node_steps("reduce_scatter", 16, "gloo") == 30 and inter_node_steps("all_gather", 1, "nccl") == 0
    t = Target(world_size=128, ranks_per_node=8, backend="nccl",
               link={"inter_node": {"bandwidth": "400Gbit/s", "latency": "10us"},
                     "intra_node": {"bandwidth": "300GB/s", "latency": "1us"}})
    shard_group = t.groups[0]
    assert (shard_group.size, shard_group.nodes) == (128, 16)
    assert ring_latency_ms("all_gather", shard_group, "nccl") == pytest.approx(1e-3 * (112 * 1 + 15 * 10))


def test_hsdp_all_gathers_over_the_shard_group_and_adds_the_all_reduce_over_the_replicas():
    p = law_profile()
    fits = fit_link(p)
    hsdp = retarget(p, cluster(4, 2, mesh=(2, 2), inter="1Gbit/s")).profile
    e = 1e3 / 1.25e8  # ms per byte at 1 Gbit/s
    for fqn, m in p.modules.items():
        if not m.unsharded_bytes:
            continue
        # the shard group is one node's two ranks: the recorded link, as recorded
        assert hsdp.modules[fqn].all_gather_ms == pytest.approx(m.all_gather_ms)
        all_reduce = wire_fraction("all_reduce", 2, "gloo") * -(-m.unsharded_bytes // 2)
        expected = m.reduce_scatter_ms + fits["reduce_scatter"].overhead_ms + max(MS_PER_BYTE, e) * all_reduce
        assert hsdp.modules[fqn].reduce_scatter_ms == pytest.approx(expected)
    fsdp = retarget(p, cluster(4, 2, inter="1Gbit/s")).profile  # every collective across the slow link
    params = profile_params(p)
    steps = [simulator_for(q, params).run(Plan.default(p)).step_ms for q in (hsdp, fsdp)]
    assert steps[0] < steps[1]


def test_a_link_per_node_is_shared_by_the_rings_that_cross_it_at_once():
    """[Note: A link per node, shared]: HSDP's replicate groups each cross a node's one link at once; FSDP's one
    ring crosses it once each way; a link per rank is each ring's own."""
    def shared(mesh, per="node", world=8, per_node=4):
        t = Target(world_size=world, ranks_per_node=per_node, backend="gloo", mesh=mesh,
                   link={"inter_node": {"bandwidth": "1Gbit/s", "per": per}, "intra_node": {"bandwidth": "recorded"}})
        return [(g.role, g.sharing) for g in t.groups]

    assert shared((2, 4)) == [("shard", 1), ("replicate", 4)]  # shard groups within a node: 4 replicas cross
    assert shared((2, 4), per="rank") == [("shard", 1), ("replicate", 1)]
    assert shared(None) == [("shard", 1), ("replicate", 1)]  # one ring over every rank
    assert shared((4, 2)) == [("shard", 1), ("replicate", 2)]  # 2 shard groups on a node, each within it
    # a shard group over 2 nodes: one ring a node; each of a node's 4 ranks in its own replicate group
    assert shared((2, 8), world=16) == [("shard", 1), ("replicate", 4)]
    p = law_profile()
    alone = retarget(p, cluster(4, 2, mesh=(2, 2), inter="1Gbit/s")).profile
    node = cluster(4, 2, mesh=(2, 2), inter="1Gbit/s")
    node = node.model_copy(update={"link": node.link.model_copy(update={
        "inter_node": node.link.inter_node.model_copy(update={"per": "node"})})})
    halved = retarget(p, node).profile
    for fqn, m in p.modules.items():
        if m.unsharded_bytes:  # the all-reduce's link share at half the rate: more than twice the wire's excess
            assert halved.modules[fqn].reduce_scatter_link_ms > 2 * alone.modules[fqn].reduce_scatter_link_ms
            assert halved.modules[fqn].all_gather_ms == alone.modules[fqn].all_gather_ms  # within a node


def test_a_target_mesh_is_checked_against_the_world_and_its_nodes():
    with pytest.raises(ValueError, match="latency '2us' on the recorded link: its latency is in the profile's own"):
        Target(world_size=2, ranks_per_node=2, backend="gloo",
               link={"intra_node": {"bandwidth": "recorded", "latency": "2us"}})
    with pytest.raises(ValueError, match=r"mesh \[2, 3\] has 6 ranks, world_size 4"):
        cluster(4, 2, mesh=(2, 3))
    with pytest.raises(ValueError, match="shard group's 3 ranks sit unevenly on nodes of 2 ranks"):
        cluster(6, 2, mesh=(2, 3))
    with pytest.raises(ValueError, match=r"shard group of 2 ranks on 1 node needs \[link.intra_node\]"):
        Target(world_size=4, ranks_per_node=2, backend="gloo", mesh=(2, 2),
               link={"inter_node": {"bandwidth": "1Gbit/s"}})
    t = cluster(16, 8, mesh=(2, 8))
    assert [(g.role, g.size, g.nodes, g.link.bandwidth) for g in t.groups] == [
        ("shard", 8, 1, "recorded"), ("replicate", 2, 2, "1Gbit/s")]


def test_simulate_predicts_another_world_size_and_says_how_far_it_is(tmp_path):
    rows_profile().to_json(tmp_path / "p.json")
    (tmp_path / "t.toml").write_text('world_size = 8\nranks_per_node = 4\nbackend = "gloo"\nmesh = [2, 4]\n'
                                     '[link.inter_node]\nbandwidth = "1Gbit/s"\nlatency = "50us"\n'
                                     '[link.intra_node]\nbandwidth = "recorded"\n')
    runner = CliRunner()
    out = runner.invoke(main, ["simulate", str(tmp_path / "p.json"), "--target", str(tmp_path / "t.toml"), "--json"])
    figures = json.loads(out.output)
    assert figures["extrapolation"]["world_size"] == 8 and figures["extrapolation"]["shard"] == 4
    assert figures["extrapolation"]["padded_exactly"] is True
    text = runner.invoke(main, ["simulate", str(tmp_path / "p.json"), "--target", str(tmp_path / "t.toml")]).output
    assert "HSDP [2, 4]; shard group of 4 on 1 node (intra-node recorded), replicate group of 2 across 2 nodes" in text
    assert "distance      from a profile of 2 ranks to 8 on 2 nodes (x4); shards over 4, replicas 2" in text


def test_a_plan_made_at_another_world_size_simulates_with_a_warning_and_another_model_is_refused(tmp_path):
    """[Note: Plans travel]: the plan names modules by FQN; its gain was confirmed where it was tuned."""
    p = rows_profile()
    p.to_json(tmp_path / "p.json")
    plan = Plan.default(p)
    travelled = dataclasses.replace(plan, fingerprint=dataclasses.replace(plan.fingerprint, world_size=8))
    travelled.to_json(tmp_path / "plan.json")
    assert travelled.check_matches(p).startswith("plan tuned on 8 ranks, applied on 2: its modules are named by FQN")
    assert plan.check_matches(p) is None
    out = CliRunner().invoke(main, ["simulate", str(tmp_path / "p.json"), str(tmp_path / "plan.json")])
    assert out.exit_code == 0 and "step" in out.stdout
    assert out.stderr.startswith("warning: plan tuned on 8 ranks, applied on 2") and out.stderr.count("\n") == 1
    other = dataclasses.replace(plan, fingerprint=dataclasses.replace(
        plan.fingerprint, param_numels=(1, *plan.fingerprint.param_numels[1:])))
    with pytest.raises(PlanMismatchError, match="parameter count of FSDP module '': plan has 1"):
        other.check_matches(p)
