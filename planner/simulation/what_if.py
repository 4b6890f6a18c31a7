"""The what-if: a recorded profile carried to another depth and another cluster, then simulated.

One pipeline, in one order, for every caller (``simulate``, ``tune --target``, the predicted stage):

1. the simulator's in-step parameters are solved on the profile as recorded (``profile_params``): what the
   recorded step measured is of the recorded model on the recorded cluster;
2. deepen: a profile of a slice of the model's blocks is extended to its full depth
   (:func:`planner.simulation.depth.deepen`, [Note: Repeating measured blocks]);
3. re-target: every collective is re-timed for the target's world size, mesh and links
   (:func:`planner.simulation.link.retarget`);
4. band: the step's band on the target (:func:`planner.simulation.band.step_band`);
5. simulate the re-targeted profile with the parameters of step 1.

:meth:`Scenario.price` is the one way a plan is priced (``simulate`` and ``check``): one answer for one profile,
plan and cluster.

:class:`WhatIf` is the question as a user writes it (``--target``, ``--world-size``, ``--mesh``, ``--depth``,
``--blocks``); :meth:`WhatIf.apply` answers it with a :class:`Scenario`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import PlannerError, TargetError

if TYPE_CHECKING:  # importing the what-if compiles nothing: the simulator comes with the first Scenario
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.artifacts.target import Target
    from planner.simulation.band import Band
    from planner.simulation.depth import Deepened
    from planner.simulation.link import Retargeted
    from planner.simulation.simulator import SimParams, SimResult, Simulator


@dataclass(frozen=True)
class WhatIf:
    """The depth and cluster a prediction is for, as the command line gives them.

    Attributes:
        target: a preset's name (``prefetch-planner presets``) or a target TOML's path; ``None``: the cluster the
            profile was recorded on.
        world_size: with ``target``: its world size, replaced.
        mesh: with ``target``: HSDP's mesh, ``"REPLICATExSHARD"`` (``"8x8"``), replaced.
        depth: the blocks to extend the profile to; ``None``: as recorded.
        blocks: with ``depth``: the blocks' FQN pattern, ``*`` for the block's index.
    """

    target: str | None = None
    world_size: int | None = None
    mesh: str | None = None
    depth: int | None = None
    blocks: str = "layers.*"

    def check(self) -> None:
        """Raises PlannerError: ``world_size`` or ``mesh`` without ``target``."""
        if self.target is None and (self.world_size is not None or self.mesh is not None):
            raise PlannerError("--world-size and --mesh go with --target (a preset or a target TOML)")

    def load_target(self) -> Target | None:
        """The target with ``world_size`` and ``mesh`` over it; ``None`` without one.

        Raises:
            TargetError: as :func:`planner.artifacts.target.load_target`; a mesh not written ``REPLICATExSHARD``.
        """
        from planner.artifacts.target import load_target

        if self.target is None:
            return None
        shape = None
        if self.mesh is not None:
            try:
                replicate, shard = (int(x) for x in self.mesh.lower().split("x"))
                shape = (replicate, shard)
            except ValueError:
                raise TargetError(f"--mesh {self.mesh!r}: write REPLICATExSHARD, e.g. 8x8") from None
        return load_target(self.target, world_size=self.world_size, mesh=shape)

    def apply(self, recorded: Profile) -> Scenario:
        """Steps 1 to 3 of the module's pipeline on ``recorded``.

        Raises:
            PlannerError: as :meth:`check`.
            ProfileFormatError: a bad ``depth`` or ``blocks`` (:func:`planner.simulation.depth.deepen`).
            TargetError: as :meth:`load_target` and :func:`planner.simulation.link.retarget`.
        """
        self.check()
        return Scenario.of(recorded, self.load_target(), self.depth, self.blocks)


@dataclass(frozen=True)
class Priced:
    """A plan priced on a :class:`Scenario` (:meth:`Scenario.price`).

    Attributes:
        result: the simulator's run (step, exposed communication, peak, lower bound; the timeline when traced).
        band: the step's band on the target; ``None`` without a target (the cluster recorded on).
    """

    result: SimResult
    band: Band | None = None


@dataclass(frozen=True)
class Scenario:
    """A recorded profile at its full depth on a target, ready to simulate.

    Attributes:
        recorded: the profile as recorded.
        profile: ``recorded`` extended to its full depth (``recorded`` itself without a depth).
        params: the simulator's in-step parameters, solved on ``recorded``.
        deepened: what the depth extension did; ``None`` without one.
        target: the cluster; ``None``: the one recorded on.
        retargeted: ``profile`` re-timed for ``target``, with its link fits; ``None`` without a target.
    """

    recorded: Profile
    profile: Profile
    params: SimParams
    deepened: Deepened | None = None
    target: Target | None = None
    retargeted: Retargeted | None = None

    @classmethod
    def of(cls, recorded: Profile, target: Target | None = None, depth: int | None = None,
           blocks: str = "layers.*") -> Scenario:
        """``recorded`` deepened to ``depth`` blocks (if given), then re-targeted to ``target`` (if given).

        Raises:
            ProfileFormatError: a bad ``depth`` or ``blocks``.
            TargetError: as :func:`planner.simulation.link.retarget` (a target at another TP degree than the
                profile's among them).
        """
        from planner.simulation.depth import deepen
        from planner.simulation.link import keep_tensor_parallel, retarget
        from planner.simulation.parameters import profile_params

        params = profile_params(recorded)  # solved on the recorded step, before any extension
        deepened = deepen(recorded, depth, blocks) if depth is not None else None
        profile = deepened.profile if deepened is not None else recorded
        if target is not None:  # the profile's TP degree ([Note: A what-if keeps the TP degree])
            target = keep_tensor_parallel(target, recorded.fingerprint)
        retargeted = retarget(profile, target, recorded_profile=recorded) if target is not None else None
        return cls(recorded, profile, params, deepened, target, retargeted)

    @property
    def simulated(self) -> Profile:
        """The profile the simulator runs: re-targeted where there is a target."""
        return self.retargeted.profile if self.retargeted is not None else self.profile

    def simulator(self) -> Simulator:
        """A :class:`~planner.simulation.simulator.Simulator` of :attr:`simulated` with :attr:`params`."""
        from planner.simulation.simulator import Simulator

        return Simulator(self.simulated, self.params)

    def band(self, plan: Plan | None = None) -> Band | None:
        """The step's band for ``plan`` (default: FSDP2's) on the target; ``None`` without a target."""
        from planner.simulation.band import step_band

        if self.target is None:
            return None
        return step_band(self.profile, self.target, plan, self.params, self.recorded)

    def price(self, plan: Plan, trace: bool = False) -> Priced:
        """``plan`` simulated on this scenario, with its band on the target; ``trace``: keep the timeline.

        Raises:
            PlannerError: the simulator cannot run the plan (e.g. an integer ``reshard_after_forward``).
        """
        return Priced(self.simulator().run(plan, trace=trace), self.band(plan))
