"""The Plan artifact: per FSDP module prefetch lists and knobs, as JSON.

A plan is what ``runtime.apply_plan`` turns into FSDP2 calls:
``set_modules_to_forward_prefetch``, ``set_modules_to_backward_prefetch``,
``set_reshard_after_forward`` and each knob's setter (``planner.artifacts.knobs``). FSDP2's default
behaviour is itself a plan (:meth:`Plan.default`), so every comparison is plan
against plan.

[Note: Plans travel]
A plan names modules by their fully qualified names and says, per module, what
FSDP2's setters take: which modules to prefetch, whether to reshard, each knob.
None of it depends on the world size or the mesh, so a plan made on 2 ranks
applies on 512 as it is. Its gain does not travel with it: the verdict was
reached on the ranks it was tuned on. Applied at another world size, a plan
comes with a one-line warning that says so (:meth:`Fingerprint.travel_note`);
applied to another model (other FSDP modules or parameter counts) it is
refused, naming the first difference.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, create_model, with_config

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.json_types import JsonObject
from planner.artifacts.knobs import DEFAULT_MODULE_KNOBS, DEFAULT_PLAN_KNOBS, MODULE_KNOBS, PLAN_KNOBS, KnobValues
from planner.artifacts.profile import Profile
from planner.artifacts.schema import (
    SCHEMA_VERSION,
    STRICT,
    Document,
    JsonFile,
    ReshardAfterForward,
    knob_fields,
    load_checked,
)
from planner.errors import PlanFormatError, PlanMismatchError

PLAN_SCHEMA_VERSION = SCHEMA_VERSION


@dataclass(frozen=True)
class ModulePlan:
    """What one FSDP module does.

    Attributes:
        forward_prefetch: FQNs this module all-gathers right after its own
            all-gather copy-out in pre-forward. Empty: FSDP2's implicit forward
            prefetch (relies on CPU run-ahead; none on a CPU device).
        backward_prefetch: FQNs this module all-gathers in pre-backward. Empty:
            FSDP2's default, the previous module in post-forward order.
        reshard_after_forward: free the unsharded parameters after forward
            (and all-gather them again in backward). ``False`` trades memory
            for one all-gather less. An ``int`` reshards to that many ranks
            (``fully_shard(reshard_after_forward=int)``): read back from a model
            that was wrapped so (``runtime.current_plan``), applied again as it
            was; no search space proposes one, and the simulator refuses it.
        knobs: the module's own FSDP2 knobs (``planner.artifacts.knobs.MODULE_KNOBS``),
            read as ``module_plan.knobs[name]``; FSDP2's defaults where not set.
    """

    forward_prefetch: tuple[str, ...] = ()
    backward_prefetch: tuple[str, ...] = ()
    reshard_after_forward: bool | int = True
    knobs: KnobValues = DEFAULT_MODULE_KNOBS

    def with_knobs(self, **values: Any) -> ModulePlan:
        """A copy with module knobs set: ``module_plan.with_knobs(unshard_in_backward=False)``."""
        return dataclasses.replace(self, knobs=self.knobs.replace(**values))


class Source(enum.StrEnum):
    """What made a plan: FSDP2's default behaviour, a measured trial of a study, a prediction for a cluster
    not measured (``tune --target``: raced first by the in-loop tuner on the real cluster, never recommended), or
    the user: the plan a model arrived with, read back from FSDP2's state (``runtime.current_plan``)."""

    DEFAULT = "default"
    MEASURED = "measured"
    PREDICTED = "predicted"
    USER = "user"


