"""Unsharded parameter bytes alive, tracked through FSDP2's own unshard/reshard.

On a CPU device there is no allocator peak to read; what a prefetch plan
changes is how many all-gather outputs are alive at once. This tracker
watches ``FSDPParamGroup.unshard`` and ``FSDPParamGroup.reshard`` while it is
active (:func:`runtime.ranks.torch_private.watching_unshard_and_reshard`) and
counts, per parameter group, the unsharded bytes from the moment its
all-gather is issued until it is resharded: the quantity the simulator
predicts as ``SimResult.peak_unsharded_bytes``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from runtime.ranks.torch_private import (
    all_gather_issued,
    is_sharded,
    param_group_unsharded_bytes,
    watching_unshard_and_reshard,
)


class UnshardedBytesTracker:
    """Context manager: ``peak_bytes`` of unsharded parameters alive inside it (per rank, bytes)."""

    def __init__(self) -> None:
        self.alive: dict[int, int] = {}
        self.peak_bytes = 0
        self._watch = contextlib.ExitStack()

    def _unsharded(self, group: Any) -> None:
        if id(group) not in self.alive and all_gather_issued(group):
            self.alive[id(group)] = param_group_unsharded_bytes(group)
            self.peak_bytes = max(self.peak_bytes, sum(self.alive.values()))

    def _resharded(self, group: Any) -> None:
        if is_sharded(group):
            self.alive.pop(id(group), None)

    def __enter__(self) -> UnshardedBytesTracker:
        self._watch.enter_context(watching_unshard_and_reshard(self._unsharded, self._resharded))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._watch.close()
