"""A profile's figures at another shard size: what FSDP2 shards changes with the world size, the rest stays.

[Note: What re-sharding changes]
FSDP2 shards each parameter on dim 0 over the shard group, padding dim 0 to a
multiple of the group's size: every rank holds ``ceil(dim0 / S)`` rows
(``FSDPParam._init_sharded_param``: ``chunk = ceil(size(0) / shard_world_size)``,
``padded_sharded_param_data``). At shard size ``S`` a module's

- shard (its parameters, and the sharded gradient ``foreach_reduce`` keeps
  for the optimizer) is ``sum(ceil(dim0 / S) * row_bytes)`` per rank;
- all-gather output and reduce-scatter input are ``S`` padded shards
  (``foreach_all_gather``, ``foreach_reduce``);
- unsharded parameters and gradients (autograd's, before the copy-in) and the
  activations do not depend on ``S``: the local batch is the same on every rank.

The optimizer updates the shard: its state bytes, its temporaries and its
step's time are scaled with the total shard (``optimizer.step()`` over
DTensors runs elementwise on the local tensors). Compute per rank at the same
local batch stays as recorded.

Where the profile has no parameter rows (a trace, an older profile) the shard is
``ceil(unsharded / S)``: each parameter's padding, at most one row, is left out.
"""

from __future__ import annotations

import dataclasses
import math

from planner.artifacts.profile import ModuleProfile, Profile


def shard_bytes(module: ModuleProfile, shard: int) -> int:
    """One rank's shard of ``module``'s own parameters at shard size ``shard``, bytes ([Note: What re-sharding
    changes]): from its parameter rows, padded as FSDP2 pads; without them ``ceil(unsharded_bytes / shard)``."""
    if module.parameter_rows:
        return sum(-(-dim0 // shard) * row for dim0, row in module.parameter_rows)
    return -(-module.unsharded_bytes // shard)


def collective_bytes(module: ModuleProfile, shard: int) -> int:
    """The bytes one all-gather outputs and one reduce-scatter takes in at shard size ``shard``: ``shard`` padded
    shards, bytes ([Note: What re-sharding changes]); the unsharded bytes where the rows are not recorded."""
    if module.parameter_rows:
        return shard * shard_bytes(module, shard)
    return module.unsharded_bytes


def reshard(profile: Profile, shard: int, world_size: int, mesh: tuple[int, int] | None = None) -> Profile:
    """``profile`` as a rank of a job of ``world_size`` ranks whose parameters are sharded over ``shard`` of them
    (``mesh``: HSDP's ``(replicate, shard)``, ``None`` for FSDP).

    Each module's shard, the optimizer's state, temporaries and time follow the shard ([Note: What re-sharding
    changes]); the fingerprint takes the new world size. The figures measured on the recorded job as a whole (its
    step, its peak, its ranks' own figures) are not the target's: they are left out.

    Args:
        profile: a recorded profile; its shard size is its fingerprint's (``Fingerprint.shard_size``).
        shard: ranks in a shard group (>= 1).
        world_size: ranks in all, a multiple of ``shard``.

    Raises:
        ValueError: ``shard`` < 1 or not a divisor of ``world_size``.
    """
    if shard < 1 or world_size % shard:
        raise ValueError(f"shard size {shard} does not divide world size {world_size}")
    recorded = profile.fingerprint.shard_size
    modules = {fqn: m if shard == recorded else dataclasses.replace(m, sharded_bytes=shard_bytes(m, shard))
               for fqn, m in profile.modules.items()}
    before = sum(m.sharded_bytes for m in profile.modules.values())
    ratio = sum(m.sharded_bytes for m in modules.values()) / before if before else recorded / shard
    return dataclasses.replace(
        profile, modules=modules,
        fingerprint=dataclasses.replace(profile.fingerprint, world_size=world_size, mesh=mesh),
        optimizer_state_bytes=math.ceil(profile.optimizer_state_bytes * ratio),
        optimizer_temp_bytes=math.ceil(profile.optimizer_temp_bytes * ratio),
        optimizer_ms=profile.optimizer_ms * ratio,
        measured_step_ms=None, measured_peak_bytes=None, per_rank=[])