@with_config(STRICT)
@dataclass(frozen=True)
class Provenance:
    """Where a plan came from. Times in ms; ``None`` where not known.

    Attributes:
        source: what made the plan.
        study, trial: the measured trial.
        predicted_ms: the simulated step time.
        measured_ms: the median step time in the race (max across ranks).
        default_measured_ms: the race's baseline's (FSDP2's default, or :attr:`baseline`), in the same race.
        verdict: the confirmation's verdict against the race's baseline
            (``planner.statistics.verdict.Verdict`` values), for the plan it confirmed.
        measured_ratio: the confirmation's ratio, plan / baseline: of total step time (``ratio_of = "total
            time"``), or on plans confirmed before that estimand, the median per-round ratio.
        ratio_ci95: ``[low, high]``, its 95% interval (``planner.statistics.verdict``): for total time, the
            spread between launches included.
        rounds: the confirmation's rounds, every launch together.
        launches: the fresh launches (processes) they come from.
        noise_pct: step interquartile range / median in the confirmation, %.
        ratio_of: ``"total time"`` where ``measured_ratio`` is the total-time ratio; ``None`` on older plans.
        predicted_peak_bytes: the simulated peak per rank, bytes.
        measured_peak_bytes: the measured peak per rank, max across ranks,
            median over steps, bytes (``runtime.recording.peak_memory``).
        memory_budget_bytes: the budget the plan was chosen under, bytes per
            rank; ``None``: no budget.
        target: for a predicted plan, the cluster it was predicted for (``Target.describe()``).
        band_ms: for a predicted plan, the band on its predicted step, ``[low, high]`` ms
            (``planner.simulation.band``).
        params: for a predicted plan, its search-space parameters (the simulated trial's), so a tuner on the real
            cluster can race it as a trial of its study.
        unknown_knobs: for a plan read back from a model, the knobs the running torch keeps no readable state for:
            the plan holds FSDP2's default for them, and ``apply_plan`` leaves them as they are.
        baseline: what the race's figures compare against when it was not FSDP2's default: ``"user"``, the plan
            the model arrived with (``runtime.current_plan``); ``None``: FSDP2's default.
    """

    source: Source = Source.DEFAULT
    study: str | None = None
    trial: int | None = None
    predicted_ms: float | None = None
    measured_ms: float | None = None
    default_measured_ms: float | None = None
    verdict: str | None = None
    measured_ratio: float | None = None
    ratio_ci95: tuple[float, float] | None = None
    rounds: int | None = None
    launches: int | None = None
    noise_pct: float | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    memory_budget_bytes: int | None = None
    ratio_of: Literal["total time"] | None = None
    target: str | None = None
    band_ms: tuple[float, float] | None = None
    params: dict[str, bool | int | float | str | None] | None = None
    unknown_knobs: tuple[str, ...] | None = None
    baseline: Literal["user"] | None = None


def baseline_name(users: bool) -> str:
    """What a round's verdicts compare against, in words: the plan the model arrived with (``users``), else FSDP2's
    default ([Note: The user's plan is the baseline] in ``planner.study.session``)."""
    return "the plan the model arrived with" if users else "FSDP2's default"


# Provenance fields added after release 0.1.0: written only when set.
_WRITTEN_WHEN_SET = ("launches", "ratio_of", "target", "band_ms", "params", "unknown_knobs", "baseline")


class _ModulePlanLayout(Document):
    forward_prefetch: tuple[str, ...]
    backward_prefetch: tuple[str, ...]
    reshard_after_forward: ReshardAfterForward


ModulePlanDocument = create_model("ModulePlanDocument", __base__=_ModulePlanLayout,
                                  __doc__="One module of a Plan JSON file: a :class:`ModulePlan`, its ``knobs`` "
                                          "written flat, each as ``MODULE_KNOBS`` declares it.",
                                  **knob_fields(MODULE_KNOBS))


class _PlanLayout(Document):
    schema_version: Literal[1]
    fingerprint: Fingerprint
    modules: dict[str, ModulePlanDocument]  # type: ignore[valid-type]
    provenance: Provenance = Field(default_factory=Provenance)


PlanDocument = create_model("PlanDocument", __base__=_PlanLayout,
                            __doc__="A Plan JSON file: a :class:`Plan` with its ``knobs`` written flat, each as "
                                    "``PLAN_KNOBS`` declares it (``planner.artifacts.knobs``).",
                            **knob_fields(PLAN_KNOBS))


