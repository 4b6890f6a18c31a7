"""The simulator against hand-computed timelines.

Every expected number below is worked out by hand in the test's docstring
from the FSDP2 rules the simulator cites; none is copied from its output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.simulation.parameters import simulate, simulator_for
from planner.simulation.simulator import SimParams, Simulator
from search_spaces import uniform


def _slices(result, track):
    return {e.name: (e.start_ms, e.end_ms) for e in result.events if e.track == track}


def test_no_overlap_cpu_default(make_profile):
    """CPU, FSDP2 default (sync unshard): nothing overlaps.

    fwd: AG b0 0-5, F b0 5-15, AG b1 15-20, F b1 20-30.
    bwd: root prefetches b1 (sync) 30-35, b1 prefetches b0 (sync) 35-40,
    B b1 40-60, RS b1 60-63, B b0 63-83, RS b0 83-86. Step 86 = 60 + 20 + 6.
    """
    p = make_profile()
    r = simulate(p, Plan.default(p), trace=True)
    assert r.step_ms == pytest.approx(86.0)
    assert r.exposed_comm_ms == pytest.approx(26.0)
    ag = _slices(r, "all-gather")
    assert ag["all-gather b1"] == pytest.approx((30.0, 35.0))  # the backward one (last wins)
    assert _slices(r, "compute")["backward b1"] == pytest.approx((40.0, 60.0))
    assert _slices(r, "reduce-scatter")["reduce-scatter b0"] == pytest.approx((83.0, 86.0))


def test_the_work_outside_the_modules_ends_the_step_and_scales_with_the_compute(make_profile):
    """[Note: Work outside the modules]: 7 ms of loss, zero_grad and loop, serial after the optimizer (4 ms).
    Default: 86 (as above) + 4 + 7 = 97, of which exposed communication still 26; its slice 90-97.
    compute_scale 2: AG b0 0-5, F b0 5-25, AG b1 25-30, F b1 30-50, AG b1 50-55, AG b0 55-60, B b1 60-100,
    RS b1 100-103, B b0 103-143, RS b0 143-146, optimizer 146-154, outside 154-168.
    Async depth 1 (76 ms, test_cpu_explicit_prefetch_needs_async): 76 + 4 + 7 = 87."""
    from planner.simulation.simulator import OUTSIDE_EVENT

    p = dataclasses.replace(make_profile(optimizer_ms=4.0), outside_ms=7.0)
    r = simulate(p, Plan.default(p), trace=True)
    assert r.step_ms == pytest.approx(97.0) and r.exposed_comm_ms == pytest.approx(26.0)
    last = r.events[-1]
    assert last.name == OUTSIDE_EVENT and (last.start_ms, last.end_ms) == pytest.approx((90.0, 97.0))
    assert r.compute_ms == pytest.approx(71.0) and r.lower_bound_ms == pytest.approx(71.0)
    slow = Simulator(p, SimParams(compute_scale=2.0)).run(Plan.default(p))
    assert slow.step_ms == pytest.approx(168.0)
    async_1 = uniform.build(p, forward_depth=1, backward_depth=1).with_knobs(unshard_async_op=True)
    assert simulate(p, async_1).step_ms == pytest.approx(87.0)


def test_cpu_async_default_overlaps_only_backward(make_profile):
    """CPU, default lists, async unshard: implicit forward prefetch needs CPU
    run-ahead, which a CPU device has not, so forward is unchanged (30 ms);
    backward: AG b1 30-35, B b1 35-55 beside AG b0 35-40, RS b1 55-58,
    B b0 58-78, RS b0 78-81."""
    p = make_profile()
    plan = Plan.default(p).with_knobs(unshard_async_op=True)
    r = simulate(p, plan, trace=True)
    assert _slices(r, "compute")["forward b1"] == pytest.approx((20.0, 30.0))
    assert r.step_ms == pytest.approx(81.0)


def test_cpu_explicit_prefetch_needs_async(make_profile):
    """CPU, forward depth 1. Sync: the prefetch blocks the thread, 86 ms as the
    default. Async: AG b0 0-5, AG b1 5-10 beside F b0 5-15, F b1 15-25;
    AG b1 25-30, B b1 30-50 beside AG b0 30-35, RS b1 50-53, B b0 53-73,
    RS b0 73-76."""
    p = make_profile()
    sync = uniform.build(p, forward_depth=1, backward_depth=1)
    asyn = uniform.build(p, forward_depth=1, backward_depth=1).with_knobs(unshard_async_op=True)
    assert simulate(p, sync).step_ms == pytest.approx(86.0)
    assert simulate(p, asyn).step_ms == pytest.approx(76.0)


def test_gpu_default_implicit_prefetch(make_profile):
    """GPU: CPU run-ahead lets the next all-gather run beside compute.

    AG b0 0-5, F b0 5-15; AG b1 issued at CPU time 0 runs 5-10 on the
    all-gather stream, F b1 15-25: forward ends at 25, not 30 as on CPU."""
    p = make_profile(device="cuda")
    r = simulate(p, Plan.default(p), trace=True)
    assert _slices(r, "compute")["forward b1"] == pytest.approx((15.0, 25.0))


def _starts(result):
    """Each event's first start (forward before backward)."""
    starts = {}
    for e in result.events:
        starts.setdefault(e.name, e.start_ms)
    return starts


