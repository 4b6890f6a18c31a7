"""runtime.recording.recorder on a real one-rank FSDP2 model: what its isolated figures hold, and in which order it
times them."""

from __future__ import annotations

import pytest
import torch.distributed

import runtime.recording.collective_timer as collective_timer
import runtime.recording.isolated as isolated
import runtime.recording.recorder as recorder
from runtime.apply import model_fingerprint
from runtime.ranks.device import Device
from runtime.ranks.torch_private import reshard_after_forward
from runtime.recording import step_figures, steps
from runtime.recording.peak_memory import PeakMeter
from runtime.reference_workloads import mlp
from runtime.workload import fsdp_modules, train_step


def test_the_collectives_are_timed_after_the_step_and_before_the_isolated_passes(mesh, monkeypatch):
    """[Note: The collectives are timed before the isolated passes]: every all-gather and reduce-scatter (in rounds)
    and the overlap microbenchmark run before the compute passes, whose freed memory would spare them a step's page
    faults; the figures of both land on every module, and a pass without collectives times none. The collectives
    take ``COLLECTIVE_ROUNDS`` rounds where the study asks for fewer repeats ([Note: Collectives timed in rounds])."""
    workload = mlp(mesh, dim=64, layers=3)
    train_step(workload, 0)
    modules = fsdp_modules(workload.model)
    calls: list[str] = []
    rounds: list[int] = []

    def logged(name, real):
        def run(*args, **kwargs):
            calls.append(name)
            if name == "collective_rounds":
                rounds.append(args[2])
            return real(*args, **kwargs)
        return run

    for name in ("collective_rounds", "overlap_timings"):
        monkeypatch.setattr(collective_timer, name, logged(name, getattr(collective_timer, name)))
    monkeypatch.setattr(isolated, "compute_unsharded", logged("compute_unsharded", isolated.compute_unsharded))
    resharding = {fqn: reshard_after_forward(m) for fqn, m in modules}
    figures = isolated.isolated_measurements(workload, model_fingerprint(workload.model), 1, "cpu", resharding)
    assert calls == ["collective_rounds", "overlap_timings", "compute_unsharded"]
    assert rounds == [collective_timer.COLLECTIVE_ROUNDS]
    assert figures.overlap is not None
    for fqn, _ in modules:
        values = figures.modules[fqn]
        assert values.collectives.all_gather_ms > 0 and values.collectives.reduce_scatter_ms > 0
        assert values.collectives.sharded_bytes > 0 and values.compute is not None

    calls.clear()
    only = isolated.isolated_measurements(workload, model_fingerprint(workload.model), 1, "cpu", resharding,
                                          collectives=False)
    assert calls == ["compute_unsharded"] and only.overlap is None
    assert all(values.collectives is None for values in only.modules.values())


def test_a_slow_stretch_moves_no_module_figure_when_the_collectives_are_timed_in_rounds(mesh, monkeypatch):
    """[Note: Collectives timed in rounds]: a stretch as long as half a round, three times slower, lands on one repeat
    of each module it touches, so every median over 3 rounds keeps the module's own time. Timed module by module (the
    order before), the same stretch would take two of a module's three repeats and move its median."""
    workload = mlp(mesh, dim=64, layers=4)
    train_step(workload, 0)
    modules = fsdp_modules(workload.model)
    numels = dict(zip(model_fingerprint(workload.model).module_fqns, model_fingerprint(workload.model).param_numels,
                      strict=True))
    own_time = {fqn: 10.0 * (k + 1) for k, fqn in enumerate(numels)}
    order: list[str] = []

    def timed(run, group=None):
        run()
        fqn = current[0]
        order.append(fqn)
        slow = len(numels) * 2 + 3 <= len(order) < len(numels) * 3 + 3  # half a round, from mid-round 1 on
        return own_time[fqn] * (3.0 if slow else 1.0)

    current = [""]
    real_unshard = {fqn: m.unshard for fqn, m in modules}
    for fqn, m in modules:
        monkeypatch.setattr(m, "unshard", lambda fqn=fqn, real=real_unshard[fqn]: (current.__setitem__(0, fqn), real()))
    monkeypatch.setattr(collective_timer, "device_of", lambda device: type("Timed", (), {"timed_ms": timed}))
    figures = collective_timer.collective_rounds(modules, numels, 3, "cpu")

    fqns = list(numels)
    assert order[::2][:len(fqns) * 2] == fqns + fqns[1:] + fqns[:1]  # round 1 starts one module later
    for fqn in fqns:
        assert figures[fqn].all_gather_ms == own_time[fqn]
        assert figures[fqn].reduce_scatter_ms == own_time[fqn]

    order.clear()  # module by module: each module's rounds one after another
    by_module = {fqn: collective_timer.collective_rounds(modules, {fqn: numels[fqn]}, 3, "cpu")[fqn] for fqn in fqns}
    assert any(by_module[fqn].reduce_scatter_ms != own_time[fqn] for fqn in fqns)


