"""Activation checkpointing in the simulator, against hand-computed memory timelines.

The rule (``planner.simulation._kernel.hooks._backward``): a checkpointed block keeps only its inputs from
forward (``activation_bytes``) and recomputes the rest (``recompute_activation_bytes``) inside its backward
compute, after FSDP2's pre-backward all-gather; the recomputed tensors are freed when its gradient compute ends.
The recompute's time is part of ``bwd_ms``, so the step's timeline is that of the plain model.
"""

from __future__ import annotations

import dataclasses

import pytest

from planner.artifacts.plan import Plan
from planner.simulation.parameters import simulate


def _checkpoint(profile, blocks, recompute_bytes):
    modules = {f: dataclasses.replace(m, recompute_activation_bytes=recompute_bytes) if f in blocks else m
               for f, m in profile.modules.items()}
    return dataclasses.replace(profile, modules=modules)


def test_every_block_checkpointed_holds_one_blocks_recompute(make_profile):
    """U = 10 unsharded bytes per block, inputs a = 100, recompute R = 1000 per block; CPU default plan.

    Backward: b1's pre-backward prefetches b0 synchronously (2a + 3U = 230 for a moment, gloo's buffer
    included); b1's compute holds both blocks unsharded and its recompute: 2a + 2U + R = 1220; then b1 frees
    a + R and reshards; b0's compute: a + U + R = 1110. Peak 1220, where the plain model with A = 1000 held
    2A + 3U = 2030.
    """
    p = _checkpoint(make_profile(unsharded_bytes=10, activation_bytes=100), {"b0", "b1"}, 1000)
    r = simulate(p, Plan.default(p))
    assert r.peak_bytes == 1220
    plain = make_profile(unsharded_bytes=10, activation_bytes=1000)
    assert simulate(plain, Plan.default(plain)).peak_bytes == 2030
    assert r.step_ms == pytest.approx(simulate(plain, Plan.default(plain)).step_ms)  # recompute is in bwd_ms


def test_selective_checkpointing_peaks_where_the_plain_block_is(make_profile):
    """Only b0 checkpointed (a = 100, R = 1000); b1 plain (A = 1000); U = 10.

    b1's pre-backward with b0's synchronous prefetch: a + A + 3U = 1130; b1's compute: a + A + 2U = 1120;
    b0's compute after b1 freed A and resharded: a + U + R = 1110. Peak 1130.
    """
    base = make_profile(unsharded_bytes=10, activation_bytes=1000)
    b0 = dataclasses.replace(base.modules["b0"], activation_bytes=100, recompute_activation_bytes=1000)
    p = dataclasses.replace(base, modules={**base.modules, "b0": b0})
    assert simulate(p, Plan.default(p)).peak_bytes == 1130


def test_a_checkpointed_block_kept_unsharded_recomputes_without_its_all_gather(make_profile):
    """Three checkpointed blocks (a = 100, U = 10, R = 1000; fwd 10, bwd 20, all-gather 5, reduce-scatter 3 ms, CPU:
    every collective exposed). FSDP2's default: 3 x (10 + 20) compute + 6 all-gathers x 5 + 3 reduce-scatters x 3
    = 129 ms; peak at b2's backward compute: the inputs 3a, b2 and the prefetched b1 unsharded 2U, b2's recompute
    R = 1320.

    ``reshard_after_forward=False`` on a checkpointed block: its recompute runs on parameters still unsharded, so
    its backward all-gather goes (124 ms). The memory is priced where it lands: b0 kept unsharded through the
    backward adds U to b2's compute (1330); b2, unsharded there anyway, adds nothing (1320).
    """
    p = _checkpoint(make_profile(n_blocks=3, unsharded_bytes=10, activation_bytes=100), {"b0", "b1", "b2"}, 1000)
    default = Plan.default(p)

    def keep(*blocks):
        return dataclasses.replace(default, modules={
            **default.modules, **{b: dataclasses.replace(default.modules[b], reshard_after_forward=False)
                                  for b in blocks}})

    got = {blocks: simulate(p, keep(*blocks)) for blocks in [(), ("b2",), ("b0",), ("b0", "b2")]}
    assert [(r.step_ms, r.peak_bytes) for r in got.values()] == [(129.0, 1320), (124.0, 1320), (124.0, 1330),
                                                                 (119.0, 1330)]