def test_post_optim_event_lets_the_first_all_gather_overlap_the_loops_stream_work(make_profile):
    """GPU, 4 ms of the loop's stream work after the optimizer step ([Note: Post-optimizer event]): with FSDP2's
    default the root's pre-forward waits the all-gather streams on the compute stream, so AG b0 runs 4-9 and the
    forward ends 4 ms later; with the event it waits for the optimizer's end only: AG b0 0-5, F b0 5-15 as with
    no such work, and the step is 4 ms shorter (AG b0, 5 ms, covers all 4)."""
    p = dataclasses.replace(make_profile(device="cuda"), post_optimizer_ms=4.0)
    default = simulate(p, Plan.default(p), trace=True)
    event = simulate(p, Plan.default(p).with_knobs(post_optim_event=True), trace=True)
    assert _starts(default)["all-gather b0"] == pytest.approx(4.0)
    assert _starts(event)["all-gather b0"] == pytest.approx(0.0)
    assert _slices(event, "compute")["forward b0"] == pytest.approx((5.0, 15.0))
    assert default.step_ms - event.step_ms == pytest.approx(4.0)
    assert default.peak_bytes == event.peak_bytes
    assert default.compute_ms == pytest.approx(simulate(make_profile(device="cuda"), Plan.default(p)).compute_ms + 4)


def test_post_optim_event_changes_nothing_without_stream_work_or_streams(make_profile):
    """No stream work after the optimizer, or a CPU device (no streams, no events): the knob moves nothing."""
    gpu = make_profile(device="cuda")
    cpu = dataclasses.replace(make_profile(), post_optimizer_ms=4.0)
    for p in (gpu, cpu):
        a = simulate(p, Plan.default(p))
        b = simulate(p, Plan.default(p).with_knobs(post_optim_event=True))
        assert (a.step_ms, a.peak_bytes) == (b.step_ms, b.peak_bytes)
    assert simulate(cpu, Plan.default(cpu)).step_ms == simulate(make_profile(), Plan.default(cpu)).step_ms


def test_gpu_two_all_gather_outputs_limit(make_profile):
    """GPU implicit prefetch keeps at most two all-gather outputs: AG b2 waits
    for b0's copy-out (F b0 start). With AG 1 ms and F 10 ms:
    AG b0 0-1, F b0 1-11; AG b1 1-2; AG b2 waits on b0's copy-out event (1)
    and runs 2-3; AG b3 waits on b1's copy-out (F b1 starts at 11) and runs
    11-12. Forward is compute-bound: F b3 ends at 41."""
    p = make_profile(n_blocks=4, fwd=10.0, ag=1.0, device="cuda")
    r = simulate(p, Plan.default(p), trace=True)
    ag = {}
    for e in r.events:
        if e.track == "all-gather":
            ag.setdefault(e.name, (e.start_ms, e.end_ms))  # forward (first) occurrence
    f = _slices(r, "compute")
    assert f["forward b3"][1] == pytest.approx(41.0)
    assert ag["all-gather b3"][0] >= f["forward b1"][0]
    assert ag["all-gather b3"][0] == pytest.approx(11.0)