def test_the_defaults_step_is_timed_after_the_peak_steps_and_the_async_pairs(mesh, monkeypatch):
    """[Note: The default's step is timed last]: a slow stretch after the profiled peak steps and the isolated passes,
    as long as the async pairs, lands on the pairs, whose ratio of neighbours cancels it, and not on the default's
    step ms, the anchor of every prediction. Timed first (an earlier order), the stretch read 3 x; timed
    right after the peak steps (another earlier order), a stretch after them would have."""
    workload = mlp(mesh, dim=64, layers=2)
    train_step(workload, 0)
    events: list[str] = []
    async_on = [False]

    def setter(model):
        return lambda value: async_on.__setitem__(0, value)

    class Scripted(Device):
        """The step runner's and the step figures' device: a timed step's ms as scripted (a slow stretch), and the
        optimizer's 5 ms (its pre-hook's mark, then its post-hook's). A mark holds the script's state when it was
        taken; a span of two marks in a row is the optimizer's, a longer one a step's."""

        n = 0

        def mark(self):
            self.n += 1
            return self.n, list(events), async_on[0]

        def align(self, group=None):
            pass

        def spans_ms(self, spans, wait=True):
            out = []
            for (n0, before, on), (n1, _, _) in spans:
                if n1 - n0 == 1:
                    out.append(5.0)
                    continue
                after_peak = before[before.index("peak") + recorder.PEAK_STEPS:] if "peak" in before else []
                stretch = 2 * recorder.ASYNC_PAIRS  # after the isolated passes, and after the profiled peak steps
                slow = 3.0 if sum(e != "peak" for e in before) < stretch or len(after_peak) < stretch else 1.0
                out.append(100.0 * slow * (0.8 if on else 1.0))
            return out

    side_after = steps.StepSide.after

    def after(side, order, start, peaks):
        if start is not None:
            events.append("async" if async_on[0] else "default")
        return side_after(side, order, start, peaks)

    monkeypatch.setattr(steps.StepSide, "after", after)
    scripted = Scripted()
    begin = PeakMeter.begin
    monkeypatch.setattr(steps, "device_of", lambda _type: scripted)
    monkeypatch.setattr(step_figures, "device_of", lambda _type: scripted)
    monkeypatch.setattr(PeakMeter, "begin", lambda meter: (events.append("peak"), begin(meter))[1])
    monkeypatch.setattr(recorder, "unshard_async_op_setter", setter)
    class TwoRanks:  # the recorder's view only: the model's fingerprint stays that of its one rank
        def __getattr__(self, name):
            return getattr(torch.distributed, name)

        def get_world_size(self, *args, **kwargs):
            return 2

    monkeypatch.setattr(recorder, "dist", TwoRanks())
    one = recorder.Recorder(workload.model, 1, workload)
    more = recorder._default_plan_steps(recorder._peak_steps(workload, one), 5)
    one.remove()
    figures = one.measurements(**more)

    assert figures.step_ms == 100.0 and figures.optimizer_ms == 5.0
    pairs = slice(recorder.PEAK_STEPS, recorder.PEAK_STEPS + 2 * recorder.ASYNC_PAIRS)
    assert events[:pairs.start] == ["peak"] * recorder.PEAK_STEPS
    assert sorted(events[pairs]) == ["async"] * recorder.ASYNC_PAIRS + ["default"] * recorder.ASYNC_PAIRS
    assert events[pairs.stop:] == ["default"] * 5
    assert abs(figures.async_ratio - 0.8) < 1e-12
    assert len(figures.peak_bytes) == recorder.PEAK_STEPS and not async_on[0]


