"""``PREFETCH_PLANNER=off`` agreed across ranks (:mod:`planner.switch`; [Note: The ranks agree on the switch])."""

from __future__ import annotations

import torch.distributed as dist

from planner.errors import SwitchError
from planner.switch import off_line, switched_off
from runtime.ranks.collectives import gather_objects


def agreed_off(group: dist.ProcessGroup, entry: str) -> str | None:
    """Whether the switch is off on any rank (collective on ``group``: every rank calls it): the line ``entry`` logs
    then (it names the ranks that were off where not all were), else ``None``.

    Raises:
        SwitchError: on every rank, where some rank's ``PREFETCH_PLANNER`` is neither on nor off (the message names
            that rank): a bad value raising on one rank alone would leave the others waiting.
    """
    try:
        local: bool | str = switched_off()
    except SwitchError as e:
        local = str(e)
    every = gather_objects(local, group)
    bad = next(((r, v) for r, v in enumerate(every) if isinstance(v, str)), None)
    if bad is not None:
        raise SwitchError(f"rank {bad[0]}: {bad[1]}")
    off = [r for r, v in enumerate(every) if v]
    if not off:
        return None
    return off_line(entry, off if len(off) < len(every) else None)
