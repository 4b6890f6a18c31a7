"""[Note: Collectives on NCCL's clock]: a call's transfer is its least kernel time across ranks, the rest of each
rank's is the wait for late ranks; the traced steps' calls pair up across ranks by step, module, kind and ordinal."""

from __future__ import annotations

import pytest

from planner.traces.fsdp_steps import rank_steps
from planner.traces.in_step_collectives import CollectiveCall, in_step_collectives, rank_calls
from planner.traces.kineto import read_trace
from tests.planner.traces.synthetic_trace import write_traces


def test_the_transfer_is_the_least_kernel_time_across_ranks_and_the_rest_is_waiting(tmp_path):
    """Rank 1 starts ``layers.0``'s all-gathers 200 us early and ends with rank 0 (``synthetic_trace``): its kernel
    spins 200 us longer, waiting for rank 0. The NCCL kernel alone counts, not the copy-out after it."""
    per_rank = [rank_calls(rank_steps(read_trace(path))) for path in write_traces(tmp_path)]
    got = in_step_collectives(per_rank)
    ag = got[("layers.0", "all_gather")]
    assert ag.transfer_ms == pytest.approx(0.3) and ag.wait_ms == pytest.approx(0.1)  # (0 + 200 us) / 2 ranks
    assert ag.calls == 2  # its forward and its backward all-gather: resharded after forward
    assert {kind for _, kind in got} == {"all_gather", "reduce_scatter"}


def test_a_call_not_traced_on_every_rank_is_left_out():
    rank0 = [CollectiveCall(0, "a", "all_gather", 0, 2.0), CollectiveCall(0, "a", "all_gather", 1, 9.0)]
    rank1 = [CollectiveCall(0, "a", "all_gather", 0, 3.0)]
    assert in_step_collectives([rank0, rank1]) == in_step_collectives([rank0[:1], rank1])  # ordinal 1: rank 0's
    got = in_step_collectives([rank0[:1], rank1])[("a", "all_gather")]
    assert (got.transfer_ms, got.wait_ms, got.calls) == (2.0, 0.5, 1)
    with pytest.raises(ValueError, match="no collective was traced on all 2 ranks"):
        in_step_collectives([rank0[1:], rank1])