def test_a_users_loop_records_in_record_profiles_order(tmp_path, monkeypatch):
    """The in-loop recording runs warm-up and peak steps, then an isolated pass between two steps with an untimed
    step after each while passes remain, then one untimed step and the timed steps last; the profile's figures are
    in once those ran."""
    from torch import nn

    from planner.testing import study_config
    from runtime.timing import RECORD, RECORD_PEAK, RECORD_WARMUP

    config = study_config(tmp_path, warmup_steps=2, steps=3)
    assert [s.kind for s in recorder.Recorder.loop_steps(config)] == [RECORD_WARMUP] * 2 + [RECORD_PEAK] * 3
    loop = recorder.Recorder(nn.Linear(2, 2), repeats=1)
    figures = object()
    passes = iter([None, figures])  # two passes of a few modules each
    monkeypatch.setattr(loop, "isolate_next", lambda budget, gather: next(passes))
    try:
        kinds = [[s.kind for s in loop.loop_next(config, None)] for _ in range(3)]
    finally:
        loop.remove()
    assert kinds == [[RECORD_WARMUP], [RECORD_WARMUP] + [RECORD] * 3, []]
    assert loop.isolated_figures is figures


def test_a_model_is_profiled_a_few_modules_at_a_time_under_the_device_memory_cap(mesh, monkeypatch):
    """[Note: Profiling within the device's memory]: ``record_profile`` under ``PREFETCH_PLANNER_DEVICE_MEMORY``
    smaller than the model unsharded with its gradients holds a few modules per isolated pass, never the whole model,
    after the default's peak steps (whose peak the rule reads); the figures are those of the whole model at once. A
    cap no single module fits under is one line naming the setting."""
    from planner.artifacts.memory_budget import DEVICE_MEMORY_ENV
    from planner.errors import PlannerError

    workload = mlp(mesh, dim=128, layers=4)
    held: list[tuple[str, ...] | None] = []
    isolated_of = recorder.Recorder.isolated

    def isolated_spy(self, only=None, collectives=True):
        held.append(only)
        return isolated_of(self, only, collectives)

    monkeypatch.setattr(recorder.Recorder, "isolated", isolated_spy)
    whole = recorder.record_profile(workload, warmup_steps=1, steps=1, repeats=1)
    assert held == [None]  # no cap: every module at once
    fp = model_fingerprint(workload.model)
    total, largest = sum(fp.param_bytes), max(fp.param_bytes)
    # the rule's charge for one pass: the default's peak, the sharded gradients, twice the held modules' bytes
    cap = whole.measured_peak_bytes + total + 2 * largest + total // 2
    assert cap < whole.measured_peak_bytes + total + 2 * total  # smaller than the whole model's charge
    monkeypatch.setenv(DEVICE_MEMORY_ENV, f"{cap}B")
    held.clear()
    capped = recorder.record_profile(workload, warmup_steps=1, steps=1, repeats=1)
    assert len(held) > 1 and None not in held
    assert sorted(fqn for group in held for fqn in group) == sorted(fp.module_fqns)
    assert capped.post_forward_order == whole.post_forward_order
    assert all(capped.modules[f].activation_bytes == whole.modules[f].activation_bytes for f in fp.module_fqns)
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "1KiB")
    refused = rf"over the device memory the tightest rank can reach .*{DEVICE_MEMORY_ENV}"
    with pytest.raises(PlannerError, match=refused):
        recorder.record_profile(workload, warmup_steps=1, steps=1, repeats=1)


def test_the_isolated_passes_give_the_cache_back_after_the_last(mesh, monkeypatch):
    """The process is left as found: after the last isolated pass, and not before it, the device's cache is given
    back (``torch.cuda.empty_cache`` on CUDA), so blocks sized for modules held unsharded together are not kept."""
    from runtime.ranks.device import CountingDevice

    counting = CountingDevice()
    monkeypatch.setattr(recorder, "device_of", lambda _type: counting)
    monkeypatch.setattr(recorder, "merge_isolated", lambda parts: ("merged", len(parts)))
    workload = mlp(mesh, dim=16, layers=2)
    loop = recorder.Recorder(workload.model, 1, workload)
    monkeypatch.setattr(loop, "isolated", lambda only=None, collectives=True: only)
    loop.passes = [("a",), ("b",)]
    try:
        assert loop.isolate_next(None, None) is None and "release_cache" not in counting.calls
        assert loop.isolate_next(None, None) == ("merged", 2) and counting.calls["release_cache"] == 1
    finally:
        loop.remove()
