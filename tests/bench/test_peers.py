"""``bench.peers``: the settings frameworks ship, built for a profile's model (no ranks)."""

from __future__ import annotations

from bench.peers import peer_plans
from planner.testing import synthetic_profile


def test_the_peers_are_the_frameworks_settings_for_this_model():
    profile = synthetic_profile(n_blocks=4)
    plans = peer_plans(profile)
    assert list(plans)[0] == "FSDP2 default" and len(plans) == 6
    blocks = [f for f in profile.post_forward_order if f]
    nemo = plans["NeMo-Automodel (forward 1, backward 2)"].modules
    assert nemo[blocks[0]].forward_prefetch == (blocks[1],) and nemo[blocks[2]].backward_prefetch == (blocks[1],
                                                                                                         blocks[0])
    verl = plans["verl (forward 1)"].modules
    assert verl[blocks[1]].forward_prefetch == (blocks[2],) and not verl[blocks[1]].backward_prefetch
    assert all(not m.reshard_after_forward for m in plans["torchtitan reshard never"].modules.values())
    assert all(m.reshard_after_forward for m in plans["torchtitan reshard always"].modules.values())
    for plan in plans.values():
        plan.check_matches(profile)
