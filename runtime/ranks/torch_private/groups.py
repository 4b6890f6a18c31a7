"""Private state of torch's process groups: the default store, the live groups, their collective counters, NCCL's
abort."""

from __future__ import annotations

from typing import Any


def default_store() -> Any:
    """The default process group's c10d store (``distributed_c10d._get_default_store``): every rank of the job
    reaches it, torchrun's agent's or rank 0's ``TCPStore``.

    Why: the failure board ([Note: A failed step on some ranks] in ``planner.failed_steps``) posts on it; the
    public API hands a store only to ``init_process_group``'s caller.
    """
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def live_groups() -> list[Any]:
    """Every process group this process holds now, the default one included (``distributed_c10d._world.pg_names``).

    Why: the groups FSDP2 and the user's own code run collectives on (the mesh's, a separate reduce-scatter
    group, a loss all-reduce on the default group) are not listed by any public API.
    """
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_names)


def collective_sequence(group: Any) -> int:
    """How many collectives ``group`` has issued on this rank (``ProcessGroup._get_sequence_number_for_group``; gloo
    and NCCL count alike on every rank of a group in step); ``-1`` where the backend keeps no count."""
    try:
        return int(group._get_sequence_number_for_group())
    except (RuntimeError, AttributeError):
        return -1


def abort_nccl(groups: list[Any]) -> int:
    """Abort the NCCL communicators of ``groups`` (``ProcessGroupNCCL.abort``, what its watchdog calls on a timeout):
    a collective waiting on one raises. Gloo has no such abort: its collectives wait for their timeout. Returns how
    many were aborted."""
    import torch

    aborted = 0
    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except (RuntimeError, AttributeError):
            continue
        if type(backend).__name__ == "ProcessGroupNCCL":
            backend.abort()
            aborted += 1
    return aborted
