"""The in-loop tuner: tune FSDP2's prefetch on the user's own training steps.

::

    tuner = AutoTuner(model, study="my-job", storage="sqlite:///tuning.db", memory_budget="+10%")
    for step, batch in enumerate(loader):
        with tuner.step():                      # one optimizer step, all its microbatches
            loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

Every rank constructs the tuner and enters ``tuner.step()`` for the same
steps. The phases (:class:`planner.study.in_loop.TunerPhase`):

1. recording: FSDP2's default; the profile is recorded on the user's steps
   (:mod:`runtime.loop_recorder`), the isolated passes between two steps;
2. searching: rank 0's tuning session (``planner.study.session``, the one
   ``prefetch-planner tune`` runs) runs the simulated stage under
   ``sim_timeout_s`` and picks the candidates, between two steps; they are
   broadcast and applied (checked) on every rank;
3. racing: each plan's warm-up steps (its peak memory measured on them; a
   plan over the memory budget is dropped at once and never runs again), then
   the race's blocks, one plan per step in the balanced order, switched at
   the same step on every rank;
4. confirming: the race's survivor against FSDP2's default on fresh rounds;
5. done: the study's recommendation stays applied (FSDP2's default if
   nothing was confirmed faster); the tuner's hooks are gone and
   ``tuner.step()`` does nothing.

Rank 0 alone decides; the ranks exchange only at the ends of phases and
blocks, on a gloo group of their own (``runtime.collectives.control_group``),
as in ``runtime.protocol``. The trials, the profile and the verdict go to the
study with ``source = "in-loop"``, so ``studies show``, ``load_best_plan`` and
optuna-dashboard see them, and a later ``AutoTuner`` on the same study and
model applies the recommendation at construction and spends no step
([Note: Tuning on the user's steps] in :mod:`planner.study.in_loop`).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from planner import errors
from planner.artifacts.plan import Plan
from planner.errors import FailKind, NotShardedError, PlannerError, one_line
from planner.statistics.schedule import Phase
from planner.statistics.verdict import Confirmation
from planner.study.in_loop import SOURCE, TunerPhase, block_times, in_loop_config, plan_at_start, step_orders
from runtime.accumulation import reshard_after_backward
from runtime.apply import apply_plan, model_fingerprint
from runtime.collectives import broadcast_from_rank0, control_group, gather_objects, max_across_ranks
from runtime.loop_recorder import LoopRecorder, PeakMeter
from runtime.measure import synchronize
from runtime.peak_memory import PEAK_STEPS, peak_of_steps
from runtime.workload import fsdp_modules

logger = logging.getLogger(__name__)

# What a tuner step does: RECORD_WARMUP and WARMUP are untimed, RECORD and TIMED timed, the PEAK kinds measure
# peak memory (untimed).
RECORD_WARMUP, RECORD, RECORD_PEAK, WARMUP, PEAK, TIMED = "record-warmup", "record", "record-peak", "warmup", \
    "peak", "timed"


@dataclass(frozen=True)
class _Step:
    kind: str
    plan: int  # index into the tuner's plans (0: FSDP2's default)


def _raise_named(payload: Any) -> Any:
    """Rank 0's ``{"raise": class name, "message": ...}`` raised as that planner error on every rank."""
    if isinstance(payload, dict) and "raise" in payload:
        cls = getattr(errors, payload["raise"], PlannerError)
        raise cls(payload["message"])
    return payload


