"""The Profile artifact: what the recorder measured on the real ranks.

A profile is the simulator's only input besides the plan. It is written by
``runtime.recording.recorder.record_profile`` and read everywhere else; the JSON is
versioned (:data:`PROFILE_SCHEMA_VERSION`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from annotated_types import Ge, Gt
from pydantic import Field, with_config

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.json_types import JsonObject
from planner.artifacts.rank_measurements import OverlapTimings, RankMeasurements, RankMeasurementsDocument
from planner.artifacts.schema import SCHEMA_VERSION, STRICT, Document, JsonFile, document_of, load_checked
from planner.errors import ProfileFormatError

PROFILE_SCHEMA_VERSION = SCHEMA_VERSION


# written only where not 0 (a checkpointed module; a backward that allocates temporaries), so a profile without
# them is the file release 0.1.0 wrote
OPTIONAL_FIELDS = ("recompute_ms", "recompute_activation_bytes", "backward_temp_bytes", "backward_post_grad_bytes",
                   "activation_post_bytes", "parameter_rows", "all_gather_link_ms", "reduce_scatter_link_ms",
                   "all_gather_wait_ms", "reduce_scatter_wait_ms")


@with_config(STRICT)
@dataclass(frozen=True)
class ModuleProfile:
    """Measured figures of one FSDP module (one ``fully_shard`` call).

    Times are in ms, sizes in bytes, all per rank (max across ranks).

    Attributes:
        fqn: the module's FQN (``""`` for the root).
        fwd_ms: forward compute, exclusive of nested FSDP modules, with
            parameters already unsharded (no communication in the window).
        bwd_ms: backward compute, same rules.
        fwd_pre_ms: the part of ``fwd_ms`` that runs before the first nested
            FSDP module's forward (equals ``fwd_ms`` for a module without
            nested FSDP modules; e.g. the embedding for a root).
        bwd_pre_ms: the part of ``bwd_ms`` that runs before the first nested
            FSDP module's backward (e.g. the LM head for a root).
        all_gather_ms: one ``unshard()`` + wait, all ranks together.
        reduce_scatter_ms: one reduce-scatter of the gradient's size and dtype.
        unsharded_bytes: all-gather output bytes (the unsharded parameters).
        sharded_bytes: this rank's parameter shard bytes.
        grad_bytes: unsharded gradient bytes (the reduce-scatter input).
        activation_bytes: bytes saved for backward during this module's
            forward (exclusive of nested FSDP modules).
        reshard_after_forward: the module's setting when recorded.
        calls: how often the module runs forward per step (its multiplicity in
            the post-forward order); times are totals over the calls.
        needs_parameters_in_backward: autograd saves some of its parameters
            for backward (a linear layer's weight); ``False`` (an embedding)
            makes ``set_unshard_in_backward(False)`` safe. ``True`` when not
            recorded, and for a checkpointed module (its recompute reads them).
        recompute_ms: activation checkpointing: the part of ``bwd_ms`` that re-runs the forward (after the
            pre-backward all-gather, before the gradient compute: ``torch.utils.checkpoint``'s recompute); 0 for a
            module not checkpointed.
        recompute_activation_bytes: the activations its recompute holds during its backward (the recorder: the
            bytes of its children's outputs there); its ``activation_bytes`` are then the checkpointed inputs.
        backward_temp_bytes: the temporaries of its backward compute before its first nested FSDP module's (all of
            it for a module without nested ones; the loss's and the LM head's for a root): the most bytes alive in
            that stretch above those alive at its start, less its gradient there (``grad_bytes`` less
            ``backward_post_grad_bytes``) and ``recompute_activation_bytes``, which the simulator allocates apart; at
            least 0. E.g. a root's gradient of the logits, batch x
            sequence x vocabulary. 0 where not measured ([Note: Backward temporaries] in
            :mod:`runtime.recording.compute_timer`).
        backward_post_grad_bytes: of ``grad_bytes``, what autograd allocates only after its nested modules'
            backward (a root's embedding, whose gradient comes last); the rest (the LM head's) comes before them.
            0: all before (not measured, as from a trace).
        activation_post_bytes: of ``activation_bytes``, those saved after its first nested module's forward (a
            root's final norm, LM head and loss: its backward uses and frees them before its nested modules'
            backward); the rest (a root's embedding) live to the end of its backward. 0: not measured (a trace, an
            older profile): the simulator splits ``activation_bytes`` by the forward's time, ``fwd_pre_ms`` of
            ``fwd_ms`` before.
        parameter_rows: per parameter the module manages itself, ``(dim-0 size, bytes per dim-0 row)`` of its
            unsharded tensor: FSDP2 shards dim 0 and pads it to a multiple of the shard group
            (``FSDPParam._init_sharded_param``), so the shard at another world size follows from them
            (:mod:`planner.simulation.resharding`). ``()``: not recorded (a trace, an older profile).
        all_gather_link_ms, reduce_scatter_link_ms: of ``all_gather_ms`` and ``reduce_scatter_ms``, what another
            cluster's link adds beyond the hosts' own work as recorded (a re-targeted profile's, ms:
            :func:`planner.simulation.link.retarget`); the in-step ``comm_scale`` does not scale it ([Note: The
            in-step scale is the hosts'] in :mod:`planner.simulation.link`). 0: as recorded.
        all_gather_wait_ms, reduce_scatter_wait_ms: where the collectives were read inside real steps
            (:attr:`InStepTimings.collective_steps`), the ranks' mean wait for late peers inside each call, apart
            from ``all_gather_ms`` and ``reduce_scatter_ms``, which are the transfer alone ([Note: Collectives on
            NCCL's clock] in :mod:`planner.traces.in_step_collectives`); the simulator does not use them. 0: not
            read in-step.
    """

    fqn: str
    fwd_ms: float
    bwd_ms: float
    fwd_pre_ms: float
    bwd_pre_ms: float
    all_gather_ms: float
    reduce_scatter_ms: float
    unsharded_bytes: int
    sharded_bytes: int
    grad_bytes: int
    activation_bytes: int
    reshard_after_forward: bool
    calls: Annotated[int, Ge(1)] = 1
    needs_parameters_in_backward: bool = True
    recompute_ms: Annotated[float, Ge(0)] = 0.0
    recompute_activation_bytes: Annotated[int, Ge(0)] = 0
    backward_temp_bytes: Annotated[int, Ge(0)] = 0
    backward_post_grad_bytes: Annotated[int, Ge(0)] = 0
    activation_post_bytes: Annotated[int, Ge(0)] = 0
    parameter_rows: tuple[tuple[int, int], ...] = ()
    all_gather_link_ms: Annotated[float, Ge(0)] = 0.0
    reduce_scatter_link_ms: Annotated[float, Ge(0)] = 0.0
    all_gather_wait_ms: Annotated[float, Ge(0)] = 0.0
    reduce_scatter_wait_ms: Annotated[float, Ge(0)] = 0.0


def root_activation_pre_bytes(root: ModuleProfile) -> int:
    """Of the root's ``activation_bytes``, those saved before its first child's forward, bytes: the simulator
    allocates them there and frees them at the end of the root's backward, and the rest after its children's
    forward, freed when its backward's part before its children's ends: the final norm, LM head and loss, whose
    autograd nodes run first in backward and free what they saved (``torch.autograd``'s ``retain_graph=False``).

    ``activation_bytes - activation_post_bytes`` where the recorder measured the split; else the forward's time
    split (``fwd_pre_ms`` of ``fwd_ms``), a guess a trace profile and an older profile fall back on."""
    if root.activation_post_bytes > 0:
        return max(0, root.activation_bytes - root.activation_post_bytes)
    return int(root.activation_bytes * root.fwd_pre_ms / root.fwd_ms) if root.fwd_ms > 0 else 0


def backward_temporaries(peak_bytes: int, grad_bytes: int, recompute_bytes: int) -> int:
    """:attr:`ModuleProfile.backward_temp_bytes` from a backward's most bytes alive above its start (the recorder's
    or a trace's), bytes: less what the simulator allocates apart, the gradient and the recomputed activations;
    at least 0 (a backward that frees its activations as it goes peaks below its gradient)."""
    return max(0, int(peak_bytes) - int(grad_bytes) - int(recompute_bytes))


@with_config(STRICT)
@dataclass(frozen=True)
class InStepTimings:
    """In-step measurements the simulator's global parameters are solved from (:mod:`planner.simulation.in_step`).

    The module figures are measured in isolation; these are not.

    Attributes:
        default_step_ms: median step time of FSDP2's default plan, timed after
            the other measurements (warm: allocator, gloo and caches), max
            across ranks. The in-step ``comm_scale`` is solved from it.
        overlap: on a CPU device, an all-gather and compute alone and at
            once (:class:`OverlapTimings`); ``None`` on GPU.
        async_default_step_ms: on a CPU device at world size 2 or more, FSDP2's default plan with
            ``unshard_async_op`` (its backward prefetch then runs beside the backward compute): ``default_step_ms``
            times the median over pairs of steps, the two plans in turn, of its step over the default's, max across
            ranks, ms. The in-step ``overlap_slowdown`` is solved from it; ``None`` where not measured (GPU, world
            size 1, the in-loop recorder, trace profiles, profiles written before it).
        allocator: the CPU memory allocator the ranks ran under (``[launch] allocator``: ``"system"`` or
            ``"jemalloc"``, :class:`planner.artifacts.names.Allocator`); ``None``: not known (a trace, an older
            profile).
        default_step_faults: minor page faults a step of ``default_step_ms`` took, over its timed steps, max across
            ranks (``getrusage``); ``None``: not measured.
        default_step_kernel_ms: CPU ms a step of ``default_step_ms`` spent in the kernel, every thread of the rank,
            max across ranks; ``None``: not measured. On a CPU device under glibc this is mostly page faults, and
            the simulator does not model it: it is in ``default_step_ms``, hence in ``comm_scale`` ([Note: The
            allocator's share of the anchor] in :mod:`planner.simulation.in_step`).
        collective_steps: the traced steps of FSDP2's default whose all-gathers and reduce-scatters gave the module
            figures' collective times, the transfer on its own clock ([Note: Collectives on NCCL's clock] in
            :mod:`planner.traces.in_step_collectives`); ``None``: they were timed in isolation
            (``runtime.recording.collective_timer``).
    """

    default_step_ms: float
    overlap: OverlapTimings | None = None
    async_default_step_ms: Annotated[float, Gt(0)] | None = None
    allocator: Literal["system", "jemalloc"] | None = None
    default_step_faults: Annotated[int, Ge(0)] | None = None
    default_step_kernel_ms: Annotated[float, Ge(0)] | None = None
    collective_steps: Annotated[int, Ge(1)] | None = None

    def kernel_share(self) -> float | None:
        """``default_step_kernel_ms`` over ``default_step_ms`` (0..1, more where several threads fault at once);
        ``None``: not measured."""
        if self.default_step_kernel_ms is None:
            return None
        return self.default_step_kernel_ms / self.default_step_ms


@dataclass(frozen=True)
class Profile(JsonFile):
    """A recorded profile of one training step (docs/architecture.md, "Artifacts").

    Attributes:
        fingerprint: the model and world this was recorded on.
        pre_forward_order: FQNs in the order their forwards start (root first).
        post_forward_order: FQNs in the order their forwards end, with
            multiplicity, as FSDP2's ``comm_ctx.post_forward_order`` records it.
        modules: per FSDP module figures, keyed by FQN.
        optimizer_ms: ``optimizer.step()`` time.
        optimizer_state_bytes: bytes of optimizer state on this rank.
        optimizer_temp_bytes: bytes ``optimizer.step()`` allocates above
            what is alive when it starts, at its peak (temporaries), this rank.
        measured_step_ms: median step time of the recording run (default plan),
            max across ranks.
        measured_peak_bytes: FSDP2's default plan's peak in the recording run,
            max across ranks, bytes (``runtime.recording.peak_memory``: the allocator's
            peak on GPU, profiled tensor bytes on CPU); ``None`` in profiles
            recorded before it was measured on CPU.
        per_rank: each rank's measurements before consolidation
            (:class:`planner.artifacts.rank_measurements.RankMeasurements`).
        consolidation: how per-rank figures were merged (``"max"``).
        microbatches: forward/backward passes per optimizer step (gradient
            accumulation); the module figures are per microbatch.
        calibration: fitted :class:`planner.simulation.simulator.SimParams` fields, used
            by every later simulation of this profile; ``None`` before any fit.
        in_step: in-step timings (:class:`InStepTimings`); without a
            calibration the simulator's parameters are solved from them
            (:func:`planner.simulation.in_step.in_step_params`). ``None`` in profiles
            recorded before they were measured.
        source: ``"recorder"`` (``prefetch-planner profile``, ``tune``) or ``"trace"`` (``profile --from-trace``,
            :mod:`planner.traces.trace_profile`).
        estimated: the figures not measured but estimated (a trace lacks them), by field name; ``()``: none.
        outside_ms: the step's work outside the FSDP modules' forward and backward, the collectives and the
            optimizer (the loss, ``zero_grad``, FSDP2's hooks, the training loop), ms per step; the simulator adds
            it to the step as serial compute ([Note: Work outside the modules] in
            :mod:`planner.simulation.simulator`). Measured from a CPU trace (:mod:`planner.traces.trace_profile`);
            0 where not measured (the recorder's profile: the in-step ``comm_scale`` absorbs it).
        post_optimizer_ms: GPU: compute-stream work the training loop queues after ``optimizer.step()`` and before
            the next step's first forward (the next batch's copy to the device, metrics, an EMA update), ms per
            step. The step's stream runs it before the first forward, and FSDP2's first all-gather waits for it
            unless the plan sets ``post_optim_event`` ([Note: Post-optimizer event] in
            :mod:`planner.simulation.simulator`). Neither the recorder nor a trace measures it: 0 unless the
            profile's author sets it.
        schema_version: :data:`PROFILE_SCHEMA_VERSION`.
    """

    fingerprint: Fingerprint
    pre_forward_order: tuple[str, ...]
    post_forward_order: tuple[str, ...]
    modules: dict[str, ModuleProfile]
    optimizer_ms: float
    optimizer_state_bytes: int = 0
    optimizer_temp_bytes: int = 0
    measured_step_ms: float | None = None
    measured_peak_bytes: int | None = None
    per_rank: list[RankMeasurements] = field(default_factory=list)
    consolidation: str = "max"
    microbatches: Annotated[int, Ge(1)] = 1
    calibration: dict[str, float] | None = None
    in_step: InStepTimings | None = None
    source: Literal["recorder", "trace"] = "recorder"
    estimated: tuple[str, ...] = ()
    outside_ms: Annotated[float, Ge(0)] = 0.0
    post_optimizer_ms: Annotated[float, Ge(0)] = 0.0
    schema_version: int = PROFILE_SCHEMA_VERSION

    WHAT: ClassVar[str] = "profile"
    ERROR: ClassVar[type[Exception]] = ProfileFormatError

    @property
    def root_fqn(self) -> str:
        """The FQN of the root FSDP module (first in pre-forward order)."""
        return self.pre_forward_order[0]

    def to_dict(self) -> JsonObject:
        """The Profile JSON object (:data:`ProfileDocument`): modules as a list.
        ``source``, ``estimated`` and ``outside_ms`` are written only for a trace profile, ``post_optimizer_ms``
        only where set, and the
        :data:`OPTIONAL_FIELDS` only where not 0, so a profile without them is the file release 0.1.0 wrote, byte
        for byte."""
        d = dataclasses.asdict(self)
        d["fingerprint"] = self.fingerprint.to_dict()
        d["per_rank"] = [r.to_json() for r in self.per_rank]
        d["modules"] = [{k: v for k, v in dataclasses.asdict(m).items() if k not in OPTIONAL_FIELDS or v}
                        for m in self.modules.values()]
        if self.source == "recorder" and not self.estimated:
            del d["source"], d["estimated"]
        if not self.outside_ms:
            del d["outside_ms"]
        if not self.post_optimizer_ms:
            del d["post_optimizer_ms"]
        if d["in_step"] is not None:
            d["in_step"] = {k: v for k, v in d["in_step"].items() if v is not None or k == "overlap"}
        return d

    @classmethod
    def document(cls) -> type[Document]:
        """:data:`ProfileDocument`."""
        return ProfileDocument

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Parse Profile JSON text (strictly: :data:`ProfileDocument`).

        Raises:
            ProfileFormatError: not JSON, not an object, an unknown schema version, a missing, unknown or
                ill-typed field (named), or a post-forward order naming a module with no figures.
        """
        doc = load_checked(ProfileDocument, text, ProfileFormatError, "profile", PROFILE_SCHEMA_VERSION, (
            "re-record or re-export it", "re-record it with `prefetch-planner tune` or a matching planner version",
            "record the profile again (`prefetch-planner profile`)"))
        modules = {m.fqn: m for m in doc.modules}
        fields = {k: v for k, v in dict(doc).items() if k not in ("modules", "per_rank")}
        profile = cls(modules=modules, per_rank=[RankMeasurements.from_document(r) for r in doc.per_rank], **fields)
        unknown = set(profile.post_forward_order) - set(modules)
        if unknown:
            raise ProfileFormatError(f"post_forward_order names modules with no figures: {sorted(unknown)}")
        return profile


ProfileDocument = document_of(
    "ProfileDocument", "A Profile JSON file: a :class:`Profile`'s declaration, its modules as a list and each rank's "
    "figures flat (:data:`planner.artifacts.rank_measurements.RankMeasurementsDocument`).", [Profile], __name__,
    layout={"schema_version": (Literal[1], Field()), "modules": (list[ModuleProfile], Field()),
            "per_rank": (list[RankMeasurementsDocument], Field(default_factory=list))})
