"""One rank's recorded figures, typed: what the recorder measures on each rank and the Profile keeps
(``Profile.per_rank``), before they are consolidated across ranks (``runtime.recording.consolidation``).

The path: the timers (``runtime.recording.collective_timer``, ``runtime.recording.compute_timer``) give
:class:`CollectiveMeasurements` and :class:`ComputeMeasurements` per module; an isolated
pass joins them into :class:`IsolatedMeasurements`; a rank adds its step figures
(:class:`RankMeasurements`). Times in ms, sizes in bytes.

In a Profile file a rank's figures are one flat JSON object
(:class:`RankMeasurementsDocument`), as every release wrote
them: :meth:`RankMeasurements.to_json` and :meth:`RankMeasurements.from_document`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

from pydantic import BaseModel, Field, with_config

from planner.artifacts.json_types import JsonObject
from planner.artifacts.schema import STRICT, document_of


@with_config(STRICT)
@dataclass(frozen=True)
class OverlapTimings:
    """An all-gather and compute, alone and at once, on a CPU device (``runtime.recording.overlap_timer``).

    Each figure is a median over rounds on each rank, then the mean across
    ranks, ms; :func:`planner.simulation.in_step.measured_slowdown` solves the
    simulator's ``overlap_slowdown`` from them.

    Attributes:
        module: the FQN of the module all-gathered (the one with the most unsharded parameters).
        all_gather_ms: its ``unshard()`` alone.
        compute_ms: matrix multiplies of about as long, alone.
        overlapped_ms: both at once (``unshard(async_op=True)``, the compute, then the wait).
    """

    module: str
    all_gather_ms: float
    compute_ms: float
    overlapped_ms: float



COMPUTE_FIELDS = ("fwd_ms", "bwd_ms", "fwd_pre_ms", "bwd_pre_ms", "recompute_ms")
"""The times the compute timer attributes to each module and phase, ms."""


@dataclass(frozen=True)
class ComputeMeasurements:
    """One module's compute with every module it waits on unsharded and no communication
    (``runtime.recording.isolated.compute_unsharded``): exclusive ms per phase (``*_pre_ms``: before its first child),
    and
    what it keeps alive, bytes.

    Attributes:
        grad_pre_bytes: (the root) its gradient allocated before its children's backward; ``None``: not measured.
        activation_post_bytes: (the root) what it saves after its children's forward; ``None``: not measured.
    """

    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    fwd_pre_ms: float = 0.0
    bwd_pre_ms: float = 0.0
    recompute_ms: float = 0.0
    activation_bytes: int = 0
    recompute_activation_bytes: int = 0
    backward_peak_bytes: int = 0
    needs_parameters_in_backward: bool = True
    grad_pre_bytes: int | None = None
    activation_post_bytes: int | None = None


@dataclass(frozen=True)
class CollectiveMeasurements:
    """One module's collectives in isolation (``runtime.recording.collective_timer.module_collectives``): medians over
    rounds, ms; ``sharded_bytes``, this rank's shards of the module's own parameters."""

    all_gather_ms: float
    reduce_scatter_ms: float
    sharded_bytes: int = 0


@dataclass(frozen=True)
class ModuleMeasurements:
    """One module's figures on one rank: its compute and its collectives, each ``None`` where the pass that
    produced them did not measure it."""

    compute: ComputeMeasurements | None = None
    collectives: CollectiveMeasurements | None = None

    def merged(self, later: ModuleMeasurements) -> ModuleMeasurements:
        """These figures, with what ``later`` measured in their place."""
        return ModuleMeasurements(later.compute or self.compute, later.collectives or self.collectives)


@dataclass(frozen=True)
class IsolatedMeasurements:
    """One rank's figures measured outside a training step (``runtime.recording.isolated.isolated_measurements``).

    Attributes:
        overlap: the CPU overlap microbenchmark; ``None`` on CUDA, or not run in this pass.
        pre_forward_order, post_forward_order: the FSDP modules but the root, in the order of their pre- and
            post-forward hooks.
        calls: per module, its forward calls a step.
        modules: per module FQN, its figures.
    """

    overlap: OverlapTimings | None
    pre_forward_order: tuple[str, ...]
    post_forward_order: tuple[str, ...]
    calls: dict[str, int]
    modules: dict[str, ModuleMeasurements]

    def merged(self, later: IsolatedMeasurements) -> IsolatedMeasurements:
        """These figures, with each module's from ``later`` where it measured them (passes of a few modules each).

        Raises:
            ValueError: the passes disagree on the post-forward order.
        """
        if later.post_forward_order != self.post_forward_order:
            raise ValueError(f"the isolated passes disagree on the post-forward order: {list(self.post_forward_order)}"
                             f" then {list(later.post_forward_order)}")
        modules = dict(self.modules)
        for fqn, figures in later.modules.items():
            modules[fqn] = modules.get(fqn, ModuleMeasurements()).merged(figures)
        return dataclasses.replace(self, overlap=self.overlap or later.overlap, modules=modules)


@dataclass(frozen=True)
class StepMeasurements:
    """One rank's steps of FSDP2's default plan (``runtime.recording.recorder.Recorder``, for ``tune`` and the
    in-loop tuner).

    Attributes:
        step_ms, optimizer_ms: medians over the timed steps.
        peak_bytes: the peak of each peak-measuring step; ``None`` in files that recorded none.
        optimizer_temp_bytes: what ``optimizer.step()`` allocates above its start, at its peak.
        optimizer_state_bytes: the optimizer's state on this rank.
        async_ratio: (CPU, world size >= 2) the async default's step over the default's; ``None``: not timed.
        step_faults, step_kernel_ms: page faults and kernel CPU ms a step; ``None``: not measured (in-loop).
        allocator: the allocator the rank runs under; ``None``: not known.
    """

    step_ms: float
    optimizer_ms: float
    peak_bytes: tuple[int, ...] | None
    optimizer_temp_bytes: int = 0
    optimizer_state_bytes: int = 0
    async_ratio: float | None = None
    step_faults: int | None = None
    step_kernel_ms: float | None = None
    allocator: str | None = None


@dataclass(frozen=True)
class RankMeasurements:
    """Everything one rank recorded: its rank, its steps and its isolated figures."""

    rank: int
    steps: StepMeasurements
    isolated: IsolatedMeasurements

    def to_json(self) -> JsonObject:
        """The flat JSON object of a Profile file's ``per_rank``
        (:class:`RankMeasurementsDocument`): its fields in the document's order, the later
        ones only where set, so a file release 0.1.0 wrote is written back byte for byte."""
        modules = {}
        for fqn, m in self.isolated.modules.items():
            values = {**dataclasses.asdict(m.compute or ComputeMeasurements()),
                      **dataclasses.asdict(m.collectives or CollectiveMeasurements(0.0, 0.0))}
            modules[fqn] = _written(values, ModuleMeasurementsDocument, frozenset(RELEASE_MODULE_FIELDS))
        peaks = self.steps.peak_bytes
        values = {"rank": self.rank, **dataclasses.asdict(self.steps),
                  "peak_bytes": None if peaks is None else list(peaks),
                  "overlap": dataclasses.asdict(self.isolated.overlap) if self.isolated.overlap else None,
                  "pre_forward_order": list(self.isolated.pre_forward_order),
                  "post_forward_order": list(self.isolated.post_forward_order),
                  "calls": dict(self.isolated.calls), "modules": modules}
        return _written(values, RankMeasurementsDocument, FIRST_RANK_FIELDS)

    @classmethod
    def from_document(cls, doc: RankMeasurementsDocument) -> RankMeasurements:
        """From a validated :class:`RankMeasurementsDocument`."""
        modules = {}
        for fqn, m in doc.modules.items():
            values = m.model_dump()
            compute = {k: values[k] for k in (f.name for f in dataclasses.fields(ComputeMeasurements))}
            collectives = CollectiveMeasurements(m.all_gather_ms, m.reduce_scatter_ms, m.sharded_bytes)
            modules[fqn] = ModuleMeasurements(ComputeMeasurements(**compute), collectives)
        overlap = doc.overlap
        steps = StepMeasurements(**{f.name: getattr(doc, f.name) for f in dataclasses.fields(StepMeasurements)})
        peaks = None if doc.peak_bytes is None else tuple(doc.peak_bytes)
        return cls(doc.rank, dataclasses.replace(steps, peak_bytes=peaks),
                   IsolatedMeasurements(overlap, tuple(doc.pre_forward_order), tuple(doc.post_forward_order),
                                        dict(doc.calls), modules))


RELEASE_MODULE_FIELDS = ("fwd_ms", "bwd_ms", "fwd_pre_ms", "bwd_pre_ms", "all_gather_ms", "reduce_scatter_ms",
                         "sharded_bytes", "activation_bytes", "needs_parameters_in_backward")
"""The fields of a module's figures release 0.1.0 wrote, in its order: always written, and required but for
:data:`READ_WITH_DEFAULT`."""

READ_WITH_DEFAULT = frozenset(("needs_parameters_in_backward",))
"""Release fields that profiles written before them lack: read with their declaration's default."""


