"""The in-loop tuner: tune FSDP2's prefetch on the user's own training steps.

::

    tuner = AutoTuner(model, study="my-job", storage="sqlite:///tuning.db", memory_budget="+10%")
    for step, batch in enumerate(loader):
        with tuner.step():                      # one optimizer step, all its microbatches
            loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

Every rank constructs the tuner and enters ``tuner.step()`` for the same steps; :class:`AutoTuner` lists its
phases (:class:`planner.study.in_loop.TunerPhase`). Recording: the profile on the user's steps
(``runtime.recording.recorder.Recorder``, the one ``tune`` records with). Searching: rank 0's tuning session
(``planner.study.session``, the one ``prefetch-planner tune`` runs), between two steps. Racing and confirming:
:mod:`runtime.recording.steps`, the one step runner, which the tune job's ranks use too. Watching:
:mod:`runtime.in_loop.watching` ([Note: The watch] in :mod:`planner.statistics.watch`).

The baseline is the plan the model arrived with (``runtime.current_plan``),
or FSDP2's default where it had none ([Note: The user's plan is the
baseline] in ``planner.study.session``): the profile is recorded under
FSDP2's default, and FSDP2's default is raced as a candidate.

Rank 0 alone decides; the ranks exchange only at the ends of phases and
blocks, on a gloo group of their own (``runtime.ranks.collectives.control_group``),
in the measured round of ``runtime.measuring.round``. The trials, the profile and the verdict go to the
study with ``source = "in-loop"``, so ``studies show``, ``load_best_plan`` and
optuna-dashboard see them, and a later ``AutoTuner`` on the same study and
model applies the recommendation at construction and spends no step
([Note: Tuning on the user's steps] in :mod:`planner.study.in_loop`), or,
for a provisional one, re-confirms it on a few steps: each start is one more
launch ([Note: Provisional verdicts] in :mod:`planner.statistics.verdict`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from planner.artifacts.config import default_storage
from planner.artifacts.plan import Plan, baseline_name
from planner.artifacts.profile import Profile
from planner.errors import NotShardedError, PlannerError, StudyConfigError, TrialFailedError, one_line
from planner.statistics.verdict import Confirmation
from planner.statistics.watch import COST, Watch, WatchState, watch_every
from planner.study.in_loop import TunerPhase, in_loop_config, record_watch
from runtime.accumulation import holds_between_microbatches
from runtime.apply import configure_plan, model_fingerprint
from runtime.current import current_plan, fsdp2_default, own_plan
from runtime.in_loop.failures import FailedSteps
from runtime.in_loop.round import InLoopRound, RoundEnd
from runtime.in_loop.watching import WatchedSteps
from runtime.out_of_memory import recover, recoverable
from runtime.ranks.budget import with_device_budget
from runtime.ranks.collectives import control_group, gather_objects
from runtime.ranks.failures import FailureBoard
from runtime.recording.recorder import Recorder
from runtime.recording.steps import StepSide
from runtime.switch import agreed_off
from runtime.timing import WARMUP, RoundStep
from runtime.workload import fsdp_modules

logger = logging.getLogger(__name__)


class AutoTuner(FailedSteps):
    """Tunes FSDP2's prefetch and resharding on the steps of the user's own training loop.

    Every rank builds it and enters :meth:`step` on the same steps. Its phases, in order: recording (FSDP2's
    default while the profile is recorded), searching (the simulated study, between two steps), racing (one plan a
    step, switched at the same step on every rank), confirming (the survivor against the baseline on fresh
    rounds), watching (the survivor, faster on this process's rounds but not yet across fresh launches, applied for
    the rest of the process and watched against the baseline, reverted if slower in total), done (the confirmed
    plan, or the baseline, stays applied; :meth:`step` does nothing). The baseline is the plan the model arrived
    with, else FSDP2's default. With ``PREFETCH_PLANNER=off`` on any rank the tuner is done from the start and
    changes nothing (:mod:`planner.switch`). Applying, reverting or keeping a plan without tuning is one line at
    WARNING on rank 0, which Python shows without any logging set-up; the rest is INFO.

    Args:
        model: the root module, already wrapped with ``fully_shard`` (per block, then the root), on every rank
            of an initialized process group.
        study: the study's name.
        storage: its SQLAlchemy URL (SQLite or PostgreSQL); ``None``: ``sqlite:///studies/NAME.db`` in the working
            directory, the default ``tune`` and ``studies`` use too (``planner.artifacts.config.default_storage``),
            so the next start reuses the study.
        memory_budget: the per-rank peak a plan may reach (``"+10%"``, ``"1.5GiB"``); ``None``: on a CUDA device
            what the device has free less 10% of it, the smallest across ranks
            (``planner.artifacts.memory_budget.device_budget``); elsewhere none.
        plan_out: where rank 0 writes the plan the tuning ends with (Plan JSON); ``None``: not written.
        profile_out: where rank 0 writes the recorded profile; ``None``: not written.
        recheck: with a study that already recommends a plan for this model: re-confirm it on the coming steps,
            raced against FSDP2's default on the study's stored profile, no recording and no search (else it is
            applied and no step is spent). A study that recommends FSDP2's default is tuned afresh.
        start_from: a plan predicted for this cluster (``prefetch-planner tune --target``'s JSON): the tuner tunes,
            and races it first among its candidates against FSDP2's default; it is kept only if confirmed faster.
            Without it, the study's latest predicted plan for this model (``tune --target`` on the same study) is
            raced first when the tuner tunes afresh.
        check_only: tune nothing: log at construction what ``prefetch-planner check`` prints for the plan the
            model has (its configuration read back, the known-bad patterns it matches, and, from the study's stored
            profile of this model, its predicted step and peak against FSDP2's default and the study's
            recommendation); the model keeps its plan and :meth:`step` does nothing. The report's lines are
            :attr:`check_lines` on rank 0.
        on_oom: ``"skip"``: a user's step that ran a candidate, or the watched survivor, and ran out of memory is
            skipped (one logged line; its optimizer step did not run), the candidate's trial is FAIL with the
            reason, FSDP2's iteration state and the partial gradients are cleared, and the plan kept (the model's
            own, else FSDP2's default) is applied for the rest of the process; an out-of-memory error in the
            tuner's own work between steps (an isolated pass) stops the tuning the same way. ``"raise"``: such
            errors propagate as any other. Out of memory under the baseline always propagates: it is the job's.
        keys: other study keys, flat, as in a study TOML (``space="per_module"``, ``sim_trials=400``,
            ``warmup_steps=2``, ``steps=5``, ``min_rounds=4``, ``confirm_max_rounds=20``, ...).

    Attributes:
        phase: :class:`~planner.study.in_loop.TunerPhase`.
        plan: the plan applied now.
        confirmation: the confirmation of the race's survivor against the baseline once there is one (with
            the launches it rests on: a provisional plan's re-confirmation pools the earlier starts' launches);
            ``None`` before, when the race dropped every candidate, or when the tuner reused a plan.
        steps_tuning: steps spent recording, racing and confirming.
        watch: while the survivor runs watched (phase ``watching``) and after, where its watch stands
            (``planner.statistics.watch.WatchState``: checks, steps, ratio, reverted); ``None`` without one.
        check_lines: with ``check_only``, the report logged on rank 0 (empty on other ranks and otherwise).

    Raises:
        NotShardedError: ``model`` is not wrapped with ``fully_shard``, or has no FSDP module beyond the root.
        TensorParallelError: HSDP + TP (FSDP + TP is tuned), raised before any group or study is opened.
        UnsupportedPlanError: its FSDP modules cast under different mixed-precision policies; FSDP shards over part
            of the job's ranks (pipeline parallelism).
        StudyModelMismatchError: the study was tuned for another model.
        StudyConfigError: a bad key or value, or ``on_oom`` neither ``"skip"`` nor ``"raise"``.
        StorageError: the storage cannot be opened or written.
        PlanFormatError: ``start_from`` cannot be read as a plan.
        PlanMismatchError: ``start_from`` is a plan of another model, or carries no search-space parameters.
        PlannerError: no process group is initialized.
        SwitchError: a rank's ``PREFETCH_PLANNER`` is neither on nor off.
    """

    def __init__(self, model: nn.Module, study: str, storage: str | None = None, memory_budget: str | None = None,
                 *, plan_out: str | None = None, profile_out: str | None = None, recheck: bool = False,
                 start_from: str | None = None, check_only: bool = False, on_oom: str = "skip", **keys: Any):
        if not isinstance(model, FSDPModule):
            raise NotShardedError(f"AutoTuner: {type(model).__name__} is not wrapped with fully_shard; call "
                                  "fully_shard on each block, then on the root, before building the tuner")
        if len(fsdp_modules(model)) < 2:
            raise NotShardedError(f"AutoTuner: {type(model).__name__} has no FSDP module beyond the root, so there "
                                  "is nothing to prefetch; call fully_shard on each block before the root")
        if not dist.is_initialized():
            raise PlannerError("AutoTuner: no process group; call torch.distributed.init_process_group first "
                               "(torchrun sets its environment)")
        if on_oom not in ("skip", "raise"):
            raise StudyConfigError(f"AutoTuner: on_oom={on_oom!r} is not understood; write \"skip\" (a step whose "
                                   "candidate ran out of memory is skipped) or \"raise\"")
        self.on_oom = on_oom
        self.model = model
        self.fingerprint = model_fingerprint(model)  # first: a model refused here opens no group and no study
        self.rank0 = dist.get_rank() == 0
        self._tmp = tempfile.TemporaryDirectory(prefix="prefetch-planner-") if self.rank0 else None
        if storage is None:  # the one default: sqlite:///studies/NAME.db in the working directory
            storage = default_storage(study)
            if self.rank0:
                Path("studies").mkdir(exist_ok=True)
        # the process group's backend names the cluster whose spread the verdicts use (planner.study.cluster_spread)
        keys.setdefault("backend", "nccl" if "nccl" in str(dist.get_backend()) else "gloo")
        self.config = in_loop_config(study, storage, memory_budget, **keys)
        self._group = control_group(self.config.launch.timeout_s)
        self.default = fsdp2_default(model)  # every module, so applying it undoes any other plan
        self.own_plan = own_plan(model)
        self.phase = TunerPhase.RECORDING
        self.plan = self.own_plan or self.default
        self.confirmation: Confirmation | None = None
        self.steps_tuning = 0
        self.check_lines: list[str] = []
        self._watching: WatchedSteps | None = None
        self._watched_trial: int | None = None
        self._queue: deque[RoundStep] = deque()
        self._phase_started = 0
        self.device = next(model.parameters()).device.type
        if (off := agreed_off(self._group, "AutoTuner")) is not None:  # [Note: The ranks agree on the switch]
            self._announce(off)
            self.phase = TunerPhase.DONE
            return
        self.config, line = with_device_budget(self.config, self.device, self._group)  # a full GPU is the job's
        if line is not None:
            self._log(f"AutoTuner: {line.replace('[search] memory_budget', 'pass memory_budget')}")
        if check_only:
            self._check_only()
            return
        self._steps = StepSide(model, self.device, self._group, self.default)
        files = (plan_out or str(Path(self._tmp.name) / "plan.json"), profile_out) if self.rank0 else ("", None)
        # [Note: A failed step on some ranks] in planner.failed_steps: a step that raises on one rank only
        self._board = FailureBoard.open(self._group, self.config.launch.stuck_after_s)
        self._round = InLoopRound(model, self.config, self._group, files, self.own_plan, self._board)
        self._start(recheck, start_from)

    # -- construction -----------------------------------------------------------------------------------------

    def _check_only(self) -> None:
        """``check_only=True``: rank 0 logs the check of the plan the model has; nothing is applied or tuned."""
        if self.rank0:
            from planner.study.check import check_in_study

            plan = current_plan(self.model)
            self.check_lines = check_in_study(self.config, self.fingerprint, plan)
            for line in [f"AutoTuner (check_only): study {self.config.name!r}, nothing tuned"] + self.check_lines:
                logger.info(line)
        self.phase = TunerPhase.DONE

    def _start(self, recheck: bool, start_from: str | None) -> None:
        start = self._round.start(self.fingerprint, recheck, start_from if self.rank0 else None)
        (self._log if start.tune else self._announce)(f"AutoTuner: {start.why}")
        if not start.tune:
            plan = Plan.from_json(start.plan_json) if start.plan_json else self._kept()
            configure_plan(self.model, plan, check=True)
            self._finish_with(plan)
            return
        if self.own_plan is not None:  # [Note: The user's plan is the baseline] in planner.study.session
            configure_plan(self.model, self.default, check=False)
            self._log("AutoTuner: the model arrives with a plan of its own: the profile is recorded under FSDP2's "
                      "default, as a profile is; the plan it arrived with is the race's baseline, what every verdict "
                      "compares against, and it is applied again, exactly, unless a plan is confirmed faster than it")
        self._steps.hook_microbatches()
        if start.recheck is not None:
            self._start_recheck(start.recheck)
            return
        m = self.config.measure
        self._steps.recorder = Recorder(self.model, m.profile_repeats)
        self._queue.extend(Recorder.loop_steps(self.config))

    def _start_recheck(self, microbatches: int) -> None:
        """``recheck=True`` on a study that recommends a plan: race it against FSDP2's default on the study's stored
        profile (rank 0's), no recording and no search; one untimed step of FSDP2's default first, in which the
        optimizers are seen (the peak steps count their state)."""
        self._steps.microbatches = microbatches
        self._steps.watch_optimizers()
        try:
            steps = self._round.search(self._round.stored_profile, recheck=True)
        except PlannerError as e:
            self._round.fail(None, one_line(e))
            self._abandon(str(e))
            return
        self._steps.race(self._round.measured.plans)
        self.phase = TunerPhase.RACING
        self._queue.extend([RoundStep(WARMUP, 0)] + steps)

    # -- the user's step ---------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step of the user's loop, all its microbatches (every rank enters it for the same steps).

        An exception inside propagates unchanged; the trial of the plan that ran is recorded FAIL with the
        reason, the baseline is applied again and the tuner is done. The ranks agree first on the failure board
        ([Note: A failed step on some ranks] in :mod:`planner.failed_steps`): where every rank's step ran out of
        memory in step under a candidate, every rank skips it (``on_oom="skip"``); a rank whose step did not raise
        while a peer's did raises :class:`planner.TrialFailedError` at its next step.

        Raises:
            TrialFailedError: a peer's step raised and the ranks cannot go on together (this rank's step
                finished: the process groups are out of step, or the ranks' models differ).
        """
        if self.phase == TunerPhase.DONE:
            yield
            return
        if self.phase == TunerPhase.WATCHING:
            self._watching.before()
            try:
                yield
            except BaseException as e:
                if self._watched_out_of_memory(e):
                    return  # the step is skipped; training goes on at the next one
                raise
            if self._watching.ends_block() and self._board.posted():  # before the block's broadcast
                self._stop_for_peer()
            state = self._watching.after()
            if state is not None:
                self._watched(state)
            return
        if self._board.before_step():
            self._stop_for_peer()
        order = self._queue.popleft()
        t0 = self._steps.before(order)
        try:
            yield
        except BaseException as e:
            if self._skipped_out_of_memory(order, e):
                return  # the step is skipped; training goes on at the next one
            self._step_failed(order, e)
            raise
        self._steps.after(order, t0, self._round.measured.peaks)
        self.steps_tuning += 1
        if not self._queue:
            self._decide()

    # -- decisions between steps --------------------------------------------------------------------------------

    def _decide(self) -> None:
        """The queue ran out: the next phase or block (every rank, together)."""
        round_ = self._round
        if self._board.posted():  # before any collective of the control group
            self._stop_for_peer()
        try:
            if self.phase == TunerPhase.RECORDING:
                if (profile := self._recorded()) is None:
                    return  # an isolated pass remains (one more step first)
                steps = round_.search(profile)
                self._steps.race(round_.measured.plans)
                self.phase, self._phase_started = TunerPhase.RACING, self.steps_tuning
            elif round_.measured.block is None:
                steps = round_.start_race()
            else:
                steps = round_.record_block(self._steps.take_times())
            if steps is None:
                self._conclude()
                return
        except TrialFailedError:  # the ranks stop (runtime.measuring.round): the round's trials are recorded
            self._abandon("a peer's step raised")
            raise
        except PlannerError as e:
            round_.fail(None, one_line(e))
            self._abandon(str(e))
            return
        except BaseException as e:  # the tuner's own work between two steps (an isolated pass, a switch)
            agreement = self._agreed(None, e)
            if (agreement is None or not agreement.go_on or self.on_oom == "raise"
                    or not recoverable(self.model, e)):
                round_.fail(None, f"the tuner's work between steps raised: {one_line(e)}")
                self._abandon(f"the tuner's work between steps raised ({one_line(e)})")
                raise
            recover(self.model)
            round_.fail(None, f"out of memory in the tuner's work between steps: {one_line(e)}")
            self._abandon(f"out of memory in the tuner's work between steps ({self.phase}): {one_line(e)}; the "
                          "user's step before it had finished")
            return
        if round_.measured.confirming and self.phase != TunerPhase.CONFIRMING:
            self._log(f"AutoTuner: raced {len(round_.measured.kept)} plans on {self.steps_tuning - self._phase_started}"
                      f" steps; confirming the survivor against {self._baseline_name()} on fresh rounds")
            self.phase, self._phase_started = TunerPhase.CONFIRMING, self.steps_tuning
        self._steps.take_times()
        self._queue.extend(steps)

    def _recorded(self) -> Profile | None:
        """The profile of the recording steps (every rank); ``None`` while the recording has steps to run
        (``Recorder.loop_next``: the isolated passes between steps, then the timed steps, last), which are queued."""
        recorder = self._steps.recorder
        if steps := recorder.loop_next(self.config, lambda local: gather_objects(local, self._group)):
            self._queue.extend(steps)
            return None
        self.phase = TunerPhase.SEARCHING
        profile = recorder.profile(recorder.isolated_figures, lambda local: gather_objects(local, self._group))
        self._steps.recorded(profile.microbatches)
        self._log(f"AutoTuner: recorded FSDP2's default on {self.steps_tuning} steps (step "
                  f"{profile.measured_step_ms:.1f} ms, {profile.microbatches} microbatch(es)); {recorder.isolation}")
        return profile

    def _conclude(self) -> None:
        try:
            end = self._round.conclude(self._kept())
        except PlannerError as e:
            self._round.fail(None, one_line(e))
            self._abandon(str(e))
            return
        self.confirmation = end.confirmation
        if end.keeps_baseline and not end.applies_here:  # the plan the model had, exactly as it was
            end = dataclasses.replace(end, plan=self._kept())
        configure_plan(self.model, end.plan, check=False)
        what = f"; {'across processes the study says: ' if end.applies_here else ''}{end.line}" if end.line else ""
        confirming = self.steps_tuning - self._phase_started
        self._announce(f"AutoTuner: done after {self.steps_tuning} tuning steps ({confirming} confirming){what}")
        if end.applies_here:
            self._watch(end)
            return
        self._finish_with(end.plan)

    def _watch(self, end: RoundEnd) -> None:
        """Apply the survivor for the rest of this process and watch it against the baseline ([Note: Applied in
        the process that measured it] in :mod:`planner.statistics.watch`)."""
        plan, trial = end.survivor
        every = watch_every(end.here.ratio)
        configure_plan(self.model, plan, check=False)
        self.plan, self.phase, self._queue = plan, TunerPhase.WATCHING, deque()
        self._watched_trial = trial
        self._steps.race([plan, self._kept()])  # the survivor applied just now (runtime.in_loop.watching)
        self._watching = WatchedSteps(self._steps, Watch(every, seed=trial), self.rank0)
        self._announce(f"AutoTuner: applied trial {trial}'s plan for the rest of this process: {end.here.line()} (the "
                       f"study keeps it provisional until fresh launches confirm it); watching it against "
                       f"{self._baseline_name()} twice in every {every} steps (under {100 * COST:.0f}% of the run's "
                       "time at that ratio), reverted if it is slower in total")

    def _watched(self, state: WatchState) -> None:
        """After a watch block: a revert, or every so often the running ratio (logged and stored on rank 0)."""
        if state.reverted:
            self._announce(f"AutoTuner: the watch reverted trial {self._watched_trial}'s plan after {state.steps} "
                           f"steps: {state.line()}")
            self._store_watch(state)
            kept = self._kept()
            configure_plan(self.model, kept, check=False)
            self._finish_with(kept)
        elif self._watching.due_for_log():
            self._log(f"AutoTuner: watching trial {self._watched_trial}'s plan: {state.line()}")
            self._store_watch(state)

    def _store_watch(self, state: WatchState) -> None:
        if not self.rank0:
            return
        try:
            record_watch(self.config, self._watched_trial, self._round.session.job, state)
        except PlannerError as e:
            logger.warning(f"AutoTuner: could not record the watch in the study: {one_line(e)}")

    @property
    def watch(self) -> WatchState | None:
        """Where the watch of the survivor applied in this process stands; ``None`` without one."""
        return None if self._watching is None else self._watching.state

    # -- the end ---------------------------------------------------------------------------------------------------

    def _finish_with(self, plan: Plan) -> None:
        """Keep ``plan`` applied and take every hook out: from now on ``step()`` does nothing."""
        self._board.close()
        self.plan = plan
        self.phase = TunerPhase.DONE
        self._queue.clear()
        self._steps.remove()
        if holds_between_microbatches(plan):  # runtime.accumulation's own hook-free way from now on
            logger.info("AutoTuner: the plan keeps parameters unsharded between microbatches; call "
                        "runtime.accumulation.prepare_microbatch(model, i, n) before each microbatch to use it")

    def _kept(self) -> Plan:
        """The plan kept when nothing is applied instead: the one the model arrived with, else FSDP2's default."""
        return self.own_plan or self.default

    def _baseline_name(self) -> str:
        return baseline_name(self.own_plan is not None)

    def _abandon(self, reason: str) -> None:
        kept = self._kept()
        configure_plan(self.model, kept, check=False)
        what = "the plan the model arrived with applied again" if self.own_plan else "FSDP2's default applied"
        self._announce(f"AutoTuner: stopped tuning after {self.steps_tuning} steps, {what}: {reason}")
        self._finish_with(kept)

    def close(self) -> None:
        """Stop tuning where it stands (e.g. the loop ends early): the trials still held are FAIL (interrupted,
        measured again by the next tuner), and the baseline is applied again (the plan the model arrived with, else
        FSDP2's default). A watched plan stays applied, its watch stored in the study."""
        if self.phase == TunerPhase.DONE:
            return
        if self.phase == TunerPhase.WATCHING:
            if self._watching.state.blocks:
                self._store_watch(self._watching.state)
            self._finish_with(self.plan)
            return
        self._round.fail(None, "the training loop ended first")
        self._abandon("closed before the tuning ended")

    def _log(self, line: str) -> None:
        if self.rank0:
            logger.info(line)

    def _announce(self, line: str) -> None:
        """A line the user sees without configuring logging (WARNING, rank 0): a plan applied, reverted or kept
        without tuning, the tuning stopped, the switch off. Every other line is INFO."""
        if self.rank0:
            logger.warning(line)
