"""The FSDP2 knobs a plan sets besides its prefetch lists and ``reshard_after_forward``, each declared once.

A :class:`Knob` says everything the tool needs to know about one FSDP2
setting: its name and values, FSDP2's default, the ``FSDPModule`` method that
applies it and on which modules, when a search space samples it, and how it
prints. From :data:`KNOBS` derive:

- the plan's values (:class:`KnobValues`, ``Plan.knobs`` and ``ModulePlan.knobs``)
  and their JSON fields (``planner.artifacts.schema``);
- ``runtime.apply_plan``, which calls each knob's setter, and ``runtime.current_plan``, which calls its
  getter (FSDP2 has setters only: each knob's reader of FSDP2's state is declared beside its setter);
- the search spaces' parameters (:func:`sample`, :func:`default_params`, :func:`grid_params`): every space
  samples its knobs through these, named by :attr:`Knob.spaces`;
- the candidates' kinds and the CLI's tables.

Only the simulator's rule for a knob is written by hand, in
``planner.simulation._kernel``, next to its FSDP2 source. The kernel reads a
knob's value by its position (:func:`position`) in ``PlanArrays.knobs`` or
``PlanArrays.module_knobs``; the kernel's numba cache digests this file too,
so a reordering recompiles it.

The prefetch lists and ``reshard_after_forward`` are not knobs here: they are
the plan's structure, which each search space builds its own way
(``search_spaces``), and ``reshard_after_forward``'s default is per module, as
the model was wrapped.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from planner.artifacts.names import SpaceName
from planner.errors import PlanFormatError

KnobValue = bool | int


class Scope(enum.StrEnum):
    """Where a knob's value lives and which modules its setter is called on.

    ``ROOT``: one value per plan; the setter is called once, on the root, and
    FSDP2 applies it to every module under it. ``EVERY_MODULE``: one value per
    plan; the setter is called on every FSDP module (it sets only that
    module's parameter groups). ``MODULE``: a value per module
    (``ModulePlan.knobs``), its setter called on that module.
    """

    ROOT = "root"
    EVERY_MODULE = "every_module"
    MODULE = "module"


class SampledWhen(enum.StrEnum):
    """When a search space samples a knob; otherwise it keeps FSDP2's default.

    ``ALWAYS``. ``GPU``: the profile's device is not a CPU (the knob changes
    nothing where collectives are synchronous). ``MICROBATCHES``: the profile
    has gradient accumulation. ``SKIPPABLE``: (``MODULE`` knobs) backward reads
    none of the parameter group's parameters
    (``ModuleProfile.needs_parameters_in_backward``).
    """

    ALWAYS = "always"
    GPU = "gpu"
    MICROBATCHES = "microbatches"
    SKIPPABLE = "skippable"


class Written(enum.StrEnum):
    """How a knob appears in Plan JSON.

    ``REQUIRED``: always written, and a file without it is refused.
    ``ALWAYS``: always written; a file without it (written before the knob
    existed) reads as FSDP2's default. ``CHANGED``: written only when it differs
    from FSDP2's default, so plans from before the knob keep their bytes and
    their ``Plan.behaviour_key``.
    """

    REQUIRED = "required"
    ALWAYS = "always"
    CHANGED = "changed"


@dataclass(frozen=True, kw_only=True)
class Knob:
    """One FSDP2 setting of a plan.

    Attributes:
        name: the plan's field, the Plan JSON key and the search spaces'
            parameter (``MODULE`` knobs: ``f"{param}:{group}"``).
        default: FSDP2's default; its type (bool or int) is the knob's.
        setter: the ``FSDPModule`` method that applies it (``runtime.apply_plan``
            calls it with the value; a few go through ``runtime``'s own
            wrappers, named there by this setter).
        getter: the reader of its value on one FSDP module, a function of ``runtime.ranks.torch_private`` by this
            name (FSDP2 has no getters: it reads the state the setter writes), which ``runtime.current_plan``
            calls; ``None`` where the value lives in ``runtime``'s own wrapper of the setter, which reads it
            (``runtime.knob_state.WRAPPER_GETTERS``). A torch without that state leaves the knob unknown, never
            guessed.
        scope: see :class:`Scope`.
        choices: the values a search space samples, FSDP2's default first (int
            knobs: the bounds of ``suggest_int``).
        sampled_when: see :class:`SampledWhen`.
        text: how ``describe`` prints the value (``{value}`` is replaced).
        shown: print ``text`` also when the value is FSDP2's default.
        written: see :class:`Written`.
        minimum: the smallest value a plan may hold (int knobs).
        param: the search spaces' parameter prefix of a ``MODULE`` knob.
        spaces: the search spaces that sample it (``assign``, which searches every knob, by default); the others
            keep FSDP2's default.
        since: the first torch release line (``"2.13"``) whose FSDP2 has the setter; a profile recorded on an
            older torch never samples it (the knob is unknown there: ``runtime.knob_state``). ``None``: every
            release this project runs on (2.11 and later).
    """

    name: str
    default: KnobValue
    setter: str
    getter: str | None
    scope: Scope
    choices: tuple[KnobValue, ...]
    sampled_when: SampledWhen
    text: str
    shown: bool = False
    written: Written = Written.CHANGED
    minimum: int | None = None
    param: str | None = None
    spaces: frozenset[SpaceName] = frozenset({SpaceName.ASSIGN})
    since: str | None = None

    @property
    def kind(self) -> type:
        """``bool`` or ``int``."""
        return type(self.default)

    def check(self, value: Any) -> KnobValue:
        """``value`` if it is a value of this knob.

        Raises:
            PlanFormatError: of another type, or below :attr:`minimum`.
        """
        if type(value) is not self.kind:
            raise PlanFormatError(f"{self.name} must be {'true or false' if self.kind is bool else 'an integer'}, "
                                  f"found {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise PlanFormatError(f"{self.name} must be >= {self.minimum}, found {value!r}")
        return value

    def describe(self, value: KnobValue) -> str | None:
        """The text ``describe`` prints for ``value``; ``None`` when it says nothing."""
        return self.text.format(value=value) if self.shown or value != self.default else None


KNOBS: tuple[Knob, ...] = (
    Knob(name="unshard_async_op", default=False, setter="_set_unshard_async_op", getter="unshard_async_op",
         scope=Scope.ROOT, choices=(False, True), sampled_when=SampledWhen.ALWAYS, text="async unshard {value}",
         shown=True, written=Written.REQUIRED, spaces=frozenset(SpaceName)),
    Knob(name="reduce_scatter_max_input_buffers", default=1, setter="set_reduce_scatter_max_input_buffers",
         getter="reduce_scatter_max_input_buffers", scope=Scope.ROOT, choices=(1, 2), sampled_when=SampledWhen.GPU,
         text="{value} reduce-scatter input buffers", written=Written.ALWAYS, minimum=1, since="2.13"),
    Knob(name="reshard_after_backward", default=True, setter="set_reshard_after_backward",
         getter=None, scope=Scope.ROOT, choices=(True, False),
         sampled_when=SampledWhen.MICROBATCHES, text="no reshard after backward between microbatches",
         written=Written.ALWAYS),
    Knob(name="separate_reduce_scatter_group", default=False, setter="set_separate_reduce_scatter_group",
         getter="separate_reduce_scatter_group", scope=Scope.ROOT, choices=(False, True),
         sampled_when=SampledWhen.ALWAYS, text="reduce-scatter on its own process group", since="2.13"),
    Knob(name="unshard_in_backward", default=True, setter="set_unshard_in_backward", getter="unshard_in_backward",
         scope=Scope.MODULE, choices=(True, False), sampled_when=SampledWhen.SKIPPABLE,
         text="no all-gather in backward", param="uib"),
    Knob(name="allocate_memory_from_process_group_for_comm", default=False,
         setter="set_allocate_memory_from_process_group_for_comm", getter="allocates_from_process_group",
         scope=Scope.EVERY_MODULE, choices=(False, True), sampled_when=SampledWhen.GPU,
         text="collective buffers from the process group's allocator"),
    # An event recorded after each optimizer step, handed to FSDP2 for the next step's first all-gather to wait on
    # (``runtime.post_optim``); the simulator's rule is [Note: Post-optimizer event].
    Knob(name="post_optim_event", default=False, setter="set_post_optim_event", getter=None,
         scope=Scope.ROOT, choices=(False, True), sampled_when=SampledWhen.GPU,
         text="the first all-gather waits for the optimizer step only (post-optimizer event)"),
)
"""Every knob, in the order the kernel reads them (append only: :func:`position`)."""

PLAN_KNOBS = tuple(k for k in KNOBS if k.scope is not Scope.MODULE)
"""The knobs with one value per plan (``Plan.knobs``)."""

MODULE_KNOBS = tuple(k for k in KNOBS if k.scope is Scope.MODULE)
"""The knobs with a value per module (``ModulePlan.knobs``)."""

_BY_NAME = {k.name: k for k in KNOBS}


def knob(name: str) -> Knob:
    """The declaration of ``name``.

    Raises:
        PlanFormatError: no knob has that name.
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise PlanFormatError(f"{name!r} is not an FSDP2 knob of this planner (knobs: "
                              f"{', '.join(_BY_NAME)})") from None


