"""Unsharded parameter bytes alive, tracked through FSDP2's own unshard/reshard.

On a CPU device there is no allocator peak to read; what a prefetch plan
changes is how many all-gather outputs are alive at once. This tracker wraps
``FSDPParamGroup.unshard`` and ``FSDPParamGroup.reshard`` while it is active
and counts, per parameter group, the unsharded bytes from the moment its
all-gather is issued until it is resharded: the quantity the simulator
predicts as ``SimResult.peak_unsharded_bytes``.
"""

from __future__ import annotations

from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def _group_bytes(group: FSDPParamGroup) -> int:
    return sum(fp._orig_size.numel() * fp.sharded_param.element_size() for fp in group.fsdp_params)


class UnshardedBytesTracker:
    """Context manager: ``peak_bytes`` of unsharded parameters alive inside it."""

    def __init__(self) -> None:
        self.alive: dict[int, int] = {}
        self.peak_bytes = 0

    def __enter__(self) -> "UnshardedBytesTracker":
        self._unshard, self._reshard = FSDPParamGroup.unshard, FSDPParamGroup.reshard
        tracker = self

        def unshard(group: FSDPParamGroup, *args, **kwargs):
            out = tracker._unshard(group, *args, **kwargs)
            if id(group) not in tracker.alive and (group._all_gather_result is not None or group.is_unsharded):
                tracker.alive[id(group)] = _group_bytes(group)
                tracker.peak_bytes = max(tracker.peak_bytes, sum(tracker.alive.values()))
            return out

        def reshard(group: FSDPParamGroup, *args, **kwargs):
            out = tracker._reshard(group, *args, **kwargs)
            if group.is_sharded:
                tracker.alive.pop(id(group), None)
            return out

        FSDPParamGroup.unshard, FSDPParamGroup.reshard = unshard, reshard
        return self

    def __exit__(self, *exc) -> None:
        FSDPParamGroup.unshard, FSDPParamGroup.reshard = self._unshard, self._reshard
