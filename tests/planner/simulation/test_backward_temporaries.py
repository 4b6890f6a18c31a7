"""A backward's temporaries in the simulator, against hand-computed memory timelines.

The rule (``planner.simulation._kernel.hooks``): ``ModuleProfile.backward_temp_bytes`` is allocated when the
module's backward compute starts (for the root, its part before its children's: the loss's and the LM head's)
and freed when it ends, on top of what the plan keeps alive there ([Note: Backward temporaries] in
``runtime.recording.compute_timer``).
"""

from __future__ import annotations

import dataclasses

from planner.artifacts.plan import Plan
from planner.simulation.parameters import simulate


def _with_temporaries(profile, **temp):
    modules = {f: dataclasses.replace(m, backward_temp_bytes=temp.get(f or "root", 0))
               for f, m in profile.modules.items()}
    return dataclasses.replace(profile, modules=modules)


def _keep_unsharded(plan, *blocks):
    return dataclasses.replace(plan, modules={
        **plan.modules, **{b: dataclasses.replace(plan.modules[b], reshard_after_forward=False) for b in blocks}})


def test_the_roots_backward_temporaries_set_the_peak_before_the_blocks_backward(make_profile):
    """Two blocks, U = 10 unsharded bytes, activations a = 100 each; the root's backward temporaries T = 5000.

    CPU default plan. The root's pre-backward prefetches b1 synchronously (b1 unsharded, U); the root's compute
    then holds 2a + U + T = 5210, the peak. b1's compute: 2a + 2U = 220 (T freed). Without T the peak is the
    prefetch of b0 in b1's pre-backward, 2a + 3U = 230 with gloo's buffer.
    Keeping b0 unsharded after forward adds U where the root's temporaries are, 5220. Without them the simulator
    priced it at 0: its peak stayed at the root's prefetch of b1 (b0, b1 and gloo's buffer, 2a + 3U = 230). That was
    the GPU runs' one-block shortfall.
    """
    base = make_profile(unsharded_bytes=10, activation_bytes=100)
    p = _with_temporaries(base, root=5000)
    default = Plan.default(p)
    plain, with_temp = simulate(base, Plan.default(base), trace=True), simulate(p, default, trace=True)
    assert (plain.peak_bytes, with_temp.peak_bytes) == (230, 5210)
    assert simulate(p, _keep_unsharded(default, "b0")).peak_bytes == 5220
    # without them the kept block costs nothing: the peak stays at the root's prefetch of b1, 2a + 3U = 230
    assert simulate(base, _keep_unsharded(Plan.default(base), "b0")).peak_bytes == 230
    assert with_temp.step_ms == plain.step_ms  # memory only
    assert with_temp.memory[-1][1] == plain.memory[-1][1]  # all of it freed


def test_a_blocks_backward_temporaries_come_on_top_of_what_its_compute_holds(make_profile):
    """Two blocks (U = 10, a = 100), each with backward temporaries t = 1000: b1's compute holds both blocks
    unsharded (b0 prefetched) and both activations, 2a + 2U + t = 1220; b0's compute a + U + t = 1110. Peak 1220."""
    p = _with_temporaries(make_profile(unsharded_bytes=10, activation_bytes=100), b0=1000, b1=1000)
    assert simulate(p, Plan.default(p)).peak_bytes == 1220


def test_a_roots_gradient_that_comes_after_its_blocks_is_not_held_through_their_backward(make_profile):
    """The root's gradient G = 1000 bytes, of which the embedding's E = 600 come only after its blocks' backward
    (``backward_post_grad_bytes``); blocks U = 10, activations a = 1000; CPU default plan.

    All of G allocated at the root's pre-backward (E = 0): b1's pre-backward with b0's synchronous prefetch holds
    G + 2a + 3U = 3030, the peak. With E = 600 only G - E = 400 is there: 2430. The root's reduce-scatter at the
    end copies its whole gradient either way: 2G = 2000.
    """
    base = make_profile(unsharded_bytes=10, activation_bytes=1000)
    root = dataclasses.replace(base.modules[""], grad_bytes=1000)
    whole = dataclasses.replace(base, modules={**base.modules, "": root})
    split = dataclasses.replace(whole, modules={
        **whole.modules, "": dataclasses.replace(root, backward_post_grad_bytes=600)})
    assert simulate(whole, Plan.default(whole)).peak_bytes == 3030
    traced = simulate(split, Plan.default(split), trace=True)
    assert traced.peak_bytes == 2430
    assert max(b for t, b in traced.memory if t >= traced.step_ms - 1e-9) < 2430  # the end: 2G at most


def test_the_roots_saved_tensors_after_its_blocks_are_freed_before_the_blocks_backward(make_profile):
    """The root saves R = 5000 bytes in its forward, of which P = 4900 after its blocks' forward
    (``activation_post_bytes``: the final norm's, the LM head's and the loss's) and R - P = 100 before (the
    embedding's); blocks U = 10, a = 100; b1's backward temporaries t = 1000; CPU default plan.

    Held to the end of the root's backward (P = 0 and the forward's time all before its blocks: the split the
    simulator had), b1's backward holds R + 2a + 2U + t = 6220, the peak. Freed at the end of the root's part
    before its blocks' backward (autograd frees what the loss's and the head's nodes saved as they run), b1's
    backward holds R - P + 2a + 2U + t = 1320, and the peak is the root's forward after its blocks: R + 2a + 2U =
    5220 (b1 not yet resharded: its post-forward reshard comes after the root's).
    """
    base = make_profile(unsharded_bytes=10, activation_bytes=100)
    root = dataclasses.replace(base.modules[""], fwd_ms=2.0, fwd_pre_ms=2.0, bwd_ms=2.0, bwd_pre_ms=1.0,
                               activation_bytes=5000)
    modules = {**base.modules, "b1": dataclasses.replace(base.modules["b1"], backward_temp_bytes=1000)}
    held = dataclasses.replace(base, modules={**modules, "": root})
    split = dataclasses.replace(base, modules={**modules, "": dataclasses.replace(
        root, fwd_pre_ms=1.0, activation_post_bytes=4900)})

    def in_b1_backward(result):
        window = next(e for e in result.events if e.name == "backward b1")
        return max(b for t, b in result.memory if window.start_ms <= t <= window.end_ms)

    whole, freed = simulate(held, Plan.default(held), trace=True), simulate(split, Plan.default(split), trace=True)
    assert (whole.peak_bytes, in_b1_backward(whole)) == (6220, 6220)
    assert (freed.peak_bytes, in_b1_backward(freed)) == (5220, 1320)
    assert freed.memory[-1][1] == 0  # all of it freed, once


def test_without_a_measured_split_the_roots_saved_tensors_split_by_the_forwards_time(make_profile):
    """A trace profile or an older one (``activation_post_bytes`` 0): the root's fwd_pre_ms of fwd_ms, here 1 of 4,
    puts R / 4 before its blocks, held to the end of its backward, and 3R / 4 after them, freed before theirs."""
    from planner.artifacts.profile import root_activation_pre_bytes

    base = make_profile()
    root = dataclasses.replace(base.modules[""], fwd_ms=4.0, fwd_pre_ms=1.0, activation_bytes=4000)
    assert root_activation_pre_bytes(root) == 1000
    assert root_activation_pre_bytes(dataclasses.replace(root, activation_post_bytes=3900)) == 100
    assert root_activation_pre_bytes(dataclasses.replace(root, fwd_ms=0.0, fwd_pre_ms=0.0)) == 0