def position(name: str) -> int:
    """Where the kernel finds knob ``name``: its index in ``PLAN_KNOBS`` or ``MODULE_KNOBS``."""
    k = knob(name)
    return (MODULE_KNOBS if k.scope is Scope.MODULE else PLAN_KNOBS).index(k)


class KnobValues(Mapping[str, KnobValue]):
    """Knob values, immutable: every knob of one scope, FSDP2's default where not set.

    ``values["separate_reduce_scatter_group"]`` or ``values.separate_reduce_scatter_group``.
    Two are equal when they behave the same (only values other than FSDP2's
    default are kept).

    Raises:
        PlanFormatError: (constructor) an unknown knob, a knob of the other
            scope, or a value of the wrong type.
    """

    __slots__ = ("_changed", "_knobs")

    def __init__(self, values: Mapping[str, Any] | None = None, *, module: bool = False, **kwargs: Any) -> None:
        knobs = MODULE_KNOBS if module else PLAN_KNOBS
        changed = {}
        for name, value in {**(values or {}), **kwargs}.items():
            k = knob(name)
            if k not in knobs:
                raise PlanFormatError(f"{name} is a {'plan' if module else 'module'} knob, not a "
                                      f"{'module' if module else 'plan'} one")
            if k.check(value) != k.default:
                changed[name] = value
        self._knobs = knobs  # __slots__ and no setter: immutable from outside
        self._changed = changed

    def __getitem__(self, name: str) -> KnobValue:
        if name in self._changed:
            return self._changed[name]
        k = _BY_NAME.get(name)
        if k is None or k not in self._knobs:
            raise KeyError(name)
        return k.default

    def __getattr__(self, name: str) -> KnobValue:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __iter__(self) -> Iterator[str]:
        return (k.name for k in self._knobs)

    def __len__(self) -> int:
        return len(self._knobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KnobValues) and (self._knobs, self._changed) == (other._knobs, other._changed)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._changed.items())))

    def __reduce__(self) -> tuple:
        return _rebuild, (self._changed, self._knobs is MODULE_KNOBS)

    def __repr__(self) -> str:
        return f"KnobValues({', '.join(f'{k}={v!r}' for k, v in self._changed.items())})"

    @property
    def changed(self) -> dict[str, KnobValue]:
        """The values other than FSDP2's default (a copy; empty: all FSDP2's defaults)."""
        return dict(self._changed) if self._changed else {}

    def replace(self, **values: KnobValue) -> KnobValues:
        """A copy with ``values`` set."""
        return KnobValues({**self._changed, **values}, module=self._knobs is MODULE_KNOBS)

    def to_json(self) -> dict[str, KnobValue]:
        """The JSON fields, in declaration order: each knob as its :class:`Written` says."""
        return {k.name: self[k.name] for k in self._knobs
                if k.written is not Written.CHANGED or k.name in self._changed}

    def as_array(self) -> list[int]:
        """The values as the kernel reads them: ints in declaration order (:func:`position`)."""
        values = [int(k.default) for k in self._knobs]
        for name, value in self._changed.items():
            values[position(name)] = int(value)
        return values