class AutoTuner:
    """Tunes FSDP2's prefetch and resharding on the steps of the user's own training loop (module docstring).

    Args:
        model: the root module, already wrapped with ``fully_shard`` (per block, then the root), on every rank
            of an initialized process group.
        study: the study's name.
        storage: its SQLAlchemy URL (SQLite or PostgreSQL); ``None``: a private SQLite file that goes when the
            process ends (the plan JSON is still written if ``plan_out`` is given).
        memory_budget: the per-rank peak a plan may reach (``"+10%"``, ``"1.5GiB"``); ``None``: none.
        plan_out: where rank 0 writes the plan the tuning ends with (Plan JSON); ``None``: not written.
        profile_out: where rank 0 writes the recorded profile; ``None``: not written.
        recheck: with a study that already recommends a plan for this model: tune again on the coming steps, the
            recommendation racing again (else it is applied and no step is spent).
        keys: other study keys, flat, as in a study TOML (``space="per_module"``, ``sim_trials=400``,
            ``warmup_steps=2``, ``steps=5``, ``min_rounds=4``, ``confirm_max_rounds=20``, ...).

    Attributes:
        phase: :class:`~planner.study.in_loop.TunerPhase`.
        plan: the plan applied now.
        confirmation: the confirmation of the race's survivor against FSDP2's default once there is one;
            ``None`` before, when the race dropped every candidate, or when the tuner reused a plan.
        steps_tuning: steps spent recording, racing and confirming.

    Raises:
        NotShardedError: ``model`` is not wrapped with ``fully_shard``, or has no FSDP module beyond the root.
        StudyModelMismatchError: the study was tuned for another model.
        StudyConfigError: a bad key or value.
        StorageError: the storage cannot be opened or written.
        PlannerError: no process group is initialized.
    """

    def __init__(self, model: nn.Module, study: str, storage: str | None = None, memory_budget: str | None = None,
                 *, plan_out: str | None = None, profile_out: str | None = None, recheck: bool = False,
                 **keys: Any):
        if not isinstance(model, FSDPModule):
            raise NotShardedError(f"AutoTuner: {type(model).__name__} is not wrapped with fully_shard; call "
                                  "fully_shard on each block, then on the root, before building the tuner")
        if len(fsdp_modules(model)) < 2:
            raise NotShardedError(f"AutoTuner: {type(model).__name__} has no FSDP module beyond the root, so there "
                                  "is nothing to prefetch; call fully_shard on each block before the root")
        if not dist.is_initialized():
            raise PlannerError("AutoTuner: no process group; call torch.distributed.init_process_group first "
                               "(torchrun sets its environment)")
        self.model = model
        self.rank0 = dist.get_rank() == 0
        self._tmp = tempfile.TemporaryDirectory(prefix="prefetch-planner-") if self.rank0 else None
        if storage is None and self.rank0:
            storage = f"sqlite:///{Path(self._tmp.name) / 'study.db'}"
        self.config = in_loop_config(study, storage or "sqlite://", memory_budget, **keys)
        self.plan_out, self.profile_out = plan_out, profile_out
        self._group = control_group(self.config.launch.timeout_s)
        self.fingerprint = model_fingerprint(model)
        self.phase = TunerPhase.RECORDING
        self.plan = Plan(self.fingerprint, {})
        self.confirmation: Confirmation | None = None
        self.steps_tuning = 0
        self._plans: list[Plan] = [self.plan]
        self._applied = 0
        self._queue: deque[_Step] = deque()
        self._times: list[float] = []
        self._peaks: list[list[int]] = []
        self._session: Any = None
        self._asked: list[Any] = []
        self._kept: list[int] = []
        self._failed: dict[int, str] = {}
        self._block: list[list[int]] | None = None
        self._step_ms: list[list[float]] = []
        self._per_rank: list[list[list[float]]] = []
        self._phase_started = 0
        self._recorder: LoopRecorder | None = None
        self._meter: PeakMeter | None = None
        self._microbatch_hook: Any = None
        self._microbatch = 0
        self._microbatches = 1
        self._schedule: Any = None
        self.device = next(model.parameters()).device.type
        self._start(recheck)

    # -- construction -----------------------------------------------------------------------------------------

    def _start(self, recheck: bool) -> None:
        payload: Any = None
        if self.rank0:
            try:
                decision, plan = plan_at_start(self.config, self.fingerprint, recheck)
                if decision.tune:
                    from planner.storages import check_writable

                    check_writable(self.config.storage_url)
                payload = {"tune": decision.tune, "why": decision.why, "plan": plan.to_dict() if plan else None}
            except PlannerError as e:
                payload = {"raise": type(e).__name__, "message": str(e)}
        payload = _raise_named(broadcast_from_rank0(payload, self._group))
        self._log(f"AutoTuner: {payload['why']}")
        if not payload["tune"]:
            plan = Plan.from_dict(payload["plan"]) if payload["plan"] else Plan(self.fingerprint, {})
            apply_plan(self.model, plan, check=True)
            self._finish_with(plan)
            return
        m = self.config.measure
        self._recorder = LoopRecorder(self.model, m.profile_repeats)
        self._queue.extend([_Step(RECORD_WARMUP, 0)] * max(1, m.warmup_steps) + [_Step(RECORD, 0)] * m.steps
                           + [_Step(RECORD_PEAK, 0)] * PEAK_STEPS)
        self._microbatch_hook = self.model.register_forward_pre_hook(self._before_microbatch)

    # -- the user's step ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step of the user's loop, all its microbatches (every rank enters it for the same steps).

        An exception inside propagates unchanged; the trial of the plan that ran is recorded FAIL with the
        reason, FSDP2's default is applied and the tuner is done.
        """
        if self.phase == TunerPhase.DONE:
            yield
            return
        order = self._queue.popleft()
        t0 = self._before(order)
        try:
            yield
        except BaseException as e:
            self._step_failed(order, e)
            raise
        self._after(order, t0)
        self.steps_tuning += 1
        if not self._queue:
            self._decide()

    def _before_microbatch(self, module: nn.Module, args: Any) -> None:
        """Root pre-forward: a plan's ``reshard_after_backward`` for every microbatch but the step's last
        (``runtime.accumulation``; the recorded microbatch count tells which is last)."""
        n = self._microbatches
        if n > 1:
            last = self._microbatch >= n - 1
            self.model.set_reshard_after_backward(last or reshard_after_backward(self.model))
        self._microbatch += 1

    def _before(self, order: _Step) -> float | None:
        self._microbatch = 0
        if order.plan != self._applied:
            apply_plan(self.model, self._plans[order.plan], check=False)
            self._applied = order.plan
        if order.kind in (RECORD_WARMUP, RECORD, RECORD_PEAK):
            self._recorder.begin_step(peak=order.kind == RECORD_PEAK)
        elif order.kind == PEAK:
            self._meter.begin()
        if order.kind not in (RECORD, TIMED):
            return None
        dist.barrier(group=self._group)
        synchronize(self.device)
        return time.perf_counter()

    def _after(self, order: _Step, t0: float | None) -> None:
        ms = None
        if t0 is not None:
            synchronize(self.device)
            ms = (time.perf_counter() - t0) * 1e3
        if self._microbatches > 1:  # a plan that kept parameters unsharded after a microbatch
            for _, m in fsdp_modules(self.model):
                m.reshard()
        if order.kind in (RECORD_WARMUP, RECORD, RECORD_PEAK):
            self._recorder.end_step(ms)
        elif order.kind == PEAK:
            self._peaks[order.plan].append(self._meter.end()[0])
        elif order.kind == TIMED:
            self._times.append(ms)

    def _step_failed(self, order: _Step, e: BaseException) -> None:
        reason = f"a training step raised on rank {dist.get_rank()}: {one_line(e)}"
        if self.rank0 and self._session is not None:
            with contextlib.suppress(Exception):
                if order.plan < len(self._asked):
                    self._session.fail([self._asked[order.plan]], reason, FailKind.ERROR)
                self._session.fail_held(f"not measured: {reason}", FailKind.INTERRUPTED)
        self._abandon(f"a step raised inside tuner.step() ({one_line(e)})", apply=True)

    # -- decisions between steps --------------------------------------------------------------------------------

    def _decide(self) -> None:
        """The queue ran out: the next phase or block (every rank, together)."""
        try:
            if self.phase == TunerPhase.RECORDING:
                self._search()
            elif self._block is None:
                self._start_race()
            else:
                self._record_block()
        except PlannerError as e:
            if self.rank0 and self._session is not None:
                with contextlib.suppress(Exception):
                    self._session.fail_held(f"not measured: {one_line(e)}", FailKind.INTERRUPTED)
            self._abandon(str(e), apply=True)

    def _everywhere(self, compute: Callable[[], Any]) -> Any:
        """``compute()`` on rank 0, its result on every rank; a planner error there raises on every rank."""
        payload: Any = None
        if self.rank0:
            try:
                payload = compute()
            except PlannerError as e:
                payload = {"error": one_line(e)}
        return broadcast_from_rank0(payload, self._group)

    def _search(self) -> None:
        recorder = self._recorder
        recorded_steps = self.steps_tuning
        t0 = time.perf_counter()
        isolated = recorder.isolated()
        profile = recorder.profile(isolated, lambda local: gather_objects(local, self._group))
        recorder.remove()
        self._microbatches = profile.microbatches
        self._recorder = None
        self._meter = PeakMeter(self.model, recorder.optimizers)
        self._log(f"AutoTuner: recorded FSDP2's default on {recorded_steps} steps (step {profile.measured_step_ms:.1f}"
                  f" ms, {profile.microbatches} microbatch(es)), isolated passes {time.perf_counter() - t0:.1f} s "
                  "between two steps")
        self.phase = TunerPhase.SEARCHING
        t0 = time.perf_counter()

        def ask() -> list[dict]:
            from planner.study.session import TuningSession, job_name
            from search_spaces import get_space

            out = self.profile_out or str(Path(self._tmp.name) / "profile.json")
            plan_out = self.plan_out or str(Path(self._tmp.name) / "plan.json")
            self._session = TuningSession(self.config, profile, get_space(self.config.search.space),
                                          job=job_name(), plan_out=plan_out, profile_out=out, confirm_launches=0,
                                          source=SOURCE)
            self._asked = self._session.prepare()
            return [a.plan.to_dict() for a in self._asked]

        import optuna

        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # not a line per simulated trial in the user's log
        try:
            self._plans = [Plan.from_dict(d) for d in self._everywhere(ask)]
        finally:
            optuna.logging.set_verbosity(verbosity)
        errors_here = []
        for plan in self._plans:
            try:
                apply_plan(self.model, plan, check=True)
                errors_here.append(None)
            except PlannerError as e:
                errors_here.append(one_line(e))
        apply_plan(self.model, self._plans[0], check=False)
        self._applied = 0
        outcomes = gather_objects(errors_here, self._group)
        self._kept = [i for i in range(len(self._plans)) if all(o[i] is None for o in outcomes)]
        for i in range(len(self._plans)):
            if i not in self._kept:
                self._failed[i] = "applying the plan failed on " + "; ".join(
                    f"rank {r}: {o[i]}" for r, o in enumerate(outcomes) if o[i] is not None)
        if 0 not in self._kept:
            raise PlannerError(f"FSDP2's default plan failed to apply ({self._failed[0]})")
        if self.rank0:
            for i, reason in self._failed.items():
                self._session.fail([self._asked[i]], reason, FailKind.ERROR)
        self._log(f"AutoTuner: searched in {time.perf_counter() - t0:.1f} s between two steps: FSDP2's default and "
                  f"{len(self._kept) - 1} candidate(s) to race")
        self.phase = TunerPhase.RACING
        self._phase_started = self.steps_tuning
        self._peaks = [[] for _ in self._plans]
        warm = max(0, self.config.measure.warmup_steps - PEAK_STEPS)
        for i in self._kept:
            self._queue.extend([_Step(WARMUP, i)] * warm + [_Step(PEAK, i)] * PEAK_STEPS)

    def _start_race(self) -> None:
        per_rank = gather_objects([self._peaks[i] for i in self._kept], self._group)
        peaks = [peak_of_steps([rank[j] for rank in per_rank]) for j in range(len(self._kept))]

        def over() -> list[int]:
            return sorted(self._session.over_budget([self._asked[i] for i in self._kept], peaks))

        dropped = set(self._everywhere(over))
        for j in dropped:
            self._failed[self._kept[j]] = "measured peak over the memory budget"
        peaks = [p for j, p in enumerate(peaks) if j not in dropped]
        self._kept = [i for j, i in enumerate(self._kept) if j not in dropped]
        if dropped:
            self._log(f"AutoTuner: {len(dropped)} candidate(s) dropped: measured peak over the memory budget")
        self._step_ms = [[] for _ in self._kept]
        self._per_rank = [[[] for _ in range(dist.get_world_size())] for _ in self._kept]

        def first_block() -> dict:
            self._schedule = self._session.start([self._asked[i] for i in self._kept], peaks)
            return {"block": self._schedule.next_block(), "phase": str(self._schedule.phase)}

        self._queue_block(self._everywhere(first_block))

    def _queue_block(self, payload: dict) -> None:
        block = payload["block"]
        if block is None:
            self._conclude()
            return
        if payload["phase"] == str(Phase.CONFIRM) and self.phase != TunerPhase.CONFIRMING:
            self._log(f"AutoTuner: raced {len(self._kept)} plans on {self.steps_tuning - self._phase_started} "
                      "steps; confirming the survivor against FSDP2's default on fresh rounds")
            self.phase = TunerPhase.CONFIRMING
            self._phase_started = self.steps_tuning
        self._block = block
        self._times = []
        self._queue.extend(_Step(TIMED, self._kept[j]) for j in step_orders(block))

    def _record_block(self) -> None:
        reports = gather_objects(self._times, self._group)
        maxed = max_across_ranks(reports)
        for pos, j in enumerate(step_orders(self._block)):
            self._step_ms[j].append(maxed[pos])
            for r, rep in enumerate(reports):
                self._per_rank[j][r].append(rep[pos])

        def next_block() -> dict:
            self._schedule.record(block_times(self._block, maxed))
            return {"block": self._schedule.next_block(), "phase": str(self._schedule.phase)}

        self._queue_block(self._everywhere(next_block))

    def _conclude(self) -> None:
        def finish() -> dict:
            told = self._session.tell([self._asked[i] for i in self._kept], self._step_ms, self._per_rank)
            failed = {self._asked[i].number: r for i, r in self._failed.items()}
            outcome = self._session.finish(told, failed)
            self._session.close()
            if self.profile_out:
                self._session.save_profile()
            c = self._schedule.confirmation
            written = outcome.written or Plan(self.fingerprint, {})
            return {"plan": written.to_dict(), "line": outcome.best.line(self.config.name) if outcome.best else "",
                    "confirmation": None if c is None else [c.ratio, list(c.ci95), c.rounds, c.noise_pct,
                                                              str(c.verdict), c.launches]}

        payload = self._everywhere(finish)
        if payload["confirmation"] is not None:
            from planner.statistics.verdict import Verdict

            r, ci, n, noise, verdict, launches = payload["confirmation"]
            self.confirmation = Confirmation(r, tuple(ci), n, noise, Verdict(verdict), launches)
        plan = Plan.from_dict(payload["plan"])
        apply_plan(self.model, plan, check=False)
        what = f"; {payload['line']}" if payload["line"] else ""
        self._log(f"AutoTuner: done after {self.steps_tuning} tuning steps ({self.steps_tuning - self._phase_started}"
                  f" confirming){what}")
        self._finish_with(plan)

    # -- the end ---------------------------------------------------------------------------------------------------

    def _finish_with(self, plan: Plan) -> None:
        """Keep ``plan`` applied and take every hook out: from now on ``step()`` does nothing."""
        self.plan = plan
        self.phase = TunerPhase.DONE
        self._queue.clear()
        if self._recorder is not None:
            self._recorder.remove()
            self._recorder = None
        if self._microbatch_hook is not None:
            self._microbatch_hook.remove()
            self._microbatch_hook = None
        if plan.reshard_after_backward is False:  # runtime.accumulation's own hook-free way from now on
            logger.info("AutoTuner: the plan keeps parameters unsharded between microbatches; call "
                        "runtime.accumulation.prepare_microbatch(model, i, n) before each microbatch to use it")

    def _abandon(self, reason: str, apply: bool) -> None:
        if self._session is not None:
            with contextlib.suppress(Exception):
                self._session.close()
        default = Plan(self.fingerprint, {})
        if apply:
            apply_plan(self.model, default, check=False)
        self._log(f"AutoTuner: stopped tuning after {self.steps_tuning} steps, FSDP2's default applied: {reason}")
        self._finish_with(default)

    def close(self) -> None:
        """Stop tuning where it stands (e.g. the loop ends early): the trials still held are FAIL (interrupted,
        measured again by the next tuner), FSDP2's default is applied."""
        if self.phase == TunerPhase.DONE:
            return
        if self.rank0 and self._session is not None:
            with contextlib.suppress(Exception):
                self._session.fail_held("not measured: the training loop ended first", FailKind.INTERRUPTED)
        self._abandon("closed before the tuning ended", apply=True)

    def _log(self, line: str) -> None:
        if self.rank0:
            logger.info(line)
