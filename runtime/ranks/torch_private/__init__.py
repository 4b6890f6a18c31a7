"""Every private torch attribute this project touches, in one place, each with why it is needed.

FSDP2's public API (``FSDPModule``'s ``set_*`` methods, ``unshard``, ``reshard``) configures a model but cannot
read its state back, and the one knob a plan needs that has no public setter yet is ``_set_unshard_async_op``.
What the recorder, the memory tracker and the tests must read lives in ``torch.distributed.fsdp._fully_shard``
(``FSDPState``, ``FSDPParamGroup``, ``FSDPParam``). Everything else in the project uses public torch.

The package splits them by concept: FSDP2's per-module state (:mod:`.state`), the knobs' setters and readers
(:mod:`.knobs`), process-wide state (:mod:`.process`), the process groups' own (:mod:`.groups`); every name is
importable from the package itself.

``tests/runtime/ranks/test_torch_private.py`` builds a real FSDP2 model and exercises every function here (the
tensor-parallel reads on a fake world of 4 in ``tests/runtime/ranks/test_meshes.py``), so a
torch upgrade that renames or removes one fails that test by name instead of corrupting a profile.
:data:`TESTED_TORCH` are the torch release lines the suite has passed on (``pyproject.toml`` admits the same
range; CI runs the private-API test on each).
"""

from runtime.ranks.torch_private.groups import abort_nccl, collective_sequence, default_store, live_groups
from runtime.ranks.torch_private.knobs import (
    UnknownState,
    allocates_from_process_group,
    custom_comms,
    lazily_initialized,
    reduce_scatter_group,
    reduce_scatter_max_input_buffers,
    reduce_scatter_max_input_buffers_setter,
    separate_reduce_scatter_group,
    separate_reduce_scatter_group_setter,
    unshard_async_op,
    unshard_async_op_setter,
    unshard_in_backward,
)
from runtime.ranks.torch_private.process import (
    compiled_graphs,
    compiled_wrapper,
    fake_process_group,
    gloo_worker_threads,
    profiler_allocations,
    profiler_mark,
    profiler_marks,
    profiler_running,
)
from runtime.ranks.torch_private.state import (
    CollectiveDtypes,
    DataParallelMesh,
    SeveralParamGroupsError,
    all_gather_issued,
    clear_unsharded_grads,
    collective_dtypes,
    data_parallel_groups,
    data_parallel_mesh,
    fsdp_state,
    group_dtypes,
    is_sharded,
    param_group,
    param_group_unsharded_bytes,
    param_groups,
    prefetch_counts,
    prefetch_states,
    reshard_after_forward,
    reshard_after_forward_setting,
    set_reshard_after_forward_ranks,
    unsharded_shapes,
    watching_unshard_and_reshard,
)
from runtime.ranks.torch_private.versions import TESTED_ADVICE, TESTED_TORCH