def test_forward_depth_2_hides_large_all_gather(make_profile):
    """CPU, async. b0 computes 30 ms; b2's all-gather takes 25 ms.

    Depth 1: AG b2 is issued in b1's pre-forward (32), runs 32-57, F b2 57-58.
    Depth 2: it is issued in b0's pre-forward (4), runs 4-29 beside F b0 2-32:
    F b1 32-33, F b2 33-34."""
    p = make_profile(n_blocks=3, fwd=[30.0, 1.0, 1.0], ag=[2.0, 2.0, 25.0])
    d1 = simulate(p, uniform.build(p, 1, 1).with_knobs(unshard_async_op=True), trace=True)
    d2 = simulate(p, uniform.build(p, 2, 1).with_knobs(unshard_async_op=True), trace=True)
    assert _slices(d1, "compute")["forward b2"] == pytest.approx((57.0, 58.0))
    assert _slices(d2, "compute")["forward b2"] == pytest.approx((33.0, 34.0))
    assert d2.step_ms < d1.step_ms


def test_reduce_scatter_runs_beside_the_all_gather_in_flight(make_profile):
    """CPU, async, B 2 ms, AG 10 ms: forward AG b0 0-10, F 10-20, AG b1 20-30,
    F 30-40; AG b1 40-50, B b1 50-52 while AG b0 runs 50-60. RS b1 is issued
    at 52; gloo's second worker thread runs it at once, 52-55 ([Note: Gloo's
    two worker threads]). B b0 waits for AG b0: 60-62, RS b0 62-65.
    With the cores shared (overlap_slowdown 1.5), every overlap costs half of
    itself on both sides: B b1 overlaps AG b0 for 2 ms, 50-53, AG b0 to 61;
    RS b1 53-56 overlaps it for 3 ms, 53-57.5, AG b0 to 62.5; B b0 62.5-64.5,
    RS b0 64.5-67.5. (Queued behind AG b0, as modelled before, RS b1 would
    have run 60-63 and the step ended at 68.)"""
    p = make_profile(fwd=10.0, bwd=2.0, ag=10.0, rs=3.0)
    plan = Plan.default(p).with_knobs(unshard_async_op=True)
    r = simulate(p, plan, SimParams(), trace=True)
    assert _slices(r, "reduce-scatter")["reduce-scatter b1"] == pytest.approx((52.0, 55.0))
    assert _slices(r, "compute")["backward b0"] == pytest.approx((60.0, 62.0))
    assert r.step_ms == pytest.approx(65.0)
    shared = simulate(p, plan, SimParams(overlap_slowdown=1.5), trace=True)
    assert _slices(shared, "compute")["backward b1"] == pytest.approx((50.0, 53.0))
    assert _slices(shared, "reduce-scatter")["reduce-scatter b1"] == pytest.approx((53.0, 57.5))
    assert _slices(shared, "all-gather")["all-gather b0"][1] == pytest.approx(62.5)
    assert _slices(shared, "compute")["backward b0"] == pytest.approx((62.5, 64.5))
    assert shared.step_ms == pytest.approx(67.5)


def test_reduce_scatter_waits_when_both_gloo_workers_are_busy(make_profile):
    """CPU, async, backward prefetch 2 (b2's pre-backward issues b1's and b0's all-gathers, 10 ms each, one after
    another: the model's simplification), B 2 ms: AG b2 in backward 60-70, then AG b1 70-80 and AG b0 80-90 are
    in flight; B b2 70-72; RS b2, issued at 72, finds two all-gathers running on the group and starts when the
    first (b1's) ends: 80-83. With its own group (``set_separate_reduce_scatter_group``) it starts at 72."""
    p = make_profile(n_blocks=3, fwd=10.0, bwd=2.0, ag=10.0, rs=3.0)
    plan = uniform.build(p, 0, 2).with_knobs(unshard_async_op=True)
    r = simulate(p, plan, SimParams(), trace=True)
    ag = _slices(r, "all-gather")
    assert ag["all-gather b1"][1] == pytest.approx(ag["all-gather b0"][0])  # queued one after another
    start = _slices(r, "compute")["backward b2"][1]
    assert _slices(r, "reduce-scatter")["reduce-scatter b2"] == pytest.approx((ag["all-gather b1"][1],
                                                                              ag["all-gather b1"][1] + 3.0))
    assert ag["all-gather b1"][1] > start
    apart = simulate(p, plan.with_knobs(separate_reduce_scatter_group=True), SimParams(), trace=True)
    assert _slices(apart, "reduce-scatter")["reduce-scatter b2"] == pytest.approx((start, start + 3.0))


