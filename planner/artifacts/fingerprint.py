"""The Fingerprint: which model, on which world, a profile was recorded on and a plan was made for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pydantic import with_config

from planner.artifacts.schema import STRICT
from planner.units import count

# Bytes per element of the floating dtypes FSDP2 all-gathers and reduce-scatters in (``torch.dtype.itemsize``).
_DTYPE_BYTES = {"torch.float64": 8, "torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``"torch.bfloat16"``: 2).

    Raises:
        PlannerError: a dtype FSDP2 does not cast to under a mixed-precision policy.
    """
    from planner.errors import PlannerError

    if dtype not in _DTYPE_BYTES:
        raise PlannerError(f"dtype {dtype!r} is not a floating dtype FSDP2 casts to; use one of "
                           + ", ".join(_DTYPE_BYTES))
    return _DTYPE_BYTES[dtype]


def _short_dtype(dtype: str) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}.get(
        dtype, dtype)


@with_config(STRICT)
@dataclass(frozen=True)
class Fingerprint:
    """Identity of an FSDP-wrapped model on a given world.

    Attributes:
        module_fqns: FQNs of the FSDP modules in ``model.named_modules()``
            order; the root is ``""``.
        param_numels: unsharded parameter count per FSDP module (same order).
        param_bytes: unsharded parameter bytes per FSDP module (same order), at the dtype FSDP2 all-gathers them in:
            the ``MixedPrecisionPolicy``'s ``param_dtype`` where it casts (:attr:`mixed_precision`), else the
            parameters' own (``FSDPParam.param_dtype or orig_dtype``, ``foreach_all_gather``).
        param_numels, param_bytes: under FSDP + TP, of the tensor-parallel local tensors: what FSDP2 all-gathers
            over its dp ranks (``FSDPParam._orig_size``), not the global tensors across the TP ranks.
        world_size: ranks of the job (FSDP's dp ranks times :attr:`tensor_parallel`).
        device_type: ``"cpu"`` or ``"cuda"``.
        param_dtypes: the distinct parameter dtypes, as strings.
        torch_version: ``torch.__version__`` of the recording run.
        mesh: HSDP's ``(replicate, shard)`` (the parameters' 2-D device mesh); ``None``: FSDP over every rank.
        mixed_precision: where FSDP2's ``MixedPrecisionPolicy`` casts, the dtypes of the all-gather (and the unsharded
            parameters and gradients) and of the reduce-scatter's input, as strings (``("torch.bfloat16",
            "torch.float32")``); the sharded parameters and gradients stay in :attr:`param_dtypes`. ``None``: no cast.
        tensor_parallel: FSDP + TP: the tensor-parallel degree, the ranks of the TP dim of the (dp, tp) mesh the
            parameters live on (FSDP2's ``FSDPParam._spmd_mesh`` over its dp mesh); FSDP shards over the other
            ``world_size // tensor_parallel``. ``None``: no tensor parallelism.
    """

    module_fqns: tuple[str, ...]
    param_numels: tuple[int, ...]
    param_bytes: tuple[int, ...]
    world_size: int
    device_type: str
    param_dtypes: tuple[str, ...]
    torch_version: str
    mesh: tuple[int, int] | None = None
    mixed_precision: tuple[str, str] | None = None
    tensor_parallel: int | None = None

    @property
    def shard_size(self) -> int:
        """Ranks the parameters are sharded over: the mesh's shard dim, else every rank FSDP runs on (the dp ranks
        under FSDP + TP)."""
        return self.world_size // (self.tensor_parallel or 1) if self.mesh is None else self.mesh[1]

    def to_dict(self) -> dict:
        """The ``fingerprint`` JSON object; ``mesh`` only where set, so an FSDP fingerprint is the file earlier
        releases wrote."""
        d = dataclasses.asdict(self)
        # written where set: files without them read as before
        for optional in ("mesh", "mixed_precision", "tensor_parallel"):
            if d[optional] is None:
                del d[optional]
        return d

    def first_difference(self, other: Fingerprint) -> str | None:
        """Describe the first way ``other`` (the model at hand) differs from self.

        The torch version is informational and never a difference.

        Returns:
            ``None`` when the model matches, else a one-line description.
        """
        if self.world_size != other.world_size:
            return f"world size: plan was made for {self.world_size} ranks, this run has {other.world_size}"
        if (self.mesh, self.tensor_parallel) != (other.mesh, other.tensor_parallel):
            return f"mesh: plan was made for {self.mesh_text}, this run has {other.mesh_text}"
        if self.mixed_precision != other.mixed_precision:
            return (f"mixed precision: plan was made for {self.precision_text}, this run has {other.precision_text}")
        return self.model_difference(other)

    @property
    def precision_text(self) -> str:
        """``bf16 all-gather, fp32 reduce-scatter`` or ``no mixed precision``."""
        if self.mixed_precision is None:
            return "no mixed precision"
        gather, reduce = (_short_dtype(d) for d in self.mixed_precision)
        return f"{gather} all-gather, {reduce} reduce-scatter"

    def collective_scale(self, kind: str) -> float:
        """Bytes a collective moves per byte of the sharded parameters' own dtype (:attr:`param_dtypes`): 1 without
        mixed precision; under a policy the all-gather moves ``param_dtype`` (``foreach_all_gather``), the
        reduce-scatter and HSDP's all-reduce ``reduce_dtype`` (``foreach_reduce``: ``reduce_dtype or grad_dtype``).

        Args:
            kind: ``"all_gather"``, ``"reduce_scatter"`` or ``"all_reduce"``.
        """
        if self.mixed_precision is None:
            return 1.0
        own = _DTYPE_BYTES.get(self.param_dtypes[0], 4) if self.param_dtypes else 4
        return dtype_bytes(self.mixed_precision[0 if kind == "all_gather" else 1]) / own

    def reduce_scatter_scale(self) -> float:
        """The reduce-scatter's input bytes per unsharded-gradient byte (both per :attr:`param_bytes`: the gradient
        is computed in ``param_dtype``, then copied in at ``reduce_dtype``: ``foreach_reduce``); 1 without mixed
        precision."""
        if self.mixed_precision is None:
            return 1.0
        gather, reduce = (dtype_bytes(d) for d in self.mixed_precision)
        return reduce / gather

    @property
    def mesh_text(self) -> str:
        """``HSDP [2, 2]``, ``FSDP 2 x TP 2`` (dp ranks by TP degree) or ``FSDP``."""
        if self.tensor_parallel:
            return f"FSDP {self.shard_size} x TP {self.tensor_parallel}"
        return "FSDP" if self.mesh is None else f"HSDP {list(self.mesh)}"

    def model_difference(self, other: Fingerprint) -> str | None:
        """Describe the first way ``other``'s model differs from this one's: its FSDP modules' FQNs, their number
        or their parameter counts, whatever the world size.

        Returns:
            ``None`` when the models match, else a one-line description.
        """
        mine, theirs = list(self.module_fqns), list(other.module_fqns)
        for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
            if a != b:
                return f"FSDP module #{i}: plan has {a!r}, model has {b!r}"
        if len(mine) != len(theirs):
            return f"FSDP module count: plan has {len(mine)}, model has {len(theirs)}"
        for fqn, a, b in zip(mine, self.param_numels, other.param_numels, strict=True):
            if a != b:
                return f"parameter count of FSDP module {fqn!r}: plan has {a}, model has {b}"
        return None

    def travel_note(self, other: Fingerprint) -> str | None:
        """One line when a plan made for this fingerprint is applied on ``other``, the same model at another world
        size ([Note: Plans travel] in :mod:`planner.artifacts.plan`); ``None`` when the world sizes match."""
        if (self.world_size, self.mesh, self.tensor_parallel) == (other.world_size, other.mesh,
                                                                   other.tensor_parallel):
            return None
        here, there = count(self.world_size, "rank"), f"{other.world_size}"
        if (self.mesh, self.tensor_parallel) != (other.mesh, other.tensor_parallel):
            here, there = f"{here} ({self.mesh_text})", f"{there} ({other.mesh_text})"
        return (f"plan tuned on {here}, applied on {there}: its modules are named by FQN and apply as they are, but "
                f"its gain was confirmed on {here}, not here; confirm it on this job (tune, or the AutoTuner on its "
                "study)")