@dataclass(frozen=True)
class Plan(JsonFile):
    """A prefetch plan for one model on one world size.

    Attributes:
        fingerprint: the model it was made for (checked by ``apply_plan``).
        modules: per FSDP module FQN, its :class:`ModulePlan`.
        knobs: the plan's FSDP2 knobs (``planner.artifacts.knobs.PLAN_KNOBS``: what each
            does, its FSDP2 setter and default), also read as attributes:
            ``plan.unshard_async_op``.
        provenance: where the plan came from.
        schema_version: :data:`PLAN_SCHEMA_VERSION`.
    """

    fingerprint: Fingerprint
    modules: dict[str, ModulePlan]
    knobs: KnobValues = DEFAULT_PLAN_KNOBS
    provenance: Provenance = field(default_factory=Provenance)
    schema_version: int = PLAN_SCHEMA_VERSION

    WHAT: ClassVar[str] = "plan"
    ERROR: ClassVar[type[Exception]] = PlanFormatError

    def __getattr__(self, name: str) -> Any:
        """A plan knob's value: ``plan.unshard_async_op`` is ``plan.knobs["unshard_async_op"]``."""
        if name.startswith("_") or name not in (k.name for k in PLAN_KNOBS):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.knobs[name]

    @classmethod
    def default(cls, profile: Profile) -> Plan:
        """FSDP2's default behaviour for the profiled model.

        No explicit prefetch lists (implicit forward prefetch, backward
        prefetch of the previous module in post-forward order), each module's
        ``reshard_after_forward`` as it was wrapped (the root keeps its
        parameters), synchronous unshard.
        """
        return cls(
            fingerprint=profile.fingerprint,
            modules={
                fqn: ModulePlan(reshard_after_forward=profile.modules[fqn].reshard_after_forward)
                for fqn in profile.fingerprint.module_fqns
            },
        )

    def behaviour_key(self) -> str:
        """A string equal for two plans exactly when they behave the same."""
        d = self.to_dict()
        d.pop("provenance")
        return json.dumps(d, sort_keys=True)

    def check_matches(self, profile: Profile) -> str | None:
        """Check the plan was made for the model ``profile`` was recorded on ([Note: Plans travel]).

        Returns:
            ``None`` when the world sizes match too, else the one-line warning that the plan travelled.

        Raises:
            PlanMismatchError: another model, naming the first difference of the fingerprints.
        """
        difference = self.fingerprint.model_difference(profile.fingerprint)
        if difference is not None:
            raise PlanMismatchError(f"plan does not match the profile: {difference}; tune a plan for this model")
        return self.fingerprint.travel_note(profile.fingerprint)

    def name(self) -> str:
        """The plan in a few words, for the line a user sees when it is applied: its study and trial, what made it,
        or the plan that changes nothing."""
        p = self.provenance
        if not self.modules:
            return "the plan that changes nothing (every module as wrapped)"
        if p.study is not None and p.trial is not None:
            return f"study {p.study!r}'s trial {p.trial}"
        return {Source.DEFAULT: "FSDP2's default", Source.USER: "a plan read back from a model",
                Source.PREDICTED: f"a plan predicted for {p.target or 'another cluster'}, not measured"}.get(
                    p.source, f"a {p.source} plan")

    def is_default_for(self, profile: Profile) -> bool:
        """Whether this plan behaves like :meth:`default` for ``profile``."""
        return self.behaviour_key() == Plan.default(profile).behaviour_key()

    def with_knobs(self, **values: Any) -> Plan:
        """A copy with plan knobs set: ``plan.with_knobs(unshard_async_op=True)``.

        Raises:
            PlanFormatError: an unknown knob or a value of the wrong type.
        """
        return dataclasses.replace(self, knobs=self.knobs.replace(**values))

    def with_provenance(self, **kwargs: Any) -> Plan:
        """Return a copy with provenance fields replaced."""
        return dataclasses.replace(self, provenance=dataclasses.replace(self.provenance, **kwargs))

    def to_dict(self) -> JsonObject:
        """The Plan JSON object (:data:`PlanDocument`); each knob written as its
        declaration says (``planner.artifacts.knobs.Written``), so plans from before a knob keep their
        :meth:`behaviour_key`."""
        return {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint.to_dict(),
            **self.knobs.to_json(),
            "modules": {
                fqn: {
                    "forward_prefetch": list(m.forward_prefetch),
                    "backward_prefetch": list(m.backward_prefetch),
                    "reshard_after_forward": m.reshard_after_forward,
                    **m.knobs.to_json(),
                }
                for fqn, m in self.modules.items()
            },
            "provenance": {k: v for k, v in dataclasses.asdict(self.provenance).items()
                           if k not in _WRITTEN_WHEN_SET or v is not None},  # older files keep their bytes
        }

    @classmethod
    def document(cls) -> type[BaseModel]:
        """:data:`PlanDocument`."""
        return PlanDocument

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse Plan JSON text (strictly: :data:`PlanDocument`).

        Raises:
            PlanFormatError: not JSON, not an object, an unknown schema version, a
                missing, unknown or ill-typed field (named), or a module / prefetch
                target FQN that is not an FSDP module of the fingerprint.
        """
        export = "export the plan again with `prefetch-planner studies export`"
        doc = load_checked(PlanDocument, text, PlanFormatError, "plan", PLAN_SCHEMA_VERSION,
                           ("export it again", export, export))
        plan = cls(
            fingerprint=doc.fingerprint,
            modules={fqn: ModulePlan(m.forward_prefetch, m.backward_prefetch, m.reshard_after_forward,
                                     KnobValues({k.name: getattr(m, k.name) for k in MODULE_KNOBS}, module=True))
                     for fqn, m in doc.modules.items()},
            knobs=KnobValues({k.name: getattr(doc, k.name) for k in PLAN_KNOBS}),
            provenance=doc.provenance,
        )
        plan.validate()
        return plan

    def validate(self) -> None:
        """Check every FQN the plan names is an FSDP module of its fingerprint.

        Raises:
            PlanFormatError: naming the first unknown FQN.
        """
        known = set(self.fingerprint.module_fqns)
        for fqn, m in self.modules.items():
            if fqn not in known:
                raise PlanFormatError(f"plan sets module {fqn!r}, which is not an FSDP module of its fingerprint")
            for target in (*m.forward_prefetch, *m.backward_prefetch):
                if target not in known:
                    raise PlanFormatError(
                        f"module {fqn!r} prefetches {target!r}, which is not an FSDP module of its fingerprint"
                    )