def test_peak_memory_depth_2_vs_depth_1(make_profile):
    """Unsharded bytes U per block, nothing else, CPU, async: depth 1 keeps 2
    blocks' all-gather outputs at once (computing + prefetched), depth 2
    keeps 3. The total adds gloo's buffer of each all-gather in flight
    ([Note: Gloo's all-gather buffer]): at b0's forward, b0 (U) + b1 in
    flight (2U) = 3U; at depth 2, b0's copy-out is over, b1 (2U) and b2 (2U)
    are in flight: 5U."""
    u = 1000
    p = make_profile(n_blocks=4, unsharded_bytes=u)
    d1 = simulate(p, uniform.build(p, 1, 1).with_knobs(unshard_async_op=True))
    d2 = simulate(p, uniform.build(p, 2, 1).with_knobs(unshard_async_op=True))
    assert (d1.peak_unsharded_bytes, d2.peak_unsharded_bytes) == (2 * u, 3 * u)
    assert (d1.peak_bytes, d2.peak_bytes) == (3 * u, 5 * u)


def test_copy_out_and_sync_all_gather_transients(make_profile):
    """CPU, sync (FSDP2's default), one block, U unsharded: the all-gather
    holds its output and gloo's buffer (2U) until it returns; the copy-out
    holds the output and the unsharded parameters (2U) until the output is
    freed. Nothing else is alive, so the peak is 2U, not U."""
    u = 1000
    p = make_profile(n_blocks=1, unsharded_bytes=u)
    r = simulate(p, Plan.default(p), trace=True)
    assert r.peak_bytes == 2 * u
    # (the root has no parameters) output, gloo buffer, returned, copy-out, copied
    assert [b for _, b in r.memory if b > 0][:5] == [u, 2 * u, u, 2 * u, u]


def test_reshard_after_forward_false_skips_backward_all_gather(make_profile):
    """A block that keeps its parameters needs no backward all-gather: the
    no-overlap step loses that block's 5 ms, and holds its bytes longer."""
    p = make_profile(unsharded_bytes=1000)
    default = Plan.default(p)
    keep = dataclasses.replace(
        default,
        modules={**default.modules, "b1": dataclasses.replace(default.modules["b1"], reshard_after_forward=False)},
    )
    r = simulate(p, keep)
    assert r.step_ms == pytest.approx(81.0)
    assert r.comm_ms == pytest.approx(simulate(p, default).comm_ms - 5.0)


def test_activation_and_gradient_memory(make_profile):
    """Activations A per block stay alive from forward to that block's
    backward: the peak holds both blocks' (2A), b1 computing (U) and b0
    prefetched (U), with gloo's buffer of b0's sync all-gather (U) for a moment."""
    p = make_profile(unsharded_bytes=10, activation_bytes=1000)
    r = simulate(p, Plan.default(p))
    assert r.peak_bytes == 2 * 1000 + 3 * 10


def test_lower_bound(make_profile):
    """max(Σ compute, Σ (AG + RS)): compute 60 vs comm 16 → 60; ratio 86/60."""
    p = make_profile()
    assert Simulator(p, SimParams()).lower_bound_ms == pytest.approx(60.0)
    r = simulate(p, Plan.default(p))
    assert r.ratio_to_lower_bound == pytest.approx(86.0 / 60.0)
    comm_bound = make_profile(fwd=1.0, bwd=1.0, ag=50.0)
    assert Simulator(comm_bound, SimParams()).lower_bound_ms == pytest.approx(2 * 53.0)


