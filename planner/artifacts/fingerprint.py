"""The Fingerprint: which model, on which world, a profile was recorded on and a plan was made for."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Fingerprint:
    """Identity of an FSDP-wrapped model on a given world.

    Attributes:
        module_fqns: FQNs of the FSDP modules in ``model.named_modules()``
            order; the root is ``""``.
        param_numels: unsharded parameter count per FSDP module (same order).
        param_bytes: unsharded parameter bytes per FSDP module (same order).
        world_size: number of ranks the parameters are sharded over.
        device_type: ``"cpu"`` or ``"cuda"``.
        param_dtypes: the distinct parameter dtypes, as strings.
        torch_version: ``torch.__version__`` of the recording run.
        mesh: HSDP's ``(replicate, shard)`` (the parameters' 2-D device mesh); ``None``: FSDP over every rank.
    """

    module_fqns: tuple[str, ...]
    param_numels: tuple[int, ...]
    param_bytes: tuple[int, ...]
    world_size: int
    device_type: str
    param_dtypes: tuple[str, ...]
    torch_version: str
    mesh: tuple[int, int] | None = None

    @property
    def shard_size(self) -> int:
        """Ranks the parameters are sharded over: the mesh's shard dim, else every rank."""
        return self.world_size if self.mesh is None else self.mesh[1]

    def to_dict(self) -> dict:
        """The ``fingerprint`` JSON object; ``mesh`` only where set, so an FSDP fingerprint is the file earlier
        releases wrote."""
        d = dataclasses.asdict(self)
        if self.mesh is None:
            del d["mesh"]
        return d

    def first_difference(self, other: Fingerprint) -> str | None:
        """Describe the first way ``other`` (the model at hand) differs from self.

        The torch version is informational and never a difference.

        Returns:
            ``None`` when the model matches, else a one-line description.
        """
        if self.world_size != other.world_size:
            return f"world size: plan was made for {self.world_size} ranks, this run has {other.world_size}"
        if self.mesh != other.mesh:
            return f"mesh: plan was made for {self.mesh_text}, this run has {other.mesh_text}"
        return self.model_difference(other)

    @property
    def mesh_text(self) -> str:
        """``HSDP [2, 2]`` or ``FSDP``."""
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
        if (self.world_size, self.mesh) == (other.world_size, other.mesh):
            return None
        here, there = f"{self.world_size} ranks", f"{other.world_size}"
        if self.mesh != other.mesh:
            here, there = f"{here} ({self.mesh_text})", f"{there} ({other.mesh_text})"
        return (f"plan tuned on {here}, applied on {there}: its modules are named by FQN and apply as they are, but "
                f"its gain was confirmed on {here}, not here; confirm it on this job (tune, or the AutoTuner on its "
                "study)")
