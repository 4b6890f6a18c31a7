"""planner.failed_steps.agree: when the ranks go on together after a failed step, and why they stop otherwise."""

import pytest

from planner.failed_steps import StepFailure, StepReport, agree

OOM = StepFailure(2, "OutOfMemoryError: CUDA out of memory", victim=False, out_of_memory=True)


def _report(rank, failure=OOM, step=7, sequence=(40, 3)):
    return StepReport(rank, step, sequence, failure)


def test_every_rank_out_of_memory_in_step_goes_on_and_names_each_cause():
    a = agree([_report(0), _report(1)])
    assert a.go_on and a.plan == 2 and a.out_of_memory and a.why_stop == ""
    assert a.reason == "rank 0: OutOfMemoryError: CUDA out of memory; rank 1: OutOfMemoryError: CUDA out of memory"


def test_a_python_error_on_every_rank_before_a_collective_goes_on_not_out_of_memory():
    error = StepFailure(1, "ValueError: bad batch", victim=False)
    a = agree([_report(0, error), _report(1, error)])
    assert a.go_on and a.plan == 1 and not a.out_of_memory


@pytest.mark.parametrize(("reports", "why"), [
    ([_report(0, None), _report(1)], "rank(s) 0 finished the step"),
    ([_report(0, StepFailure(2, "DistBackendError: NCCL communicator was aborted", victim=True)), _report(1)],
     "because of a peer"),
    ([_report(0, step=8), _report(1)], "different steps"),
    ([_report(0, StepFailure(1, "OutOfMemoryError", False, True)), _report(1)], "different steps"),
    ([_report(0, sequence=(41, 3)), _report(1)], "different training collectives"),
])
def test_ranks_out_of_step_stop(reports, why):
    a = agree(reports)
    assert not a.go_on and why in a.why_stop


def test_the_cause_is_the_rank_that_failed_by_itself_not_its_victims():
    victim = StepFailure(3, "RuntimeError: Connection closed by peer", victim=True)
    a = agree([_report(0, victim), _report(1, OOM), _report(2, None)])
    assert a.plan == 2 and a.reason == "rank 1: OutOfMemoryError: CUDA out of memory" and not a.go_on


def test_victims_alone_name_themselves_and_no_failure_is_refused():
    victim = StepFailure(None, "RuntimeError: Timed out waiting 5000ms", victim=True)
    a = agree([_report(0, victim), _report(1, None)])
    assert a.plan is None and a.reason == "rank 0: RuntimeError: Timed out waiting 5000ms" and not a.go_on
    with pytest.raises(ValueError, match="needs a failed step"):
        agree([_report(0, None), _report(1, None)])