def test_overlap_slowdown_shares_the_cores_between_compute_and_collectives(make_profile):
    """CPU, forward depth 2, async, F 10 ms, AG 20 ms, slowdown 2: during an
    overlap both compute and the collectives in flight run at half speed.

    AG b0 0-20; b0 prefetches b1 (20-40) and b2 (40-60); F b0 starts at 20
    with 40 ms of communication in flight: its 10 ms overlap cost 10 ms more
    on both sides, F b0 20-40, AG b1 ends 50, AG b2 50-70. F b1 50-60 beside
    AG b2 (in flight until 70): +10 on both, F b1 50-70, AG b2 ends 80.
    F b2 80-90. Compute-only slowdown would give F b1 40-50 (the all-gathers
    would not wait for the cores)."""
    p = make_profile(n_blocks=3, fwd=10.0, ag=20.0)
    r = simulate(p, uniform.build(p, 2, 1).with_knobs(unshard_async_op=True), SimParams(overlap_slowdown=2.0),
                 trace=True)
    compute = _slices(r, "compute")
    assert [compute[f"forward b{i}"] for i in range(3)] == [
        pytest.approx((20.0, 40.0)), pytest.approx((50.0, 70.0)), pytest.approx((80.0, 90.0))]
    forward_ag = {}
    for e in r.events:
        if e.track == "all-gather":
            forward_ag.setdefault(e.name, (e.start_ms, e.end_ms))  # first occurrence: forward
    assert forward_ag["all-gather b1"] == pytest.approx((20.0, 50.0))
    assert forward_ag["all-gather b2"] == pytest.approx((50.0, 80.0))
    no_overlap = simulate(p, Plan.default(p), SimParams(overlap_slowdown=2.0)).step_ms
    assert no_overlap == pytest.approx(simulate(p, Plan.default(p)).step_ms)  # nothing overlaps, nothing slows


def test_issue_overhead_adds_per_hook(make_profile):
    """Default plan, CPU: 2 blocks x 4 hooks + root's 4 = 12 hooks."""
    p = make_profile()
    r = simulate(p, Plan.default(p), SimParams(issue_overhead_ms=1.0))
    assert r.step_ms == pytest.approx(86.0 + 12.0)


def test_gradient_accumulation_reduces_only_on_last_microbatch(make_profile):
    """2 microbatches, CPU default. mb0: AG b0 0-5, F 5-15, AG b1 15-20,
    F 20-30; AG b1 30-35, AG b0 35-40, B b1 40-60, B b0 60-80, no
    reduce-scatter (set_requires_gradient_sync(False)). mb1 repeats 80-160
    with RS b1 140-143 and RS b0 163-166. Step 166."""
    p = dataclasses.replace(make_profile(), microbatches=2)
    r = simulate(p, Plan.default(p), trace=True)
    assert r.step_ms == pytest.approx(166.0)
    rs = [e for e in r.events if e.track == "reduce-scatter" and e.name != "reduce-scatter <root>"]
    assert [(e.start_ms, e.end_ms) for e in rs] == [(140.0, 143.0), (163.0, 166.0)]


def test_reshard_after_backward_false_keeps_parameters_between_microbatches(make_profile):
    """set_reshard_after_backward(False) for microbatches but the last: mb1's
    forward needs no all-gather (both blocks still unsharded): F b0 80-90,
    F b1 90-100; backward as before from 100: AG b1 100-105, AG b0 105-110,
    B b1 110-130, RS 130-133, B b0 133-153, RS 153-156."""
    p = dataclasses.replace(make_profile(), microbatches=2)
    plan = Plan.default(p).with_knobs(reshard_after_backward=False)
    r = simulate(p, plan, trace=True)
    assert r.step_ms == pytest.approx(156.0)
    assert r.comm_ms == pytest.approx(simulate(p, Plan.default(p)).comm_ms - 10.0)


def test_accumulated_gradients_stay_alive_across_microbatches(make_profile):
    """Gradient bytes G per block: one microbatch never holds more than one
    block's gradient and its reduce-scatter input copy (2G); with two, mb0
    leaves both blocks' unsharded gradients alive, so b1's copy-in in mb1
    makes 3G."""
    g = 100
    one = make_profile(unsharded_bytes=0, grad_bytes=g)
    two = dataclasses.replace(one, microbatches=2)
    assert simulate(one, Plan.default(one)).peak_bytes == 2 * g
    assert simulate(two, Plan.default(two)).peak_bytes == 3 * g


def test_sharded_gradients_live_until_the_optimizer(make_profile):
    """Sharded bytes S per block: each reduce-scatter leaves a sharded
    gradient (S) alive through the optimizer step, whose temporaries T come
    on top: baseline 3S (the shards) + 2S (gradients) + T at the optimizer."""
    s, t = 50, 70
    p = make_profile(unsharded_bytes=0)
    p = dataclasses.replace(
        p,
        optimizer_temp_bytes=t,
        optimizer_ms=1.0,
        modules={f: dataclasses.replace(m, sharded_bytes=s if f else 0) for f, m in p.modules.items()},
    )
    r = simulate(p, Plan.default(p), trace=True)
    assert r.peak_bytes == 2 * s + 2 * s + t
    assert r.memory[-1][1] == 2 * s + 2 * s  # the optimizer's temporaries freed, the gradients kept