ModuleMeasurementsDocument = document_of(
    "ModuleMeasurementsDocument", "One module of a rank's figures in a Profile file, flat: its "
    ":class:`ComputeMeasurements` and :class:`CollectiveMeasurements` in one object (a file writes the fields after "
    ":data:`RELEASE_MODULE_FIELDS` only where not 0 or null).", [ComputeMeasurements, CollectiveMeasurements],
    __name__, first=RELEASE_MODULE_FIELDS, read_with_default=READ_WITH_DEFAULT)

FIRST_RANK_FIELDS = ("rank", "step_ms", "optimizer_ms", "peak_bytes", "optimizer_temp_bytes", "overlap",
                     "optimizer_state_bytes", "pre_forward_order", "post_forward_order", "modules")
"""The fields of a rank's figures release 0.1.0 wrote, in its order: always written, and required but for those
older files lack (``optimizer_temp_bytes``, ``overlap``, ``optimizer_state_bytes``)."""

RankMeasurementsDocument = document_of(
    "RankMeasurementsDocument", "One rank's figures in a Profile file's ``per_rank``, flat: its "
    ":class:`IsolatedMeasurements` and :class:`StepMeasurements` in one object, :data:`FIRST_RANK_FIELDS` first, "
    "then the later ones (written only where set).", [IsolatedMeasurements, StepMeasurements], __name__,
    first=FIRST_RANK_FIELDS, read_with_default=("optimizer_temp_bytes", "overlap", "optimizer_state_bytes"),
    layout={"rank": (int, Field()), "overlap": (OverlapTimings | None, Field(None)),
            "modules": (dict[str, ModuleMeasurementsDocument], Field()),
            "calls": (dict[str, int], Field(default_factory=dict))})


def _written(values: JsonObject, document: type[BaseModel], always: Collection[str]) -> JsonObject:
    """``values`` in ``document``'s field order: those in ``always``, and the others where set (not None, 0 or
    empty)."""
    return {k: values[k] for k in document.model_fields
            if k in always or not (values[k] is None or (type(values[k]) in (int, float) and values[k] == 0)
                                   or values[k] == {})}