DEFAULT_PLAN_KNOBS = KnobValues()
"""Every plan knob at FSDP2's default (immutable: shared)."""

DEFAULT_MODULE_KNOBS = KnobValues(module=True)
"""Every module knob at FSDP2's default (immutable: shared)."""


def _rebuild(changed: dict[str, KnobValue], module: bool) -> KnobValues:
    return KnobValues(changed, module=module)


def release_line(torch_version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``"2.11.0+cu130"`` -> ``(2, 11)``); ``None`` for a string
    that names no release (a synthetic profile's)."""
    parts = torch_version.split("+")[0].split(".")
    if len(parts) < 2 or not parts[0].isdigit() or not parts[1][:1].isdigit():
        return None
    return int(parts[0]), int("".join(itertools.takewhile(str.isdigit, parts[1])))


def available(k: Knob, torch_version: str | None) -> bool:
    """Whether a torch of ``torch_version`` has knob ``k``'s setter (:attr:`Knob.since`); a version that names no
    release, or ``None``: assumed so."""
    line = None if torch_version is None or k.since is None else release_line(torch_version)
    return line is None or line >= release_line(k.since)


def sampled(k: Knob, device_type: str, microbatches: int, skippable: bool = False,
            space: SpaceName = SpaceName.ASSIGN, torch_version: str | None = None) -> bool:
    """Whether search space ``space`` samples ``k`` for a profile (:attr:`Knob.spaces`, :class:`SampledWhen`), recorded
    on ``torch_version`` (:func:`available`)."""
    return space in k.spaces and available(k, torch_version) and {
        SampledWhen.ALWAYS: True, SampledWhen.GPU: device_type != "cpu", SampledWhen.MICROBATCHES: microbatches > 1,
        SampledWhen.SKIPPABLE: skippable}[k.sampled_when]


def suggest(trial: Any, k: Knob, param: str | None = None) -> KnobValue:
    """Draw ``k`` from an ``optuna.Trial`` as parameter ``param`` (default: its name): categorical for a bool, an
    integer range for an int."""
    if k.kind is bool:
        return trial.suggest_categorical(param or k.name, list(k.choices))
    return trial.suggest_int(param or k.name, min(k.choices), max(k.choices))


def _sampled_plan_knobs(device_type: str, microbatches: int, space: SpaceName, torch_version: str | None
                        ) -> list[Knob]:
    return [k for k in PLAN_KNOBS if sampled(k, device_type, microbatches, space=space, torch_version=torch_version)]


def sample(trial: Any, device_type: str, microbatches: int, space: SpaceName = SpaceName.ASSIGN,
           torch_version: str | None = None) -> KnobValues:
    """The plan knobs ``space`` samples for a profile recorded on ``torch_version`` (``trial``: an
    ``optuna.Trial``)."""
    return KnobValues({k.name: suggest(trial, k)
                       for k in _sampled_plan_knobs(device_type, microbatches, space, torch_version)})


def default_params(device_type: str, microbatches: int, space: SpaceName = SpaceName.ASSIGN,
                   torch_version: str | None = None) -> dict[str, KnobValue]:
    """FSDP2's default plan knobs as the parameters :func:`sample` would draw for a profile."""
    return {k.name: k.default for k in _sampled_plan_knobs(device_type, microbatches, space, torch_version)}


def grid_params(device_type: str, microbatches: int, space: SpaceName, torch_version: str | None = None
                ) -> list[dict[str, KnobValue]]:
    """Every combination of the plan knobs ``space`` samples for a profile, as parameters; FSDP2's default first,
    the first declared knob varying slowest (int knobs: every value between their bounds)."""
    knobs = _sampled_plan_knobs(device_type, microbatches, space, torch_version)
    values = [k.choices if k.kind is bool else tuple(range(min(k.choices), max(k.choices) + 1)) for k in knobs]
    return [dict(zip((k.name for k in knobs), combo, strict=True)) for combo in itertools.product(*values)]


def from_params(params: Mapping[str, Any], device_type: str, microbatches: int, space: SpaceName,
                torch_version: str | None = None) -> KnobValues:
    """The plan knobs ``space`` samples, read from a trial's parameters (FSDP2's default where absent)."""
    return KnobValues({k.name: params[k.name]
                       for k in _sampled_plan_knobs(device_type, microbatches, space, torch_version)
                       if k.name in params})