def _gpu_rs_profile(make_profile):
    p = make_profile(fwd=1.0, bwd=2.0, ag=1.0, rs=10.0, device="cuda", unsharded_bytes=0, grad_bytes=100)
    root = dataclasses.replace(p.modules[""], bwd_ms=10.0, bwd_pre_ms=0.0, grad_bytes=100)
    return dataclasses.replace(p, modules={**p.modules, "": root})


def test_gpu_reduce_scatter_input_buffer_cap(make_profile):
    """GPU, RS 10 ms behind B 2 ms. B b1 3-5, RS b1 5-15, B b0 5-7. With one
    input buffer (FSDP2's default) b0's post-backward makes the compute
    stream wait for RS b1: the root's 10 ms backward runs 15-25. With two
    (set_reduce_scatter_max_input_buffers(2)) it runs 7-17, holding one more
    gradient buffer; the step is RS-bound (25 ms) either way."""
    p = _gpu_rs_profile(make_profile)
    one = simulate(p, Plan.default(p), trace=True)
    two = simulate(p, Plan.default(p).with_knobs(reduce_scatter_max_input_buffers=2), trace=True)
    assert _slices(one, "compute")["backward <root>"] == pytest.approx((15.0, 25.0))
    assert _slices(two, "compute")["backward <root>"] == pytest.approx((7.0, 17.0))
    assert one.step_ms == pytest.approx(25.0) and two.step_ms == pytest.approx(25.0)
    # b0's copy-in: root gradient (allocated first, for the LM head) + b0's gradient + its input buffer, with
    # b1's buffer freed first (one) or still held (two)
    assert (one.peak_bytes, two.peak_bytes) == (300, 400)


def test_root_keeps_parameters_after_forward(make_profile):
    """The root is all-gathered once per step (FSDPState._lazy_init sets
    reshard_after_forward False for it); forcing True adds a backward one."""
    p = make_profile()
    root = dataclasses.replace(p.modules[""], all_gather_ms=7.0)
    p = dataclasses.replace(p, modules={**p.modules, "": root})
    default = simulate(p, Plan.default(p), trace=True)
    assert sum(e.name == "all-gather <root>" for e in default.events) == 1
    plan = Plan.default(p)
    forced = dataclasses.replace(
        plan, modules={**plan.modules, "": dataclasses.replace(plan.modules[""], reshard_after_forward=True)}
    )
    assert sum(e.name == "all-gather <root>" for e in simulate(p, forced, trace=True).events) == 2


def test_record_stream_holds_async_all_gather_outputs_on_gpu(make_profile):
    """GPU, async unshard, explicit forward prefetch 1; 2 blocks of U bytes, F 10, B 20, AG 5, RS 3; no issue
    overhead, so the CPU runs ahead of the GPU at time 0 throughout ([Note: record_stream holds all-gather outputs];
    seed fsdp2-async-unshard-memory-overallocation).

    Forward: AG b0 0-5 (issued by the root). b0's copy-out: params +U, output freed but held until the process
    group's queued work ends (5 > CPU 0): allocated U, held U. b0 prefetches b1: AG 5-10, allocated 2U, held U:
    reserved 3U. F b0 5-15, reshard. b1's copy-out: held 2U (until 10). F b1 15-25.
    Backward: the root prefetches b1: AG 10-15 (U). b1's copy-out: held 3U (until 15); b1 prefetches b0:
    AG 15-20, allocated 2U + held 3U = 5U. B b1 25-45, reshard, RS b1 45-48; b0's copy-out: allocated 2U then U,
    held 4U (until 48): 5U again. B b0 45-65, RS b0 65-68. The CPU never reaches 5, so nothing is released in the step.
    Allocated peak 2U (max_memory_allocated), reserved peak 5U; step 68 ms either way. Synchronous unshard
    (no record_stream) holds nothing; nor does a CPU that issues behind the GPU (100 ms per hook): every held
    block's collectives have ended by the next allocation.
    """
    u = 1000
    p = make_profile(n_blocks=2, device="cuda", unsharded_bytes=u)
    asyn = simulate(p, uniform.build(p, 1, 1).with_knobs(unshard_async_op=True), trace=True)
    assert (asyn.step_ms, asyn.peak_bytes, asyn.reserved_peak_bytes) == (pytest.approx(68.0), 2 * u, 5 * u)
    assert _slices(asyn, "reduce-scatter")["reduce-scatter b0"] == pytest.approx((65.0, 68.0))
    sync = simulate(p, uniform.build(p, 1, 1))
    assert (sync.peak_bytes, sync.reserved_peak_bytes) == (2 * u, 2 * u)
    behind = simulate(p, uniform.build(p, 1, 1).with_knobs(unshard_async_op=True), SimParams(issue_overhead_ms=100.0))
    assert behind.reserved_peak_bytes == behind.peak_bytes == 2 * u
    cpu = make_profile(n_blocks=2, unsharded_bytes=u)  # gloo: no record_stream
    r = simulate(cpu, uniform.build(cpu, 1, 1).with_knobs(unshard_async_op=True))
    assert r.reserved_peak_bytes == r.peak_bytes


def test_separate_reduce_scatter_group_does_not_queue_behind_all_gathers(make_profile):
    """As test_reduce_scatter_serialized_behind_all_gather, with ``set_separate_reduce_scatter_group``: RS b1,
    issued at 52 while AG b0 runs 50-60 on the all-gather's group, runs at once, 52-55 (synchronous on CPU);
    b0's pre-backward waits for its all-gather until 60, B b0 60-62, RS b0 62-65: 65 ms instead of 68."""
    p = make_profile(fwd=10.0, bwd=2.0, ag=10.0, rs=3.0)
    plan = Plan.default(p).with_knobs(unshard_async_op=True, separate_reduce_scatter_group=True)
    r = simulate(p, plan, trace=True)
    assert _slices(r, "reduce-scatter")["reduce-scatter b1"] == pytest.approx((52.0, 55.0))
    assert _slices(r, "reduce-scatter")["reduce-scatter b0"] == pytest.approx((62.0, 65.0))
    assert r.step_ms == pytest.approx(65.0)


def test_unshard_in_backward_false_skips_the_backward_all_gather(make_profile):
    """test_no_overlap_cpu_default with b0 ``set_unshard_in_backward(False)``: b1's pre-backward no longer
    prefetches b0 (FSDPParamGroup.unshard returns early in pre-backward). Backward: root prefetches b1 30-35,
    B b1 35-55, RS b1 55-58, b0 not all-gathered, B b0 58-78, RS b0 78-81: 81 ms, one all-gather (5 ms) less."""
    p = make_profile()
    base = Plan.default(p)
    plan = dataclasses.replace(base, modules={**base.modules,
                                              "b0": base.modules["b0"].with_knobs(unshard_in_backward=False)})
    r = simulate(p, plan, trace=True)
    assert r.step_ms == pytest.approx(81.0)
    assert [e.start_ms for e in r.events if e.name == "all-gather b0"] == pytest.approx([0.0])  # forward only
    assert _slices(r, "compute")["backward b0"] == pytest.approx((58.0, 78.0))


def test_a_changed_kernel_source_drops_numbas_cached_code(tmp_path):
    from planner.simulation._kernel import drop_stale_numba_cache

    (tmp_path / "hooks.py").write_text("x = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    (cache / "hooks.step-1.py311.nbi").write_text("old")
    drop_stale_numba_cache(tmp_path)  # no digest yet: whatever is cached may be stale
    assert not (cache / "hooks.step-1.py311.nbi").exists()
    (cache / "hooks.step-1.py311.nbi").write_text("compiled from x = 1")
    drop_stale_numba_cache(tmp_path)  # sources unchanged: the cache stays
    assert (cache / "hooks.step-1.py311.nbi").exists()
    (tmp_path / "hooks.py").write_text("x = 2\n")
    drop_stale_numba_cache(tmp_path)
    assert not (cache / "hooks.step-1.py311.nbi").exists()


def test_reduce_scatter_input_buffer_outlives_a_synchronous_reduce_scatter_on_cpu(make_profile):
    """CPU, FSDP2's default, 3 blocks of U = 1000 unsharded and G = 300 gradient bytes. FSDP2 keeps the last
    reduce-scatter's input buffer in ``comm_ctx.reduce_scatter_states`` until the next post-backward, on CPU too.

    b2's post-backward: reshard (U of b2 freed), RS copy-in: b2's buffer G stays alive. b1's pre-backward: copy-out
    of b1 (U), then the sync prefetch of b0 holds its output and gloo's buffer (2U): U + 2U + G = 3300 bytes, the
    peak (without the kept buffer it would be 3U = 3000). At the end of the step every buffer is freed.
    """
    p = make_profile(n_blocks=3, unsharded_bytes=1000, grad_bytes=300)
    r = simulate(p, Plan.default(p), trace=True)
    assert r.peak_bytes == 3300
    assert r.memory[-1][1] == 0


RELEASE_0_1_0 = Path(__file__).parents[2] / "data" / "release-0.1.0"


@pytest.mark.parametrize("source", ["synthetic, 16 blocks", "recorded Llama"])
def test_a_traced_run_keeps_every_row_however_many_the_plan_makes(make_profile, source):
    """[Note: Trace capacity]: the recorded Llama profile (gloo buffers, copy-outs, reduce-scatter buffers) makes
    more memory samples than the first estimate holds; the kernel once wrote past its arrays (malloc abort)."""
    if source == "recorded Llama":
        p = Profile.load(RELEASE_0_1_0 / "llama-cpu.profile.json")
    else:
        p = make_profile(n_blocks=16, grad_bytes=100, activation_bytes=10)
    sim = simulator_for(p)
    for plan in (Plan.default(p), uniform.build(p, 3, 3).with_knobs(unshard_async_op=True)):
        traced, untraced = sim.run(plan, trace=True), sim.run(plan)
        first_estimate = 8 * (len(p.post_forward_order) + len(p.modules)) * p.microbatches + 16
        assert len(traced.memory) > first_estimate  # the case the estimate did not hold
        assert (traced.step_ms, traced.peak_bytes) == (untraced.step_ms, untraced.peak_bytes)
        assert max(b for _, b in traced.memory) == traced.peak_bytes  # the peak's sample is there
        assert max(e.end_ms for e in traced.events) == pytest.approx(traced.step_ms)  # so is the last slice


def test_a_plan_compiled_for_one_simulator_is_refused_by_another(make_profile):
    p = make_profile(n_blocks=2)
    a, b = simulator_for(p), simulator_for(p)
    compiled = a.compile(Plan.default(p))
    assert a.run(compiled).step_ms == b.run(Plan.default(p)).step_ms
    with pytest.raises(ValueError, match="compiled by another Simulator"):
        b.run(compiled)


def test_simulating_attaches_nothing_to_the_profile_or_the_plan(make_profile):
    p = make_profile(n_blocks=2)
    plan = uniform.build(p, 1, 1).with_knobs(unshard_async_op=True)
    before = (dict(vars(p)), dict(vars(plan)))
    simulate(p, plan)
    simulator_for(p).run(plan, trace=True)
    assert (vars(p), vars(plan)) == before


def test_world_size_1_copies_at_wait_and_a_prefetch_holds_nothing(make_profile):
    """[Note: World size 1]: FSDP2 runs no collective there. GPU, default plan: b0's wait copies its parameters on
    the compute stream 0-5, F b0 5-15; b1's copy 15-20, F b1 20-30 (at world size 2 the all-gather of b1 runs
    beside F b0 and F b1 is 15-25). Memory, U unsharded bytes per block and nothing else, async prefetch at depth
    1 and 2: a block's bytes are allocated at its own wait and freed at its reshard, so at most one block is
    alive: U at both depths (at world size 2, 3U and 5U with gloo's buffers)."""
    u = 1000
    one = make_profile(device="cuda", unsharded_bytes=u)
    one = dataclasses.replace(one, fingerprint=dataclasses.replace(one.fingerprint, world_size=1))
    r = simulate(one, Plan.default(one), trace=True)
    assert _slices(r, "compute")["forward b0"] == pytest.approx((5.0, 15.0))
    assert _slices(r, "compute")["forward b1"] == pytest.approx((20.0, 30.0))
    four = make_profile(n_blocks=4, unsharded_bytes=u, device="cuda")
    four = dataclasses.replace(four, fingerprint=dataclasses.replace(four.fingerprint, world_size=1))
    plans = [uniform.build(four, d, 1).with_knobs(unshard_async_op=True) for d in (1, 2)]
    assert [simulate(four, plan).peak_bytes for plan in plans] == [u, u]
